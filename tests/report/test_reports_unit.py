"""The report pipeline's pure parts: kind rows and verdicts, tables, per-rank outcomes, JSON helpers, plots."""

from __future__ import annotations

import json
import math
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from _pytest.reports import TestReport

from pytest_sprite.assertions.crash_consistency import MATRIX_FILE, CrashMatrix, CrashRow, judge_matrix
from pytest_sprite.assertions.parity import ArmParity, ParityResult
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue import recorded_results as _results
from pytest_sprite.glue.recorded_results import record_assertion
from pytest_sprite.launch.merge import merge_rank_reports
from pytest_sprite.launch.rank_end import RankEnd
from pytest_sprite.report.json_report import check_target, write_document
from pytest_sprite.report.kinds import get_kind, parity_rows
from pytest_sprite.report.terminal import build_tables, render_kind_table

pytestmark = pytest.mark.cpu


def arm(label: str, *, pre: float, fault: str | None = None, failed: bool = False) -> ArmParity:
    from pytest_sprite.assertions.evidence import FailedCheck

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
    # The clean fsdp arm failed too: the faulted arm's failure cannot be attributed to its fault (the one
    # verdict on a fault, as expect_fault_rejected judges it).
    assert [r.verdict for r in rows] == ["pass", "FAIL", "NOT REJECTED", "NOT REJECTED"]
    alone = parity_rows(
        result(arm("ddp (fault wrong-scale)", pre=1.0, fault="wrong-scale", failed=True)).to_dict()
    )
    assert [r.verdict for r in alone] == ["rejected"]
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
    assert call.sprite_assertions == [payload]
    ranks = merged[-1].sprite_ranks
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
    verdict: str,
    *,
    gate: bool = True,
    ddp: bool = True,
    fault: str | None = None,
    checks: tuple[str, ...] = ("pre_norm",),
) -> dict[str, object]:
    failed = [] if ddp else [{"arm": "ddp", "check": c, "fault": fault, "detail": "d"} for c in checks]
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
    # wrong-scale must fail pre_norm and gradients under criterion v2 (the fault registry).
    faulted = criterion_rows(
        criterion("fail", ddp=False, fault="wrong-scale", checks=("pre_norm", "gradients"))
    )
    assert faulted[0].verdict == "rejected"
    half = criterion_rows(criterion("fail", ddp=False, fault="wrong-scale"))
    assert half[0].verdict == "NOT REJECTED"
    missed = criterion_rows(criterion("pass", fault="wrong-scale"))
    assert missed[0].verdict == "NOT REJECTED"


# -- resume ------------------------------------------------------------------------------------------


def resume_payload(
    *, fault: str | None = None, caught: bool = True, broken: bool = False
) -> dict[str, object]:
    """A real ResumeResult's to_dict(): ddp resume (with the fault), reload and export, the gaps of each."""
    from pytest_sprite.assertions.evidence import FailedCheck
    from pytest_sprite.assertions.resume import ResumeArm, ResumeGaps, ResumeResult

    def arm(
        label: str, role: str, ranks: int, failed: tuple[str, ...] = (), arm_fault: str | None = None
    ) -> ResumeArm:
        checks = tuple(
            FailedCheck(arm=label, check=c, fault=arm_fault, detail="rank 1: differs") for c in failed
        )
        return ResumeArm(label=label, role=role, ranks=ranks, loads="ckpt", fault=arm_fault, failed=checks)

    resume_failed = ("optimizer_state", "first_loss") if (fault and caught) or broken else ()
    label = f"ddp resume (fault {fault})" if fault else "ddp resume"
    return ResumeResult(
        run="ddp, 32-true",
        strategy="ddp",
        precision="32-true",
        ranks=2,
        global_batch=8,
        reshard_ranks=None,
        export=True,
        fault=fault,
        arms=(
            arm(label, "resume", 2, resume_failed, fault),
            arm("ddp reload", "reload", 2),
            arm("ddp export", "export", 1),
        ),
        gaps=(
            ResumeGaps(
                arm="ddp", loss=0.0, pre_clip_norm=3.1e-8, update=2.5e-7, adam_m=1.2e-6, adam_v=4.0e-6
            ),
            ResumeGaps(
                arm="ddp_export", loss=1e-9, pre_clip_norm=math.inf, update=0.0, adam_m=0.0, adam_v=0.0
            ),
        ),
        departs="never",
        twin="reproduced",
        rng="match",
        timings={"fit": (1.0, 0.5)},
    ).to_dict()


