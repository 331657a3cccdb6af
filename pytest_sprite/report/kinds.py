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

# -- criterion v2 ----------------------------------------------------------------------------------

CRITERION_HEADERS: tuple[str, ...] = (
    "Comparison",
    "Ranks",
    "Global batch",
    "Pre-clip norm rel",
    "Max tensor gradient gap",
    "Update rel L2",
    "Max tensor update gap",
    "Tensors over",
)


def criterion_rows(payload: Mapping[str, Any]) -> list[Row]:
    """The scored step-0 rows (ddp, fsdp against split), the validity gate, and one row for the invariants.

    A scored row's verdict is ``void`` when the gate failed (the run cannot separate error from rounding;
    void is never a pass); a row of an arm carrying a fault reads ``rejected`` when the criterion failed on
    a faulted arm's check, else ``NOT REJECTED``.
    """
    void = payload["verdict"] == "void"
    # A fault counts as rejected when the criterion failed on a check of a faulted arm (any check: the
    # invariants catch some faults that the scored step-0 figures cannot see).
    caught = payload["verdict"] == "fail" and any(f.get("fault") for f in payload["failed"])
    ranks, batch = str(payload["ranks"]), str(payload["global_batch"])
    rows = []
    for c in [*payload["scored"], payload["gate"]]:
        gate = c["role"] == "gate"
        if c.get("fault") and not void:
            verdict = "rejected" if caught else "NOT REJECTED"
        elif void and not gate:
            verdict = "void"
        else:
            verdict = "pass" if c["passed"] else ("void" if gate else "FAIL")
        rows.append(
            Row(
                cells=(
                    f"gate ({c['label']})" if gate else f"{c['label']} vs split",
                    ranks,
                    batch,
                    _figure(c["pre_norm_rel"]),
                    _figure(c["max_gradient_gap"]),
                    _figure(c["update_rel_l2"]),
                    _figure(c["max_update_gap"]),
                    f"{c['gradients_over']}+{c['updates_over']} of {2 * c['tensors']}",
                ),
                verdict=verdict,
                figures={
                    "pre_norm_rel": c["pre_norm_rel"],
                    "max_gradient_gap": c["max_gradient_gap"],
                    "update_rel_l2": c["update_rel_l2"],
                    "max_update_gap": c["max_update_gap"],
                },
                label="gate" if gate else c["label"],
            )
        )
    broken = [i for i in payload["invariants"] if not i["passed"]]
    faults_only = bool(broken) and all(f.get("fault") for i in broken for f in i["failures"])
    rows.append(
        Row(
            cells=(
                f"invariants ({len(payload['invariants']) - len(broken)} of {len(payload['invariants'])} hold)",
                ranks,
                batch,
                *(["-"] * 5),
            ),
            verdict="pass" if not broken else ("rejected" if faults_only else "FAIL"),
            figures={"broken": ",".join(i["name"] for i in broken)},
            label="invariants",
        )
    )
    return rows


register_kind(
    Kind(
        kind="criterion_v2",
        title="BF16 criterion v2 (scored step-0 checks against split; gate split_premul)",
        headers=CRITERION_HEADERS,
        rows=criterion_rows,
        bad_verdicts=frozenset({"FAIL", "void", "NOT REJECTED"}),
        verdict_order=("pass", "FAIL", "void", "rejected", "NOT REJECTED"),
    )
)

# Further kinds register here, one Kind each, from their payloads' to_dict() fields:
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
