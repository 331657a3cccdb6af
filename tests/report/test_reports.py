"""The report forms end to end: terminal tables, --sprite-report JSON, JUnit properties, plots, judge, xdist."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from sprite_testing import fnescape, run_pytest

pytestmark = pytest.mark.cpu


def _missing(*modules: str) -> list[str]:
    """Modules not installed, found without importing them: pytester's sys.modules snapshot would drop a
    C extension imported inside a test (numpy), and importing it again raises."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


needs = {
    "matplotlib": pytest.mark.skipif(bool(_missing("matplotlib")), reason="needs matplotlib (extra plots)"),
    "recipes": pytest.mark.skipif(
        bool(_missing("peft", "transformers", "lightning")), reason="needs peft, transformers and lightning"
    ),
    "xdist": pytest.mark.skipif(bool(_missing("xdist")), reason="needs pytest-xdist"),
}

TIMEOUT = 240

# Real parity results built from their dataclasses: the reports read only to_dict(), so these exercise the
# whole pipeline without training (the ranks tests below run a real assert_parity).
RESULTS = """
from pytest_sprite import record_assertion
from pytest_sprite.assertions.evidence import FailedCheck
from pytest_sprite.assertions.parity import ArmParity, ParityResult

def arm(label, pre, fault=None, failed=False):
    checks = (FailedCheck(arm=label, check="pre_norm", fault=fault, detail="d"),) if failed else ()
    return ArmParity(label=label, arm="ddp", ranks=2, global_batch=4, accumulate=1, fault=fault,
                     strategy="XPUDDPStrategy", pre_norm_rel=pre, post_norm_rel=7.26e-8, update_rel_l2=1.26e-6,
                     frozen_changed=0, frozen_total=26, failed=checks,
                     pre_norm_rel_steps=(1e-8, pre), post_norm_rel_steps=(0.0, 7.26e-8))

def test_good():
    record_assertion(ParityResult(rtol=1e-4, reference="ref", arms=(arm("ddp", 7.53e-8), arm("fsdp", 1.11e-7))))

def test_bad():
    record_assertion(ParityResult(rtol=1e-4, reference="ref", arms=(arm("fsdp", 0.5, failed=True),)))
    assert False, "parity failed"

def test_fault():
    record_assertion(ParityResult(rtol=1e-4, reference="ref",
                                  arms=(arm("ddp (fault wrong-scale)", 1.0, "wrong-scale", True),)))

def test_plain():
    pass
"""


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.delenv("SPRITE_REPORT", raising=False)


run = partial(run_pytest, timeout=TIMEOUT)


def validate(document: dict[str, Any]) -> None:
    import jsonschema

    from pytest_sprite.report.json_report import load_schema

    jsonschema.validate(document, load_schema())


def test_tables_json_and_junit_hold_the_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_results=RESULTS)
    result = run(pytester, "--sprite-report=out/report.json", "--junitxml=junit.xml")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*= sprite: FP32 parity against the single-device reference =*",
            "Test *Arm *Ranks  Global batch  rtol  Pre-clip norm rel  Post-clip norm rel  Update rel L2  Frozen changed  Verdict",
            "test_results.py::test_bad    fsdp                     2      4             1e-4  0.5                7.26e-8             1.26e-6        0 of 26         FAIL",
            "test_results.py::test_good   ddp                      2      4             1e-4  7.53e-8            7.26e-8             1.26e-6        0 of 26         pass",
            "test_results.py::test_good   fsdp                     2      4             1e-4  1.11e-7*pass",
            "test_results.py::test_fault  ddp (fault wrong-scale)  2      4             1e-4  1 * rejected",
            "parity: 2 pass, 1 FAIL, 1 rejected",
            fnescape("sprite: JSON report: out/report.json"),
        ]
    )
    document = json.loads((pytester.path / "out/report.json").read_text())
    validate(document)
    assert document["exitcode"] == 1
    assert document["summary"] == {"passed": 3, "failed": 1, "total": 4, "collected": 4}
    tests = {t["nodeid"].split("::")[1]: t for t in document["tests"]}
    assert tests["test_bad"]["outcome"] == "failed" and tests["test_bad"]["call"]["longrepr"].startswith(
        "AssertionError: parity failed"
    )
    assert [a["kind"] for a in tests["test_good"]["assertions"]] == ["parity"]
    assert [a["pre_norm_rel"] for a in tests["test_good"]["assertions"][0]["arms"]] == [7.53e-8, 1.11e-7]
    assert tests["test_plain"]["assertions"] == [] and tests["test_plain"]["ranks"] == []

    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_bad"].iter("property")}
    assert props == {
        "sprite.parity[0].fsdp.verdict": "FAIL",
        "sprite.parity[0].fsdp.pre_norm_rel": "0.5",
        "sprite.parity[0].fsdp.post_norm_rel": "7.26e-08",
        "sprite.parity[0].fsdp.update_rel_l2": "1.26e-06",
        "sprite.parity[0].fsdp.frozen_changed": "0",
        "sprite.parity[0].fsdp.rtol": "0.0001",
    }
    assert cases["test_plain"].find("properties") is None


