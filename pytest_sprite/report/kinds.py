"""What the reports know about each assertion kind: table columns, rows, verdicts and key figures.

Every report form (terminal tables, JUnit properties, offline ``judge``) reads an assertion only through
its ``to_dict()`` payload and the :class:`Kind` registered here for its ``kind``. A new assertion joins
by registering one :class:`Kind` (``register_kind``): a title, the seed's column headers, and a function
that turns one payload into rows, each with its verdict. An unregistered kind still shows, in a generic
table of its verdict. Pure: no torch, no pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_sprite.assertions._tables import format_count, format_figure, format_limit

__all__ = ["KINDS", "Kind", "Row", "get_kind", "register_kind"]


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of a kind's table: the cells under the kind's headers, and the row's verdict."""

    cells: tuple[str, ...]
    verdict: str
    """A word from the kind's ``verdicts``, e.g. ``pass`` or ``FAIL``."""
    figures: Mapping[str, float | int | str | None]
    """Key figures of the row for JUnit properties (name -> value)."""
    label: str
    """What the row is about (an arm, a crash point), used in property names."""


@dataclass(frozen=True, kw_only=True)
class Kind:
    """How the reports show one assertion kind."""

    kind: str
    """The ``kind`` of the payloads (``parity``, ``criterion_v2``, ``resume``, ``crash_consistency``)."""
    title: str
    """Heading of the kind's terminal table."""
    headers: tuple[str, ...]
    """Column headers after ``Test`` (the ``Verdict`` column is added by the table)."""
    rows: Callable[[Mapping[str, Any]], list[Row]]
    """One payload -> its rows."""
    bad_verdicts: frozenset[str]
    """Verdicts that are failures: shown first, and a stored one that re-judges into it fails ``judge``."""
    verdict_order: tuple[str, ...] = ()
    """Order of the counts line (verdicts not listed follow in order of appearance)."""


KINDS: dict[str, Kind] = {}
"""Kind name -> how to show it. Extend with :func:`register_kind`."""


def register_kind(kind: Kind) -> Kind:
    """Add (or replace) a kind's table; returns it, so a module can keep a reference."""
    KINDS[kind.kind] = kind
    return kind


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


# -- parity ----------------------------------------------------------------------------------------

PARITY_HEADERS: tuple[str, ...] = (
    "Arm",
    "Ranks",
    "Global batch",
    "rtol",
    "Pre-clip norm rel",
    "Post-clip norm rel",
    "Update rel L2",
    "Frozen changed",
)


def parity_verdict(arm: Mapping[str, Any]) -> str:
    """``pass`` / ``FAIL`` for a clean arm; ``rejected`` / ``NOT REJECTED`` for an arm carrying a fault.

    A planted fault is meant to fail the check (``expect_fault_rejected``); a faulted arm that passes is
    the failure.
    """
    if arm.get("fault"):
        return "NOT REJECTED" if arm["passed"] else "rejected"
    return "pass" if arm["passed"] else "FAIL"


def _figure(value: float | str) -> str:
    return value if isinstance(value, str) else format_figure(value)


def parity_rows(payload: Mapping[str, Any]) -> list[Row]:
    """One row per arm, in the seed's FP32 layout, with the tolerance the arm was held to."""
    rtol = format_limit(float(payload["rtol"]))
    rows = []
    for arm in payload["arms"]:
        rows.append(
            Row(
                cells=(
                    arm["label"],
                    str(arm["ranks"]),
                    str(arm["global_batch"]),
                    rtol,
                    _figure(arm["pre_norm_rel"]),
                    _figure(arm["post_norm_rel"]),
                    _figure(arm["update_rel_l2"]),
                    format_count(arm["frozen_changed"], arm["frozen_total"]),
                ),
                verdict=parity_verdict(arm),
                figures={
                    "pre_norm_rel": arm["pre_norm_rel"],
                    "post_norm_rel": arm["post_norm_rel"],
                    "update_rel_l2": arm["update_rel_l2"],
                    "frozen_changed": arm["frozen_changed"],
                    "rtol": payload["rtol"],
                },
                label=arm["label"],
            )
        )
    return rows


register_kind(
    Kind(
        kind="parity",
        title="FP32 parity against the single-device reference",
        headers=PARITY_HEADERS,
        rows=parity_rows,
        bad_verdicts=frozenset({"FAIL", "NOT REJECTED"}),
        verdict_order=("pass", "FAIL", "rejected", "NOT REJECTED"),
    )
)

# Further kinds register here, one Kind each, from their payloads' to_dict() fields:
#   criterion_v2       rows per arm and step-0 check; verdicts pass / fail / void (void is never a pass)
#   resume             rows per resumed run; verdicts pass / FAIL
#   crash_consistency  rows per crash point; PASS / HARD_FAIL / SILENT_DIVERGENCE / LOST_WORK


def verdict_counts(verdicts: Sequence[str], kind: Kind) -> str:
    """``3 pass, 1 FAIL`` in the kind's verdict order; verdicts seen but not ordered follow."""
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v] = counts.get(v, 0) + 1
    order = [v for v in kind.verdict_order if v in counts] + [
        v for v in counts if v not in kind.verdict_order
    ]
    return ", ".join(f"{counts[v]} {v}" for v in order)
