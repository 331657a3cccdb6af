"""Hooks pytest-sprite calls, for a project's conftest.py or plugin to implement."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["pytest_sprite_report"]


@pytest.hookspec
def pytest_sprite_report(report: dict[str, Any], config: pytest.Config) -> None:
    """Add or change fields of the ``--sprite-report`` JSON document before it is written.

    ``report`` is the whole document (see ``report.schema.json``); change it in place, e.g.
    ``report["environment"]["cluster"] = "aurora"``. Called once per session, in the controller.
    """
