"""One verdict on a planted fault: the terminal table, the JSON report, ``judge`` and ``expect_fault_rejected``
agree on every case, the boundary ones included (a faulted arm that failed, but not the check that must
reject its fault; a clean arm failing beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_sprite.assertions.evidence import FailedCheck
from pytest_sprite.assertions.expect_fault import FaultNotRejected, expect_fault_rejected
from pytest_sprite.assertions.parity import ArmParity, ParityError, ParityResult
from pytest_sprite.report.json_report import build_document
from pytest_sprite.report.kinds import get_kind
from pytest_sprite.report.logged_results import TestEntry
from pytest_sprite.report.rejudge import Judged
from pytest_sprite.report.terminal import build_tables, render_text

pytestmark = pytest.mark.cpu

FAULTED = "ddp (fault missing-rank)"


def _arm(label: str, fault: str | None, checks: tuple[str, ...]) -> ArmParity:
    failed = tuple(FailedCheck(arm=label, check=c, fault=fault, detail="d") for c in checks)
    return ArmParity(
        label=label, arm="ddp", ranks=2, global_batch=4, accumulate=1, fault=fault, strategy="DDPStrategy",
        pre_norm_rel=0.5 if "pre_norm" in checks else 1e-8, post_norm_rel=1e-8, update_rel_l2=1e-6,
        frozen_changed=0, frozen_total=26, failed=failed,
        pre_norm_rel_steps=(1e-8,), post_norm_rel_steps=(1e-8,),
    )  # fmt: skip


CASES = {
    # missing-rank must be rejected by pre_norm under assert_parity (the fault registry says so).
    "the required check failed on the faulted arm": ((("pre_norm", "update"), ()), True),
    "the faulted arm failed, but not the required check": ((("update",), ()), False),
    "a clean arm failed beside the faulted one": ((("pre_norm",), ("update",)), False),
}


def _four_verdicts(result: ParityResult, tmp_path: Path) -> dict[str, bool]:
    payload = result.to_dict()
    try:
        with expect_fault_rejected("missing-rank"):
            raise ParityError(result.report(), failed=result.failed, result=result)
    except FaultNotRejected:
        expected = False
    else:
        expected = True
    [table] = build_tables([("t::test", [payload])])
    row = next(line for line in render_text([table]).splitlines() if FAULTED in line)
    entry = TestEntry(nodeid="t::test", location=("t.py", 1, "test"), keywords=[], assertions=[payload])
    document: dict[str, Any] = build_document(
        entries=[entry], created=0.0, duration=0.0, exitcode=1, root=str(tmp_path), launcher="local",
        world_size=2, device="cpu", collected=1,
    )  # fmt: skip
    [verdict] = document["tests"][0]["assertions"][0]["fault_verdicts"]
    judged = Judged(
        manifest=tmp_path / "parity-01.assertion.json", test_id="t", stored=payload, result=payload
    )
    kind = get_kind("parity")
    faulted_judged = next(r.verdict for r in kind.rows(judged.result) if r.label == FAULTED)
    return {
        "expect_fault_rejected": expected,
        "terminal table": row.rstrip().endswith(" rejected"),
        "JSON report": verdict["status"] == "rejected",
        "judge": faulted_judged == "rejected",
    }


@pytest.mark.parametrize(("checks", "rejected"), CASES.values(), ids=list(CASES))
def test_the_four_readers_agree_on_the_fault(
    checks: tuple[tuple[str, ...], tuple[str, ...]], rejected: bool, tmp_path: Path
) -> None:
    faulted, clean = checks
    arms = (_arm(FAULTED, "missing-rank", faulted), _arm("fsdp", None, clean))
    result = ParityResult(rtol=1e-4, reference="ref", arms=arms)
    verdicts = _four_verdicts(result, tmp_path)
    assert verdicts == dict.fromkeys(verdicts, rejected)
