"""A ranks test's report merged over its ranks, whose captured output names each rank.

The merged report keeps every rank's sections (``Captured stdout call [rank 1]``), which the terminal and
pytest-html show one per rank. JUnit's ``system-out`` / ``system-err`` (``-o junit_logging=...``) read
the report's ``capstdout``, ``capstderr`` and ``caplog`` instead, which join the sections' texts: here they
put a line naming the rank and phase before each rank's text, so a CI that keeps the XML can tell which
rank printed what. The report crosses processes (pytest-xdist) as a plain ``TestReport`` with a flag,
which this module's hooks turn back into this class where the plugin is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any, Final

import pytest

__all__ = ["RANKED_ATTR", "RankedReport", "pytest_report_from_serializable", "pytest_report_to_serializable"]

RANKED_ATTR: Final = "sprite_ranked"
"""Set on a merged report; survives serialization, so the other side can rebuild a :class:`RankedReport`."""

_RANK_SECTION: Final = re.compile(r"^(?P<prefix>Captured \w+) (?P<when>\w+) \[(?P<rank>rank \d+)\]$")


class RankedReport(pytest.TestReport):
    """A ``TestReport`` whose joined captured output names the rank (and phase) of each part."""

    def _joined(self, prefix: str) -> str:
        parts = []
        for name, content in self.sections:
            found = _RANK_SECTION.match(name)
            if found is None or found["prefix"] != prefix:
                if name.startswith(prefix):
                    parts.append(content)
                continue
            parts.append(f"[{found['rank']}, {found['when']}]\n{content}")
        return "".join(part if part.endswith("\n") else part + "\n" for part in parts) if parts else ""

    @property
    def capstdout(self) -> str:
        return self._joined("Captured stdout")

    @property
    def capstderr(self) -> str:
        return self._joined("Captured stderr")

    @property
    def caplog(self) -> str:
        return self._joined("Captured log")


def ranked_report(**fields: Any) -> RankedReport:
    """A merged report (``TestReport``'s own arguments), flagged so it stays one across processes."""
    report = RankedReport(**fields)
    setattr(report, RANKED_ATTR, True)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(report: Any) -> Generator[None, Any, Any]:
    """Serialized, a merged report is a plain ``TestReport`` (any reader can load it) with the flag."""
    data = yield
    if isinstance(report, RankedReport) and isinstance(data, dict):
        data["$report_type"] = "TestReport"
    return data


@pytest.hookimpl(wrapper=True)
def pytest_report_from_serializable(data: Any) -> Generator[None, Any, Any]:
    """A flagged ``TestReport`` is a merged one again (pytest-xdist's controller writes the JUnit XML)."""
    report = yield
    if isinstance(report, pytest.TestReport) and getattr(report, RANKED_ATTR, False):
        report.__class__ = RankedReport
    return report