def test_resume_rows_carry_the_seed_columns_and_the_gaps_of_each_arm() -> None:
    from pytest_sprite.report.kinds import resume_rows

    rows = resume_rows(resume_payload())
    assert [(r.label, r.verdict) for r in rows] == [
        ("ddp resume", "pass"),
        ("ddp reload", "pass"),
        ("ddp export", "pass"),
    ]
    assert rows[0].cells == (
        "ddp, 32-true",
        "ddp resume",
        "2",
        "8",
        "-",
        "-",
        "0",
        "3.10e-8",
        "2.50e-7",
        "1.20e-6",
        "4.00e-6",
    )
    assert rows[1].cells[6:] == ("-",) * 5  # the reload compares no continuation
    assert rows[2].cells[2] == "1" and rows[2].cells[6:8] == ("1.00e-9", "inf")
    assert rows[0].figures["adam_v"] == 4.0e-6 and rows[2].figures["pre_clip_norm"] == "inf"
    broken = resume_rows(resume_payload(broken=True))[0]
    assert (broken.verdict, broken.cells[5]) == ("FAIL", "optimizer_state, first_loss")
    assert resume_rows(resume_payload(fault="skip-restore"))[0].verdict == "rejected"
    assert resume_rows(resume_payload(fault="skip-restore", caught=False))[0].verdict == "NOT REJECTED"


def test_resume_table_puts_the_failing_run_first() -> None:
    [table] = build_tables([("t.py::good", [resume_payload()]), ("t.py::bad", [resume_payload(broken=True)])])
    assert table.kind.kind == "resume"
    assert [(t, v) for t, _, v in table.rows][:2] == [("t.py::bad", "FAIL"), ("t.py::good", "pass")]
    assert table.counts() == "resume: 5 pass, 1 FAIL"


# -- crash consistency -------------------------------------------------------------------------------


def crash_matrix(*, broken: bool = True) -> CrashMatrix:
    """A real, judged CrashMatrix: a lost-work point, a hard failure, a torn divergence and passes."""

    def row(point: int, rank: int | None, file: str, **kw: object) -> CrashRow:
        base: dict[str, object] = dict(
            point=point,
            rank=rank,
            event="torch.save",
            file=file,
            torn=False,
            crashed=True,
            resume_status="returned",
            weight_diff=0.0,
            newest_complete="ckpt-1",
            resumed_from="ckpt-1",
        )
        base.update(kw)
        return CrashRow(**base)  # type: ignore[arg-type]

    rows = [
        row(1, 0, "ckpt-1/model.pt", newest_complete=None, resumed_from="<scratch>"),
        row(2, 1, "ckpt-1/model.pt"),
        row(3, 0, "ckpt-2/model.pt", newest_complete="ckpt-2"),  # LOST_WORK: resumed from ckpt-1
    ]
    if broken:
        rows += [
            row(
                4,
                1,
                "ckpt-2/model.pt",
                resume_status="raised",
                weight_diff=None,
                error="RuntimeError: bad zip\nx",
            ),
            row(5, 1, "ckpt-2/model.pt", torn=True, weight_diff=1.65e-4),
        ]
    return judge_matrix(
        CrashMatrix(
            target="train_in_place",
            ranks=2,
            atol=0.0,
            allow_lost_work=True,
            fault_free_diff=0.0,
            flake_runs=0,
            flake_failures=(),
            saves=("ckpt-1", "ckpt-2"),
            control=row(0, None, "-", event="control", crashed=False),
            rows=tuple(rows),
        )
    )


def test_crash_rows_count_verdicts_and_list_the_points_that_did_not_pass() -> None:
    from pytest_sprite.report.kinds import crash_rows

    rows = crash_rows(crash_matrix().to_dict())
    assert [(r.label, r.verdict) for r in rows] == [
        ("matrix", "FAIL"),
        ("point 3", "LOST_WORK"),
        ("point 4", "HARD_FAIL"),
        ("point 5", "SILENT_DIVERGENCE"),
    ]
    assert rows[0].cells[:3] == ("train_in_place", "all", "2")
    assert rows[0].cells[-1] == (
        "2 PASS + 1 HARD_FAIL + 1 SILENT_DIVERGENCE + 1 LOST_WORK of 5 crash points (control PASS)"
    )
    # a matrix that fails with no bad point says why in the same cell
    shaky = replace(crash_matrix(broken=False), fault_free_diff=1e-3).to_dict()
    [matrix_row, _] = crash_rows(shaky)
    assert matrix_row.verdict == "FAIL"
    assert matrix_row.cells[-1].startswith(
        "2 PASS + 1 LOST_WORK of 3 crash points (control PASS); two fault-free runs already differ"
    )
    assert rows[0].figures["HARD_FAIL"] == 1 and rows[0].figures["crash_points"] == 5
    assert rows[2].cells == (
        "train_in_place",
        "4",
        "1",
        "ckpt-2/model.pt",
        "torch.save",
        "",
        "ckpt-1",
        "ckpt-1",
        "-",
        "RuntimeError: bad zip x",
    )
    assert rows[3].cells[5] == "torn" and rows[3].cells[8] == "1.65e-4"
    clean = crash_rows(crash_matrix(broken=False).to_dict())
    assert [(r.label, r.verdict) for r in clean] == [("matrix", "pass"), ("point 3", "LOST_WORK")]
    [table] = build_tables(
        [("t.py::clean", [crash_matrix(broken=False).to_dict()]), ("t.py::bad", [crash_matrix().to_dict()])]
    )
    assert [(t, v) for t, _, v in table.rows] == [
        ("t.py::bad", "FAIL"),
        ("t.py::bad", "HARD_FAIL"),
        ("t.py::bad", "SILENT_DIVERGENCE"),
        ("t.py::clean", "pass"),
        ("t.py::clean", "LOST_WORK"),
        ("t.py::bad", "LOST_WORK"),
    ]
    assert (
        table.counts() == "crash_consistency: 1 pass, 1 FAIL, 1 HARD_FAIL, 1 SILENT_DIVERGENCE, 2 LOST_WORK"
    )


