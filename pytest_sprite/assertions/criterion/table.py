"""Criterion v2's terminal table: the scored step-0 rows, the gate and one row for the invariants.

``pytest_sprite.report.kinds`` registers :data:`CRITERION_KIND`; the rows read a ``to_dict()`` payload, so
they show a stored result exactly as a live one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_sprite.assertions.fault_verdict import item_verdict
from pytest_sprite.assertions.tables import Kind, Row, figure_cell

__all__ = ["CRITERION_HEADERS", "CRITERION_KIND", "criterion_rows"]

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
    void is never a pass); a row of an arm carrying a fault reads its fault's verdict (``rejected`` /
    ``NOT REJECTED``, :func:`~pytest_sprite.assertions.fault_verdict.fault_verdict`).
    """
    void = payload["verdict"] == "void"
    ranks, batch = str(payload["ranks"]), str(payload["global_batch"])
    rows = []
    for c in [*payload["scored"], payload["gate"]]:
        gate = c["role"] == "gate"
        if c.get("fault") and not void:
            verdict = item_verdict(c, payload)
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
                    figure_cell(c["pre_norm_rel"]),
                    figure_cell(c["max_gradient_gap"]),
                    figure_cell(c["update_rel_l2"]),
                    figure_cell(c["max_update_gap"]),
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


CRITERION_KIND = Kind(
    kind="criterion_v2",
    title="BF16 criterion v2 (scored step-0 checks against split; gate split_premul)",
    headers=CRITERION_HEADERS,
    rows=criterion_rows,
    bad_verdicts=frozenset({"FAIL", "void", "NOT REJECTED"}),
    verdict_order=("pass", "FAIL", "void", "rejected", "NOT REJECTED"),
)
"""How the reports show a criterion v2 payload."""
