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
    unlisted: str = "(not listed)"
    """What a row missing from a payload's rows stands for (a crash matrix lists only the points that did
    not PASS), for ``judge``'s account of verdicts that changed."""


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

# -- resume ----------------------------------------------------------------------------------------

RESUME_HEADERS: tuple[str, ...] = (
    "Run",
    "Arm",
    "Ranks",
    "Global batch",
    "Reshard ranks",
    "Failed checks",
    "Loss gap",
    "Pre-clip norm gap",
    "Update gap",
    "Adam m gap",
    "Adam v gap",
)
RESUME_GAPS: tuple[str, ...] = ("loss", "pre_clip_norm", "update", "adam_m", "adam_v")
"""The reported continuation gaps of a resumed arm, in the seed's column order."""


def _gaps_arm(payload: Mapping[str, Any], arm: Mapping[str, Any]) -> str | None:
    """The ``gaps`` entry of a restore: the resume's under the strategy, reshard and export under a suffix."""
    suffix = {"resume": "", "reshard": "_reshard", "export": "_export"}.get(str(arm["role"]))
    return None if suffix is None else f"{payload['strategy']}{suffix}"


def resume_rows(payload: Mapping[str, Any]) -> list[Row]:
    """One row per checked restore (resume, reload, reshard, export), with the run's verdict-table columns
    and the continuation gaps reported for that arm (``-`` for the reload, which trains nothing compared).

    The gaps are reported, never required: the verdict is the required checks'. An arm carrying a fault
    reads ``rejected`` when a required check caught it, else ``NOT REJECTED``.
    """
    gaps = {str(g["arm"]): g for g in payload["gaps"]}
    reshard = f"{payload['ranks']} → {payload['reshard_ranks']}" if payload.get("reshard_ranks") else "-"
    rows = []
    for arm in payload["arms"]:
        gap = gaps.get(_gaps_arm(payload, arm) or "")
        failed = ", ".join(dict.fromkeys(str(f["check"]) for f in arm["failed"])) or "-"
        if arm.get("fault"):
            verdict = "NOT REJECTED" if arm["passed"] else "rejected"
        else:
            verdict = "pass" if arm["passed"] else "FAIL"
        figures: dict[str, float | int | str | None] = {"failed": failed if failed != "-" else ""}
        figures.update({k: gap[k] for k in RESUME_GAPS} if gap is not None else {})
        rows.append(
            Row(
                cells=(
                    str(payload["run"]),
                    str(arm["label"]),
                    str(arm["ranks"]),
                    str(payload["global_batch"]),
                    reshard,
                    failed,
                    *(_figure(gap[k]) if gap is not None else "-" for k in RESUME_GAPS),
                ),
                verdict=verdict,
                figures=figures,
                label=str(arm["label"]),
            )
        )
    return rows


register_kind(
    Kind(
        kind="resume",
        title="Checkpoint resume, bit for bit (gaps against the uninterrupted fit: reported, not required)",
        headers=RESUME_HEADERS,
        rows=resume_rows,
        bad_verdicts=frozenset({"FAIL", "NOT REJECTED"}),
        verdict_order=("pass", "FAIL", "rejected", "NOT REJECTED"),
    )
)

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
    return "-" if value is None else _figure(value)


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
    rows = [
        Row(
            cells=(target, "all", str(payload["ranks"]), "-", "-", "-", "-", "-", "-", _short(detail, 110)),
            verdict="pass" if payload["passed"] else "FAIL",
            figures={
                **{v: int(counts.get(v, 0)) for v in CRASH_VERDICTS},
                "crash_points": total,
                "control": str(control["verdict"]),
                "fault_free_diff": payload["fault_free_diff"],
            },
            label="matrix",
        )
    ]
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


register_kind(
    Kind(
        kind="crash_consistency",
        title="Crash consistency (every save's file events; PASS points counted, the others listed)",
        headers=CRASH_HEADERS,
        rows=crash_rows,
        bad_verdicts=frozenset({"FAIL", "HARD_FAIL", "SILENT_DIVERGENCE"}),
        verdict_order=("pass", "FAIL", *CRASH_VERDICTS),
        unlisted="PASS (not listed)",
    )
)


def verdict_counts(verdicts: Sequence[str], kind: Kind) -> str:
    """``3 pass, 1 FAIL`` in the kind's verdict order; verdicts seen but not ordered follow."""
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v] = counts.get(v, 0) + 1
    order = [v for v in kind.verdict_order if v in counts] + [
        v for v in counts if v not in kind.verdict_order
    ]
    return ", ".join(f"{counts[v]} {v}" for v in order)
