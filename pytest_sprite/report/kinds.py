"""What the reports know about each assertion kind: table columns, rows, verdicts and key figures.

Every report form (terminal tables, JUnit properties, offline ``judge``) reads an assertion only through
its ``to_dict()`` payload and the :class:`Kind` registered here for its ``kind``. A new assertion joins
by registering one :class:`Kind` through the ``pytest_sprite_add_report_tables`` hook: a title, the column
headers, and a function that turns one payload into rows, each with its verdict. Each assertion defines its
own kind beside it (``PARITY_KIND``, ``CRITERION_KIND``, ``RESUME_KIND``); this module registers them
through the same hook. An unregistered kind still shows, in a generic table of its verdict. No torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

import pytest

from pytest_sprite.assertions.criterion.table import CRITERION_HEADERS, CRITERION_KIND, criterion_rows
from pytest_sprite.assertions.parity import PARITY_HEADERS, PARITY_KIND, parity_rows, parity_verdict
from pytest_sprite.assertions.resume.results import RESUME_GAPS, RESUME_HEADERS, RESUME_KIND, resume_rows
from pytest_sprite.assertions.tables import Kind, Row, figure_cell
from pytest_sprite.errors import SpriteUsageError

__all__ = [
    "BUILTIN_KINDS",
    "CRITERION_HEADERS",
    "KINDS",
    "PARITY_HEADERS",
    "RESUME_GAPS",
    "RESUME_HEADERS",
    "Kind",
    "Row",
    "criterion_rows",
    "get_kind",
    "load_report_tables",
    "parity_rows",
    "parity_verdict",
    "register_kind",
    "resume_rows",
]


KINDS: dict[str, Kind] = {}
"""Kind name -> how to show it: the built-in tables, and a session's plugins' once a report loads them."""


class ReportTables:
    """What ``pytest_sprite_add_report_tables`` fills: one :class:`Kind` per assertion kind."""

    def __init__(self) -> None:
        self.kinds: dict[str, Kind] = {}

    def add(self, kind: Kind) -> None:
        """Register the table of ``kind.kind``; a kind added twice is an error (one table per kind)."""
        if kind.kind in self.kinds:
            raise SpriteUsageError(
                f"report table for assertion kind {kind.kind!r} is registered twice "
                "(pytest_sprite_add_report_tables); one table per kind"
            )
        self.kinds[kind.kind] = kind


def register_kind(kind: Kind) -> Kind:
    """Add (or replace) a kind's table outside a session; returns it, so a module can keep a reference."""
    KINDS[kind.kind] = kind
    return kind


_loaded_key: Final = pytest.StashKey[bool]()


def load_report_tables(config: pytest.Config) -> None:
    """Make the session's tables :data:`KINDS`: ask every plugin (``pytest_sprite_add_report_tables``), once.

    Called the first time a report shows an assertion, so that a session without one loads no table code.
    """
    if config.stash.get(_loaded_key, False):
        return
    config.stash[_loaded_key] = True
    module = sys.modules[__name__]
    if not config.pluginmanager.is_registered(module):
        config.pluginmanager.register(module, "sprite-report-tables")
    tables = ReportTables()
    config.hook.pytest_sprite_add_report_tables(tables=tables)
    KINDS.clear()
    KINDS.update(tables.kinds)


def get_kind(name: str) -> Kind:
    """The registered kind, or a generic one that shows each payload's ``passed`` as its verdict."""
    known = KINDS.get(name)
    if known is not None:
        return known
    return Kind(
        kind=name,
        title=f"{name} (no table registered for this kind)",
        headers=("Result",),
        rows=_generic_rows,
        bad_verdicts=frozenset({"FAIL"}),
        verdict_order=("pass", "FAIL"),
    )


def _generic_rows(payload: Mapping[str, Any]) -> list[Row]:
    passed = payload.get("passed")
    verdict = "pass" if passed else "FAIL"
    return [
        Row(cells=(str(passed),), verdict=verdict, figures={"passed": bool(passed)}, label=payload["kind"])
    ]


# -- crash consistency -----------------------------------------------------------------------------

CRASH_HEADERS: tuple[str, ...] = (
    "Target",
    "Point",
    "Rank",
    "File",
    "Event",
    "Torn",
    "Newest complete",
    "Resumed from",
    "Weight diff",
    "Detail",
)
CRASH_VERDICTS: tuple[str, ...] = ("PASS", "HARD_FAIL", "SILENT_DIVERGENCE", "LOST_WORK")
"""Row verdicts of a crash matrix (``pytest_sprite.assertions.crash_consistency.VERDICTS``)."""