def test_quiet_keeps_failing_rows_and_summary_no_hides_the_tables(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_results=RESULTS)
    quiet = run(pytester, "-q")
    quiet.stdout.fnmatch_lines(
        ["test_results.py::test_bad  fsdp  2 * FAIL", "parity: 2 pass, 1 FAIL, 1 rejected"]
    )
    assert "test_results.py::test_good " not in quiet.stdout.str()
    hidden = run(pytester, "--sprite-summary=no")
    assert "sprite:" not in hidden.stdout.str()
    bad = run(pytester, "--sprite-summary=maybe")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["ERROR: --sprite-summary='maybe': valid values are auto, no"])


def test_report_refuses_an_existing_file_and_projects_add_fields(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_results=RESULTS)
    pytester.makeconftest(
        """
        def pytest_sprite_report(report, config):
            report["environment"]["cluster"] = "aurora"
        """
    )
    (pytester.path / "report.json").write_text("keep me")
    refused = run(pytester, "--sprite-report=report.json")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(
        [
            "ERROR: --sprite-report=report.json: the file exists and a report is never overwritten; "
            "pass a new path or add --sprite-report-overwrite"
        ]
    )
    assert (pytester.path / "report.json").read_text() == "keep me"
    pytester.makeini("[pytest]\nsprite_report = report.json\n")  # the ini twin of --sprite-report
    over = run(pytester, "--sprite-report-overwrite")
    over.assert_outcomes(passed=3, failed=1)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    assert document["environment"]["cluster"] == "aurora"


