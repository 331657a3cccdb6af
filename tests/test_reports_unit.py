"""The report pipeline's pure parts: kind rows and verdicts, tables, per-rank outcomes, JSON helpers, plots."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from _pytest.reports import TestReport

from pytest_sprite import _results
from pytest_sprite._results import record_assertion
from pytest_sprite.assertions.parity import ArmParity, ParityResult
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.launch.merge import RankEnd, merge_rank_reports
from pytest_sprite.report.json_report import check_target, write_document
from pytest_sprite.report.kinds import get_kind, parity_rows
from pytest_sprite.report.terminal import build_tables, render_kind_table

pytestmark = pytest.mark.cpu


def arm(label: str, *, pre: float, fault: str | None = None, failed: bool = False) -> ArmParity:
    from pytest_sprite.assertions._evidence import FailedCheck

    checks = (FailedCheck(arm=label, check="pre_norm", fault=fault, detail="d"),) if failed else ()
    return ArmParity(
        label=label,
        arm="ddp",
        ranks=2,
        global_batch=4,
        accumulate=1,
        fault=fault,
        strategy="XPUDDPStrategy",
        pre_norm_rel=pre,
        post_norm_rel=0.0,
        update_rel_l2=1.26e-6,
        frozen_changed=0,
        frozen_total=26,
        failed=checks,
        pre_norm_rel_steps=(0.0, pre),
        post_norm_rel_steps=(0.0, 0.0),
    )


def result(*arms: ArmParity) -> ParityResult:
    return ParityResult(rtol=1e-4, reference="single on 1 cpu device", arms=arms)


def test_parity_rows_judge_clean_and_faulted_arms() -> None:
    payload = result(
        arm("ddp", pre=7.5e-8),
        arm("fsdp", pre=0.5, failed=True),
        arm("ddp (fault wrong-scale)", pre=1.0, fault="wrong-scale", failed=True),
        arm("ddp (fault missing-rank)", pre=1e-9, fault="missing-rank"),
    ).to_dict()
    rows = parity_rows(payload)
    assert [r.verdict for r in rows] == ["pass", "FAIL", "rejected", "NOT REJECTED"]
    assert rows[0].cells == ("ddp", "2", "4", "1e-4", "7.50e-8", "0", "1.26e-6", "0 of 26")
    assert rows[1].figures["pre_norm_rel"] == 0.5


def test_tables_put_failures_first_and_count_verdicts() -> None:
    good = result(arm("ddp", pre=7.5e-8)).to_dict()
    bad = result(arm("fsdp", pre=0.5, failed=True)).to_dict()
    [table] = build_tables([("t.py::a", [good]), ("t.py::b", [bad])])
    assert [(t, v) for t, _, v in table.rows] == [("t.py::b", "FAIL"), ("t.py::a", "pass")]
    assert table.counts() == "parity: 1 pass, 1 FAIL"
    short = render_kind_table(table, short=True)
    assert [bad for _, bad in short] == [None, None, True, None]
    assert short[2][0].startswith("t.py::b  fsdp")


def test_an_unregistered_kind_shows_in_a_generic_table() -> None:
    kind = get_kind("resume_v9")
    assert [r.verdict for r in kind.rows({"kind": "resume_v9", "passed": False})] == ["FAIL"]


def test_record_assertion_outside_a_test_keeps_nothing_and_needs_a_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_results, "_active", None)  # as in a script or the offline judge
    r = result(arm("ddp", pre=0.0))
    assert record_assertion(r, inputs=[tmp_path / "01-single", tmp_path / "02-ddp"]) is r
    assert list(tmp_path.iterdir()) == []  # no manifest either

    class NoKind:
        def to_dict(self) -> dict[str, object]:
            return {"passed": True}

    with pytest.raises(
        TypeError, match=r"^NoKind.to_dict\(\) must name its assertion kind \(a 'kind' string\), got None"
    ):
        record_assertion(NoKind())


def rep(when: str, outcome: str = "passed", **extra: object) -> TestReport:
    return TestReport(
        nodeid="t.py::t",
        location=("t.py", 1, "t"),
        keywords={},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr="boom" if outcome == "failed" else None,
        when=when,  # type: ignore[arg-type]
        duration=0.5,
        **extra,
    )


def test_merge_keeps_per_rank_outcomes_and_the_lowest_ranks_assertions() -> None:
    payload = {"kind": "parity", "passed": True}
    per_rank = {
        0: [rep("setup", sprite_device="cpu"), rep("call", sprite_assertions=[payload]), rep("teardown")],
        1: [
            rep("setup", sprite_device="cpu"),
            rep("call", "failed", sprite_assertions=[payload]),
            rep("teardown"),
        ],
        2: [rep("setup", sprite_device="cpu")],
    }
    ends = {
        0: RankEnd(rank=0, exitcode=0),
        1: RankEnd(rank=1, exitcode=0),
        2: RankEnd(rank=2, signal=signal.SIGKILL),
    }
    merged = merge_rank_reports(
        nodeid="t.py::t",
        location=("t.py", 1, "t"),
        keywords={},
        per_rank=per_rank,
        ends=ends,
        world_size=3,
        hosts={0: "x1", 1: "x1", 2: "x2"},
    )
    call = next(r for r in merged if r.when == "call")
    assert call.sprite_assertions == [payload]  # type: ignore[attr-defined]
    ranks = merged[-1].sprite_ranks  # type: ignore[attr-defined]
    assert [(r["rank"], r["outcome"], r["exit_code"], r["signal"], r["host"]) for r in ranks] == [
        (0, "passed", 0, None, "x1"),
        (1, "failed", 0, None, "x1"),
        (2, "crashed", None, 9, "x2"),
    ]
    assert (
        ranks[2]["signal_name"] == "SIGKILL" and ranks[0]["duration"] == 1.5 and ranks[0]["device"] == "cpu"
    )


def test_report_path_is_never_overwritten_unless_asked(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("{}")
    with pytest.raises(SpriteUsageError) as exc:
        check_target(str(target), overwrite=False)
    assert str(exc.value) == (
        f"--sprite-report={target}: the file exists and a report is never overwritten; "
        "pass a new path or add --sprite-report-overwrite"
    )
    write_document({"x": float("inf")}, str(target), overwrite=True)
    assert json.loads(target.read_text()) == {"x": "inf"}
    with pytest.raises(SpriteUsageError, match=r"is a directory; pass a file path such as"):
        check_target(str(tmp_path), overwrite=True)


def test_plots_are_png_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from pytest_sprite.report.plots import step_gaps_figure, verdict_grid_figure

    gaps = step_gaps_figure(
        tmp_path / "gaps.png",
        title="t",
        series={"ddp": [0.0, 1e-7, "inf"], "fsdp": [1e-8, 2e-8, 3e-8]},
        threshold=1e-4,
        ylabel="gap",
    )
    grid = verdict_grid_figure(
        tmp_path / "grid.png",
        title="crash matrix",
        rows=["save:open", "save:rename"],
        columns=["0", "1"],
        verdicts={
            ("save:open", "0"): "PASS",
            ("save:open", "1"): "HARD_FAIL",
            ("save:rename", "0"): "LOST_WORK",
        },
    )
    import matplotlib.image

    for path in (gaps, grid):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100


def _scored(label: str, role: str, passed: bool, fault: str | None = None) -> dict[str, object]:
    return {
        "role": role,
        "label": label,
        "fault": fault,
        "passed": passed,
        "pre_norm_rel": 0.0 if passed else 0.5,
        "max_gradient_gap": 1e-6,
        "update_rel_l2": 2e-6,
        "max_update_gap": 3e-6,
        "gradients_over": 0 if passed else 2,
        "updates_over": 0,
        "tensors": 3,
    }


def criterion(
    verdict: str, *, gate: bool = True, ddp: bool = True, fault: str | None = None
) -> dict[str, object]:
    failed = [] if ddp else [{"arm": "ddp", "check": "pre_norm", "fault": fault, "detail": "d"}]
    return {
        "kind": "criterion_v2",
        "verdict": verdict,
        "ranks": 2,
        "global_batch": 4,
        "scored": [_scored("ddp", "ddp", ddp, fault), _scored("fsdp", "fsdp", True)],
        "gate": _scored("split_premul", "gate", gate),
        "invariants": [{"name": "dtype", "passed": True, "failures": []}],
        "failed": failed,
    }


def test_criterion_rows_score_void_and_faults() -> None:
    from pytest_sprite.report.kinds import criterion_rows

    passing = criterion_rows(criterion("pass"))
    assert [(r.cells[0], r.verdict) for r in passing] == [
        ("ddp vs split", "pass"),
        ("fsdp vs split", "pass"),
        ("gate (split_premul)", "pass"),
        ("invariants (1 of 1 hold)", "pass"),
    ]
    assert passing[0].cells[3:] == ("0", "1.00e-6", "2.00e-6", "3.00e-6", "0+0 of 6")
    void = criterion_rows(criterion("void", gate=False))
    assert [r.verdict for r in void] == ["void", "void", "void", "pass"]
    assert [r.verdict for r in criterion_rows(criterion("fail", ddp=False))][:2] == ["FAIL", "pass"]
    faulted = criterion_rows(criterion("fail", ddp=False, fault="wrong-scale"))
    assert faulted[0].verdict == "rejected"
    missed = criterion_rows(criterion("pass", fault="wrong-scale"))
    assert missed[0].verdict == "NOT REJECTED"
