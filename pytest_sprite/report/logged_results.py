"""The session's results in the controller, built from the reports pytest logs.

Every report form reads this one store. It is filled from ``pytest_runtest_logreport`` only, so it is
the same whether a test ran here, on ranks (the controller logs the merged reports) or in a
pytest-xdist worker (xdist's controller logs the worker's reports): the assertion payloads
(``sprite_assertions``) and the per-rank outcomes (``sprite_ranks``) travel on the reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from pytest_sprite.glue.recorded_results import RANKS_ATTR, REPORT_ATTR
from pytest_sprite.plumbing.phases import PROFILE_PROPERTY

__all__ = ["ResultStore", "TestEntry"]


@dataclass
class TestEntry:
    """What the reports say about one test."""

    __test__ = False  # not a pytest test class despite its name

    nodeid: str
    location: tuple[str, int | None, str]
    keywords: list[str]
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``setup`` / ``call`` / ``teardown`` -> outcome, duration, and the crash line when it failed."""
    assertions: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    categories: dict[str, str] = field(default_factory=dict)
    """Phase -> pytest's status category (passed, failed, error, skipped, xfailed, xpassed, '')."""
    profile: dict[str, float] | None = None
    """Under ``--sprite-profile``, a ranks test: rank 0's seconds by phase, its setup, call and teardown summed."""

    @property
    def outcome(self) -> str:
        """pytest-json-report's outcome: an errored setup or teardown wins over the call's outcome."""
        for phase in ("setup", "teardown"):
            if self.categories.get(phase) == "error":
                return "error"
        call = self.categories.get("call")
        if call:
            return call
        setup = self.categories.get("setup")
        return setup or "passed"

    @property
    def duration(self) -> float:
        return sum(float(p["duration"]) for p in self.phases.values())


class ResultStore:
    """nodeid -> :class:`TestEntry`, in the order the tests were first reported."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, TestEntry] = {}

    def add(self, report: pytest.TestReport) -> TestEntry:
        """Take in one phase's report."""
        entry = self.tests.get(report.nodeid)
        if entry is None:
            location = report.location
            entry = TestEntry(
                nodeid=report.nodeid,
                location=(str(location[0]), location[1], str(location[2])),
                keywords=sorted(str(k) for k in report.keywords if k),
            )
            self.tests[report.nodeid] = entry
        category = self.config.hook.pytest_report_teststatus(report=report, config=self.config)[0]
        entry.categories[report.when] = category
        phase: dict[str, Any] = {"outcome": report.outcome, "duration": report.duration}
        if report.failed:
            phase["longrepr"] = _crash_line(report)
        entry.phases[report.when] = phase
        entry.assertions.extend(getattr(report, REPORT_ATTR, None) or [])
        for prop in report.user_properties:
            if not is_profile_property(prop):
                continue
            entry.profile = profile = entry.profile or {}
            totals = cast("dict[str, float]", prop[1])
            for phase_name, seconds in totals.items():
                profile[phase_name] = profile.get(phase_name, 0.0) + float(seconds)
        ranks = getattr(report, RANKS_ATTR, None)
        if ranks:
            entry.ranks = list(ranks)
        return entry

    def failed(self, nodeid: str) -> bool:
        entry = self.tests.get(nodeid)
        return entry is not None and entry.outcome in ("failed", "error")


def is_profile_property(prop: object) -> bool:
    """Whether a user property is the phase totals a rank's report carries (``--sprite-profile``); whatever
    else a test put there is left alone (a malformed one is junitxml's to refuse, not this store's)."""
    return (
        isinstance(prop, (tuple, list))
        and len(prop) == 2
        and prop[0] == PROFILE_PROPERTY
        and isinstance(prop[1], dict)
    )


def _crash_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    text = str(report.longrepr).strip()
    return text.splitlines()[-1] if text else ""
