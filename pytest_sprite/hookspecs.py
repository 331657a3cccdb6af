"""Hooks pytest-sprite calls, for a project's conftest.py or plugin to implement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

__all__ = ["pytest_sprite_before_fork", "pytest_sprite_report"]


@pytest.hookspec
def pytest_sprite_report(report: dict[str, Any], config: pytest.Config) -> None:
    """Add or change fields of the ``--sprite-report`` JSON document before it is written.

    ``report`` is the whole document (see ``report.schema.json``); change it in place, e.g.
    ``report["environment"]["cluster"] = "aurora"``. Called once per session, in the controller.
    """


@pytest.hookspec
def pytest_sprite_before_fork(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Load, once, what many ranks tests need alike, in the process their ranks are forked from.

    Called before the first test child is forked: in the controller for ``--launcher=local`` (whose
    agents are its forks), in each launched agent otherwise, with every collected item. Every test child
    and sub-world rank then starts with it loaded, copied on write instead of built again. Build CPU
    objects or import modules here; never touch a device or make a process group, as every process
    forked from this one must start fresh. The ``lora_qwen`` fixture builds its model here when a
    collected test uses it (issue 22: a build per test child and per sub-world zygote before).
    """