class _Item:
    """Just what record_assertion keeps results on: a stash."""

    def __init__(self) -> None:
        self.stash = pytest.Stash()


def test_a_stored_crash_matrix_is_judged_again_from_its_manifest_and_a_copy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import shutil

    from pytest_sprite.report.rejudge import judge_directory

    out = tmp_path / "art" / "t" / "chaos"
    out.mkdir(parents=True)
    matrix = crash_matrix()
    matrix.write(out)
    item = _Item()
    monkeypatch.setattr(
        _results, "_active", (item, "call")
    )  # inside a test, as assert_crash_consistent records
    record_assertion(matrix, inputs=[out / MATRIX_FILE])
    manifest = out / "crash_consistency-01.assertion.json"
    assert json.loads(manifest.read_text())["inputs"] == [MATRIX_FILE]
    assert _results.assertion_results(item) == [matrix.to_dict()]  # type: ignore[arg-type]
    shutil.copytree(tmp_path / "art", tmp_path / "copy")
    [judged] = judge_directory(tmp_path / "copy")
    assert judged.test_id == "t/chaos/crash_consistency-01.assertion.json"
    assert judged.failed and judged.changed == []
    assert judged.result["counts"] == matrix.to_dict()["counts"]
    # a stored verdict the rules no longer give shows as changed: the facts decide, not the stored verdict
    stored = json.loads((tmp_path / "copy/t/chaos" / MATRIX_FILE).read_text())
    stored["rows"][3]["verdict"] = "PASS"
    (tmp_path / "copy/t/chaos" / MATRIX_FILE).write_text(json.dumps(stored))
    document = json.loads((tmp_path / "copy" / "t/chaos/crash_consistency-01.assertion.json").read_text())
    document["result"] = stored
    (tmp_path / "copy/t/chaos/crash_consistency-01.assertion.json").write_text(json.dumps(document))
    assert judge_directory(tmp_path / "copy")[0].changed == ["point 4: PASS (not listed) -> HARD_FAIL"]
    stored["rows"][3]["verdict"], stored["rows"][0]["verdict"] = "HARD_FAIL", "HARD_FAIL"  # the reverse
    document["result"] = stored
    (tmp_path / "copy/t/chaos/crash_consistency-01.assertion.json").write_text(json.dumps(document))
    assert judge_directory(tmp_path / "copy")[0].changed == ["point 1: HARD_FAIL -> PASS (not listed)"]


def test_a_crash_matrix_stored_outside_a_test_is_judged_without_a_manifest(tmp_path: Path) -> None:
    from pytest_sprite.report.rejudge import judge_directory

    (tmp_path / "chaos").mkdir()
    crash_matrix(broken=False).write(tmp_path / "chaos")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "matrix.json").write_text('{"kind": "something else"}')
    [judged] = judge_directory(tmp_path)
    assert (judged.test_id, judged.failed, judged.changed) == ("chaos/matrix.json", False, [])


# -- plots of the new kinds --------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    return height, width


def test_resume_crash_and_criterion_plots_are_png_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from pytest_sprite.report.plots import PLOTTERS

    payload = criterion("pass")
    payload["limits"] = {"rtol": 1e-3}
    payload["diagnostics"] = {
        "pairs": [
            {"arm": "ddp", "against": "split", "max_gap": [2e-4, 3e-3, "inf"]},
            {"arm": "fsdp", "against": "split", "max_gap": [0.0, 1e-4, 2e-4]},
            {"arm": "ddp", "against": "split_premul", "max_gap": [1.0, 1.0, 1.0]},
        ]
    }
    written = {
        "resume": PLOTTERS["resume"](resume_payload(), tmp_path / "resume"),
        "crash_consistency": PLOTTERS["crash_consistency"](crash_matrix().to_dict(), tmp_path / "crash"),
        "criterion_v2": PLOTTERS["criterion_v2"](payload, tmp_path / "criterion"),
    }
    for kind, paths in written.items():
        [path] = paths
        assert (
            path
            == tmp_path
            / f"{ {'crash_consistency': 'crash', 'criterion_v2': 'criterion'}.get(kind, kind) }.png"
        )
        height, width = _png_size(path)
        assert height > 100 and width > 100
    # nothing to draw: no file
    assert PLOTTERS["criterion_v2"](criterion("pass"), tmp_path / "none") == []