def test_ranks_tests_report_each_rank_and_the_progress_lines(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest
        from pytest_sprite import assertion_results

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_protocol(item):
            result = yield
            print(f"KEPT {item.name} {assertion_results(item)}")
            return result
        """
    )
    pytester.makepyfile(
        """
        import os, signal
        import pytest
        from pytest_sprite import progress, record_assertion

        class Custom:
            def __init__(self, rank):
                self.rank = rank
            def to_dict(self):
                return {"kind": "custom", "passed": True, "seen_on": self.rank}

        @pytest.mark.ranks(2)
        def test_rank1_fails(world):
            progress(f"checking on rank {world.rank}")
            record_assertion(Custom(world.rank))
            assert world.rank == 0

        @pytest.mark.ranks(2)
        def test_rank1_crashes(world):
            if world.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = run(pytester, "--sprite-report=report.json", "--junitxml=junit.xml", "-v")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "[[]sprite[]] test_ranks_tests_report_each_rank_and_the_progress_lines.py::test_rank1_fails: checking on rank 0"
        ]
    )
    assert "checking on rank 1" not in result.stdout.str()
    # Both ranks recorded; the merged report keeps rank 0's, the controller keeps it with the item, and a kind
    # without a registered table shows in the generic one.
    result.stdout.fnmatch_lines(
        [
            "*KEPT test_rank1_fails [[]{'kind': 'custom', 'passed': True, 'seen_on': 0}[]]",
            "*= sprite: custom (no table registered for this kind) =*",
            "test_ranks_tests_report_each_rank_and_the_progress_lines.py::test_rank1_fails  True    pass",
            "custom: 1 pass",
        ]
    )
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    assert [t["assertions"] for t in document["tests"]] == [
        [{"kind": "custom", "passed": True, "seen_on": 0}],
        [],
    ]
    ranks = {t["nodeid"].split("::")[1]: t["ranks"] for t in document["tests"]}
    assert [(r["rank"], r["outcome"], r["exit_code"], r["signal"]) for r in ranks["test_rank1_fails"]] == [
        (0, "passed", 0, None),
        (1, "failed", 0, None),
    ]
    crashed = ranks["test_rank1_crashes"][1]
    assert (crashed["outcome"], crashed["signal"], crashed["signal_name"]) == ("crashed", 9, "SIGKILL")
    assert ranks["test_rank1_crashes"][0]["outcome"] == "ended"
    assert all(r["device"] == "cpu" and r["host"] for rs in ranks.values() for r in rs)
    assert document["environment"]["world_size"] == 2 and document["environment"]["devices"]["used"] == [
        "cpu"
    ]
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_rank1_crashes"].iter("property")}
    assert props == {
        "sprite.world_size": "2",
        "sprite.rank0": "ended",
        "sprite.rank1": "crashed",
        "sprite.rank1.signal": "9",
    }


