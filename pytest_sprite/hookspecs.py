"""Hooks pytest-sprite calls, for a project's conftest.py or plugin to implement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .launch.launchers import LauncherRegistry
    from .planted_faults import FaultRegistry
    from .report.kinds import ReportTables

__all__ = [
    "pytest_sprite_add_faults",
    "pytest_sprite_add_launchers",
    "pytest_sprite_add_report_tables",
    "pytest_sprite_before_fork",
    "pytest_sprite_report",
]


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
    collected test uses it (a build per test child and per sub-world zygote before).
    """


@pytest.hookspec
def pytest_sprite_add_launchers(launchers: LauncherRegistry) -> None:
    """Add ``--launcher`` values: ``launchers.add("flux", FluxLauncher)``.

    The value is a class implementing :class:`~pytest_sprite.launch.launchers.base.Launcher` (any callable
    returning a fresh one), or ``"module:Class"``, imported only when a session launches with it. Called once
    per session at configure, before ``--launcher`` is validated; the built-in launchers register here too.
    """


@pytest.hookspec
def pytest_sprite_add_faults(faults: FaultRegistry) -> None:
    """Add planted faults: ``faults.add(Fault(name=..., arms=..., by=..., planter=...))``.

    A :class:`~pytest_sprite.planted_faults.Fault` names its :class:`~pytest_sprite.planted_faults.Planter`, the arms it may be
    planted on and the checks that must reject it; ``run(fault=name)`` plants it and ``expect_fault_rejected``
    judges it. Called once per session at configure, in every process; the built-in faults register here too.
    """


@pytest.hookspec
def pytest_sprite_add_report_tables(tables: ReportTables) -> None:
    """Add the report table of an assertion kind: ``tables.add(Kind(kind=..., title=..., headers=..., rows=...))``.

    ``rows`` turns one ``to_dict()`` payload whose ``kind`` matches into table rows with their verdicts; the
    terminal tables and the JUnit properties read it. Called the first time a report shows an assertion, in
    the controller; the built-in tables register here too.
    """