def _short(text: str, limit: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _weight_diff(value: float | str | None) -> str:
    return figure_cell(value)


def _matrix_row(payload: Mapping[str, Any], target: str, detail: str) -> Row:
    counts = payload["counts"]
    return Row(
        cells=(target, "all", str(payload["ranks"]), "-", "-", "-", "-", "-", "-", _short(detail, 110)),
        verdict="pass" if payload["passed"] else "FAIL",
        figures={
            **{v: int(counts.get(v, 0)) for v in CRASH_VERDICTS},
            "crash_points": len(payload["rows"]),
            "control": str(payload["control"]["verdict"]),
            "fault_free_diff": payload["fault_free_diff"],
        },
        label="matrix",
    )


def crash_rows(payload: Mapping[str, Any]) -> list[Row]:
    """The matrix's row (``pass`` / ``FAIL``, its counts per verdict and its problems), then every crash
    point that did not PASS, and the control run when it did not.

    The matrix row carries the assertion's verdict (a LOST_WORK point fails it only with
    ``allow_lost_work=False``; a non-deterministic target fails it with no bad point); the point rows
    are the evidence, in event order. PASS points are only counted: a matrix has hundreds.
    """
    counts = payload["counts"]
    control = payload["control"]
    total = len(payload["rows"])
    summary = " + ".join(f"{counts[v]} {v}" for v in CRASH_VERDICTS if counts.get(v))
    detail = f"{summary or 'no'} of {total} crash points (control {control['verdict']})"
    # The problems besides the counts (which the detail already gives): determinism, flakes, the control.
    problems = [str(p) for p in payload["problems"] if not str(p).endswith(f" of {total} crash points")]
    if problems:
        detail += "; " + "; ".join(problems)
    target = str(payload["target"])
    rows = [_matrix_row(payload, target, detail)]
    for point in [control, *payload["rows"]]:
        if point["verdict"] == "PASS":
            continue
        is_control = point["point"] == 0
        rows.append(
            Row(
                cells=(
                    target,
                    "control" if is_control else str(point["point"]),
                    "-" if point["rank"] is None else str(point["rank"]),
                    str(point["file"]),
                    str(point["event"]),
                    "torn" if point["torn"] else "",
                    point["newest_complete"] or "-",
                    point["resumed_from"] or "-",
                    _weight_diff(point["weight_diff"]),
                    _short(point["error"] or point["note"] or ""),
                ),
                verdict=str(point["verdict"]),
                figures={
                    "rank": point["rank"],
                    "file": point["file"],
                    "event": point["event"],
                    "torn": bool(point["torn"]),
                    "weight_diff": point["weight_diff"],
                },
                label="control" if is_control else f"point {point['point']}",
            )
        )
    return rows


CRASH_KIND: Final = Kind(
    kind="crash_consistency",
    title="Crash consistency (every save's file events; PASS points counted, the others listed)",
    headers=CRASH_HEADERS,
    rows=crash_rows,
    bad_verdicts=frozenset({"FAIL", "HARD_FAIL", "SILENT_DIVERGENCE"}),
    verdict_order=("pass", "FAIL", *CRASH_VERDICTS),
    unlisted="PASS (not listed)",
)

BUILTIN_KINDS: Final = (PARITY_KIND, CRITERION_KIND, RESUME_KIND, CRASH_KIND)
"""The assertions' own tables: each is defined once, beside its assertion."""


@pytest.hookimpl(tryfirst=True)  # the built-ins first in every list
def pytest_sprite_add_report_tables(tables: ReportTables) -> None:
    """The built-in tables, registered like a project's."""
    for kind in BUILTIN_KINDS:
        tables.add(kind)


def _builtin_tables() -> dict[str, Kind]:
    """The tables outside a session (``judge`` reading a stored report): the built-in hook's alone."""
    tables = ReportTables()
    pytest_sprite_add_report_tables(tables)
    return tables.kinds


KINDS.update(_builtin_tables())


def verdict_counts(verdicts: Sequence[str], kind: Kind) -> str:
    """``3 pass, 1 FAIL`` in the kind's verdict order; verdicts seen but not ordered follow."""
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v] = counts.get(v, 0) + 1
    order = [v for v in kind.verdict_order if v in counts] + [
        v for v in counts if v not in kind.verdict_order
    ]
    return ", ".join(f"{counts[v]} {v}" for v in order)