@needs["matplotlib"]
def test_plots_are_pngs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_results=RESULTS)
    result = run(pytester, "--sprite-plots=plots")
    result.stdout.fnmatch_lines(["sprite: 3 plots: plots"])
    files = sorted(p.name for p in (pytester.path / "plots").iterdir())
    assert files == [
        "test_results.py__test_bad-parity-1.png",
        "test_results.py__test_fault-parity-1.png",
        "test_results.py__test_good-parity-1.png",
    ]
    for name in files:
        assert (pytester.path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


PARITY_WITH_ARTIFACTS = """
import pytest
import lightning.pytorch, peft, transformers  # noqa: F401  (loaded once in the agents)
from pytest_sprite.assertions.expect_fault import expect_fault_rejected
from pytest_sprite.assertions.parity import assert_parity

@pytest.mark.ranks(2)
def test_parity(lora_qwen):
    ref = lora_qwen.run("single", steps=2)
    assert_parity(ref, lora_qwen.run("ddp", steps=2))
    with expect_fault_rejected("wrong-scale", by="pre_norm"):
        assert_parity(ref, lora_qwen.run("ddp", steps=2, fault="wrong-scale"))
"""


def judge(directory: Path, *, in_process: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m pytest_sprite judge DIR``; ``in_process`` calls its ``main`` here (no interpreter start)."""
    if not in_process:
        return subprocess.run(
            [sys.executable, "-m", "pytest_sprite", "judge", str(directory)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    from pytest_sprite.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["judge", str(directory)])
    return subprocess.CompletedProcess(["judge", str(directory)], code, out.getvalue(), err.getvalue())


@needs["recipes"]
def test_judge_gives_the_same_verdict_on_a_copied_directory(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(test_parity=PARITY_WITH_ARTIFACTS)
    result = run(pytester, "--sprite-artifacts=art", "--sprite-report=report.json")
    result.assert_outcomes(passed=1)
    stored = json.loads((pytester.path / "report.json").read_text())["tests"][0]["assertions"]
    assert [a["kind"] for a in stored] == ["parity", "parity"]
    copy = tmp_path / "copy"
    shutil.copytree(pytester.path / "art", copy)
    shutil.rmtree(pytester.path / "art")  # the copy must stand on its own

    again = judge(copy)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = again.stdout.splitlines()
    ddp = next(line for line in lines if "parity-01.assertion.json  ddp " in line)
    stored_ddp = stored[0]["arms"][0]
    from pytest_sprite.assertions.tables import format_figure

    assert (
        ddp.split()[-5:]
        == [
            format_figure(stored_ddp["pre_norm_rel"]),
            format_figure(stored_ddp["post_norm_rel"]),
            format_figure(stored_ddp["update_rel_l2"]),
            "0",
            "of",
            "26",
            "pass",
        ][-5:]
    )
    assert any(
        "parity-02.assertion.json  ddp (fault wrong-scale)" in line and line.endswith("rejected")
        for line in lines
    )
    assert lines[-1] == "judged 2 stored assertions: 0 failed, 0 verdicts changed"

    # The same records held to a tolerance they miss: judge fails, names the change, exits 1.
    manifest = next(copy.rglob("parity-01.assertion.json"))
    document = json.loads(manifest.read_text())
    document["result"]["rtol"] = 1e-12
    manifest.write_text(json.dumps(document))
    failing = judge(copy)
    assert failing.returncode == 1
    assert (
        "verdict changed since the run: test_parity.py__test_parity/parity-01.assertion.json: ddp: pass -> FAIL"
        in failing.stdout
    )
    assert failing.stdout.splitlines()[-1] == "judged 2 stored assertions: 1 failed, 1 verdicts changed"

    empty = judge(tmp_path / "nothing")
    assert empty.returncode == 2
    assert (
        empty.stderr
        == f"error: judge: {tmp_path / 'nothing'} is not a directory; pass the --sprite-artifacts directory\n"
    )


RESUME_WITH_ARTIFACTS = """
from pytest_sprite.assertions.resume import assert_resume_bitexact

def test_resume(lora_qwen):
    assert_resume_bitexact(lora_qwen, strategy="single")
"""


@needs["recipes"]
@pytest.mark.slow  # 25 s end to end; test_resume_unit.py stores, round-trips and judges a run in CI
def test_judge_judges_a_stored_resume_run_again(pytester: pytest.Pytester, tmp_path: Path) -> None:
    import torch

    from pytest_sprite.records import ResumeRun

    pytester.makepyfile(test_resume=RESUME_WITH_ARTIFACTS)
    result = run(pytester, "--sprite-artifacts=art", "--sprite-report=report.json")
    result.assert_outcomes(passed=1)
    [stored] = json.loads((pytester.path / "report.json").read_text())["tests"][0]["assertions"]
    folder = pytester.path / "art" / "test_resume.py__test_resume" / "01-resume-single"
    assert sorted(p.name for p in folder.iterdir()) == ["resume-01.assertion.json", "resume-run.pt"]

    # The real run round-trips exactly: to_dict of what was loaded is what was stored, bit for bit.
    data = torch.load(folder / "resume-run.pt", weights_only=True)
    assert set(data["roles"]) == {"fit", "twin", "killed", "resume", "reload"}
    back = ResumeRun.from_dict(data)
    assert isinstance(back.roles["resume"][0].steps[0].rows, tuple)
    assert _same_plain(back.to_dict(), data)

    copy = tmp_path / "copy"
    shutil.copytree(pytester.path / "art", copy)
    shutil.rmtree(pytester.path / "art")  # the copy must stand on its own
    again = judge(copy, in_process=True)
    assert again.returncode == 0, again.stdout + again.stderr
    manifest = "test_resume.py__test_resume/01-resume-single/resume-01.assertion.json"
    assert any(
        f"{manifest}  single, 32-true  single resume " in line and line.endswith("pass")
        for line in again.stdout.splitlines()
    ), again.stdout
    assert again.stdout.splitlines()[-1] == "judged 1 stored assertions: 0 failed, 0 verdicts changed"
    from pytest_sprite.report.rejudge import judge_directory

    assert judge_directory(copy)[0].result == stored

    # One restored tensor of the resume, one ulp off: judged FAIL on that row, exit 1.
    file = copy / "test_resume.py__test_resume" / "01-resume-single" / "resume-run.pt"
    edited = torch.load(file, weights_only=True)
    trainables = edited["roles"]["resume"][0]["restored"]["trainables"]
    name = next(iter(trainables))
    trainables[name] = torch.nextafter(trainables[name], torch.full_like(trainables[name], float("inf")))
    torch.save(edited, file)
    failing = judge(copy, in_process=True)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert f"verdict changed since the run: {manifest}: single resume: pass -> FAIL" in failing.stdout
    assert failing.stdout.splitlines()[-1] == "judged 1 stored assertions: 1 failed, 1 verdicts changed"

    # A file of another format is refused, clearly, as bad usage.
    torch.save({**edited, "format": 99}, file)
    refused = judge(copy, in_process=True)
    assert refused.returncode == 2
    assert refused.stderr == (
        f"error: {file}: this is not a resume run of format 1 (format 99, kind 'resume'); judge it with the "
        "pytest-sprite version that wrote it, or re-run the resume check with this one\n"
    )


def _same_plain(a: Any, b: Any) -> bool:
    """Same types and values, tensors bit for bit, floats by their bits (nan included)."""
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    if isinstance(a, float):
        return a.hex() == b.hex() or (a != a and b != b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_plain(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_plain(a[k], b[k]) for k in a)
    return bool(a == b)


@needs["xdist"]
def test_xdist_runs_ranks_tests_in_both_workers_and_merges_the_reports(pytester: pytest.Pytester) -> None:
    marks = pytester.mkdir("marks")
    pytester.makepyfile(
        f"""
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ranks(2)
        @pytest.mark.parametrize("i", range(4))
        def test_sum(world, i):
            t = torch.tensor([world.rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == 3.0
            if world.rank == 0:
                open(os.path.join({str(marks)!r}, f"ran-{{os.environ['PYTEST_XDIST_WORKER']}}-{{i}}"), "x").close()
        """
    )
    result = run(pytester, "-n", "2", "--sprite-report=report.json")
    result.assert_outcomes(passed=4)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    assert document["summary"]["passed"] == 4 and len(document["tests"]) == 4
    assert all([r["outcome"] for r in t["ranks"]] == ["passed", "passed"] for t in document["tests"])
    workers = {p.name.split("-")[1] for p in marks.iterdir()}
    assert workers == {"gw0", "gw1"}


def test_the_test_column_names_each_test_as_pytests_summary_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20 item 7: run from another directory (``pytest --pyargs`` from a user's project), the Test column
    keeps the module: the node id as pytest's short summary shows it, and the file when the module itself was
    the ``--pyargs`` target (its node id has no path then)."""
    shipped = pytester.mkdir("site") / "shipped"
    shipped.mkdir()
    (shipped / "__init__.py").write_text("")
    (shipped / "test_shipped.py").write_text(RESULTS)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path / "site"))
    project = pytester.mkdir("project")
    (project / "sub").mkdir()

    def failed_row(*args: str) -> tuple[str, str]:
        result = run(pytester, "--pyargs", *args)
        summary = next(line for line in result.outlines if line.startswith("FAILED "))
        row = next(line for line in result.outlines if line.rstrip().endswith("  FAIL"))
        return summary.split()[1], row.split()[0]

    # The rootdir above the starting directory, the shipped tests inside it.
    (pytester.path / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.chdir(project)
    shown, cell = failed_row("shipped")
    assert shown == cell == "../site/shipped/test_shipped.py::test_bad"

    # The user's project is the rootdir, the shipped tests outside it.
    (pytester.path / "pytest.ini").unlink()
    (project / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.chdir(project / "sub")
    shown, cell = failed_row("shipped")
    assert shown == cell == "../test_shipped.py::test_bad"
    shown, cell = failed_row("shipped.test_shipped")
    assert (shown, cell) == ("..::test_bad", "../../site/shipped/test_shipped.py::test_bad")
