"""assert_crash_consistent end to end: planted save protocols, the function and the command forms, refusals."""

from __future__ import annotations

import json
import os
import random
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from sprite_testing import run_pytest

from pytest_sprite import (
    CrashConsistencyError,
    assert_crash_consistent,
    crash_command,
    crash_fn,
    judge_crash_matrix,
)
from pytest_sprite.errors import SpriteUsageError

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def protocols() -> Any:
    pytest.importorskip("torch")
    from pytest_sprite.save_crashes import protocols

    return protocols


def test_in_place_save_with_unchecked_resume_is_a_hard_fail(tmp_path: Path, protocols: Any) -> None:
    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(crash_fn(protocols.train_in_place), out_dir=tmp_path / "chaos")
    matrix = info.value.result
    # two saves of mkdir + model.pt + optim.pt + state.json; each file write also torn
    assert [(r.event, r.file, r.torn) for r in matrix.rows[:7]] == [
        ("mkdir", "ckpt-2", False),
        ("torch.save", "ckpt-2/model.pt", False),
        ("torch.save", "ckpt-2/model.pt", True),
        ("torch.save", "ckpt-2/optim.pt", False),
        ("torch.save", "ckpt-2/optim.pt", True),
        ("open", "ckpt-2/state.json", False),
        ("open", "ckpt-2/state.json", True),
    ]
    assert all(r.crashed and not r.note for r in matrix.rows)
    # dying before the folder exists is clean; every later point leaves a folder the resume trusts and fails on
    assert [r.verdict for r in matrix.rows] == ["PASS"] + ["HARD_FAIL"] * 6 + ["PASS"] + ["HARD_FAIL"] * 6
    assert matrix.rows[1].error.startswith("FileNotFoundError")
    assert matrix.rows[8].newest_complete == "ckpt-2" and matrix.rows[7].resumed_from == "ckpt-2"
    assert matrix.control.verdict == "PASS" and matrix.deterministic
    assert info.value.failed[0].detail == "12 HARD_FAIL of 14 crash points"
    assert "12 HARD_FAIL + 2 PASS of 14 crash points (control PASS)" in str(info.value)
    stored = judge_crash_matrix(tmp_path / "chaos")
    assert stored.to_dict() == {**matrix.to_dict(), "wall_s": stored.wall_s}


def test_temp_folder_renamed_into_place_passes(tmp_path: Path, protocols: Any) -> None:
    matrix = assert_crash_consistent(
        crash_fn(protocols.train_tmp_rename), out_dir=tmp_path / "chaos", max_points=7
    )
    assert matrix.passed and matrix.counts["PASS"] == 7
    assert {r.event for r in matrix.rows} >= {"mkdir", "torch.save", "rename"}
    assert any(r.torn for r in matrix.rows)
    assert (tmp_path / "chaos" / "matrix.json").is_file()


# --- torch-free targets: fast, and the rules about the fault-free runs ----------------------------------


def _json_train(out_dir: Path, *, noise: bool = False, fail_in: str | None = None) -> dict[str, Any]:
    """Four steps of a scalar 'model', a checkpoint folder per two steps, renamed into place from ``.tmp``."""
    if fail_in is not None and out_dir.name == fail_in:
        raise FileNotFoundError("planted: lost the race for ckpt-2.tmp")
    step, w = 0, 1.0
    found = sorted((int(p.name.split("-")[1]), p) for p in out_dir.glob("ckpt-*") if p.suffix != ".tmp")
    if found:
        state = json.loads((found[-1][1] / "state.json").read_text())
        step, w = state["step"], state["w"]
    while step < 4:
        w = w * 0.5 + step + (random.random() if noise else 0.0)
        step += 1
        if step % 2 == 0:
            tmp = out_dir / f"ckpt-{step}.tmp"
            tmp.mkdir(exist_ok=True)
            (tmp / "state.json").write_text(json.dumps({"step": step, "w": w}))
            os.replace(tmp, out_dir / f"ckpt-{step}")
    return {"w": w}


def test_a_target_whose_fault_free_runs_differ_fails_with_that_reason(tmp_path: Path) -> None:
    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(
            crash_fn(lambda d: _json_train(d, noise=True)), out_dir=tmp_path / "chaos", max_points=2
        )
    matrix = info.value.result
    assert not matrix.deterministic
    assert matrix.problems[0].startswith("two fault-free runs already differ")
    assert info.value.failed[0].check == "deterministic"


def test_flake_counts_failing_fault_free_runs(tmp_path: Path) -> None:
    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(
            crash_fn(lambda d: _json_train(d, fail_in="flake-2")),
            out_dir=tmp_path / "chaos",
            flake=3,
            max_points=2,
        )
    matrix = info.value.result
    assert matrix.flake_runs == 3 and len(matrix.flake_failures) == 1
    assert matrix.problems == (
        "1 of 3 repeated fault-free runs failed: flake-2: FileNotFoundError: planted: lost the race for ckpt-2.tmp",
    )


def test_a_target_that_fails_without_any_crash_fails_the_matrix(tmp_path: Path) -> None:
    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(crash_fn(lambda d: 1 / 0), out_dir=tmp_path / "chaos")
    assert info.value.result.problems == (
        "the fault-free run failed, so nothing was crashed: ZeroDivisionError: division by zero "
        "(its output: logs/free-1.r0.out)",
    )
    assert info.value.failed[0].check == "fault_free"
    assert "ZeroDivisionError" in (tmp_path / "chaos" / "logs" / "free-1.r0.out").read_text()
    assert judge_crash_matrix(tmp_path / "chaos").problems == info.value.result.problems


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    (tmp_path / "exists").mkdir()
    with pytest.raises(
        SpriteUsageError, match=r"exists; the crash matrix writes only into a directory it creates"
    ):
        assert_crash_consistent(crash_fn(_json_train), out_dir=tmp_path / "exists")
    with pytest.raises(SpriteUsageError, match=r"a command target needs result_file="):
        assert_crash_consistent(crash_command(["python", "t.py", "{out}"]), out_dir=tmp_path / "a")
    with pytest.raises(
        SpriteUsageError, match=r"has no \{out\}: put \{out\} where it takes its output directory"
    ):
        assert_crash_consistent(
            crash_command(["python", "t.py"], result_file="{out}/f.json"), out_dir=tmp_path / "b"
        )
    with pytest.raises(SpriteUsageError, match=r"flake must be a non-negative int"):
        assert_crash_consistent(crash_fn(_json_train), out_dir=tmp_path / "c", flake=-1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_target_that_is_not_built_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(
        SpriteUsageError,
        match=r"^cannot crash a function: build the target with pytest_sprite\.crash_fn\(train\), "
        r"crash_command\(\[\.\.\., '\{out\}'\], result_file=\.\.\.\), crash_recipe\(recipe, strategy=\.\.\.\) or "
        r"crash_hf_trainer\(\)$",
    ):
        assert_crash_consistent(_json_train, out_dir=tmp_path / "chaos")  # type: ignore[arg-type]
    assert not (tmp_path / "chaos").exists()


def test_the_keyword_form_of_pytest_sprite_chaos_gives_the_same_matrix(tmp_path: Path) -> None:
    from pytest_sprite.save_crashes import assert_crash_consistent as keyword_form

    with pytest.raises(CrashConsistencyError) as built:
        assert_crash_consistent(crash_fn(lambda d: 1 / 0), out_dir=tmp_path / "built")
    with pytest.raises(CrashConsistencyError) as keywords:
        keyword_form(lambda d: 1 / 0, out_dir=tmp_path / "keywords")
    assert keywords.value.result.problems == built.value.result.problems


# --- the command form: an unmodified script, one interpreter per run -------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    out = sys.argv[1]
    step, w = 0, 1.0
    names = [n for n in os.listdir(out) if n.startswith("ckpt-")]
    if names:  # the highest-numbered folder, trusted blindly
        last = max(names, key=lambda n: int(n.split("-")[1]))
        with open(os.path.join(out, last, "state.json")) as f:
            state = json.load(f)
        step, w = state["step"], state["w"]
    while step < 4:
        w = w * 0.5 + step
        step += 1
        if step % 2 == 0:
            os.makedirs(os.path.join(out, f"ckpt-{step}"), exist_ok=True)
            with open(os.path.join(out, f"ckpt-{step}", "state.json"), "w") as f:
                json.dump({"step": step, "w": w}, f)
    with open(os.path.join(out, "final.json"), "w") as f:
        json.dump({"w": w}, f)
    """
)


def test_command_form_crashes_an_unmodified_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(
            crash_command([sys.executable, str(script), "{out}"], result_file="{out}/final.json"),
            out_dir=tmp_path / "chaos",
        )
    matrix = info.value.result
    assert [(r.event, r.file, r.torn, r.verdict) for r in matrix.rows] == [
        ("mkdir", "ckpt-2", False, "PASS"),
        ("open", "ckpt-2/state.json", False, "HARD_FAIL"),
        ("open", "ckpt-2/state.json", True, "HARD_FAIL"),
        ("mkdir", "ckpt-4", False, "PASS"),
        ("open", "ckpt-4/state.json", False, "HARD_FAIL"),
        ("open", "ckpt-4/state.json", True, "HARD_FAIL"),
        ("open", "final.json", False, "PASS"),
        ("open", "final.json", True, "PASS"),
    ]
    assert "FileNotFoundError" in (matrix.rows[1].error or "")
    assert "JSONDecodeError" in (matrix.rows[2].error or "")
    assert sorted(os.listdir(tmp_path / "chaos")) == [
        "crash_consistency-01.assertion.json",  # the manifest `python -m pytest_sprite judge` reads
        "inject",
        "logs",
        "matrix.json",
        "matrix.txt",
        "runs",
    ]


@pytest.mark.slow
def test_command_form_on_the_torch_protocol_script(tmp_path: Path, protocols: Any) -> None:
    command = [sys.executable, "-m", "pytest_sprite.save_crashes.protocols", "tmp_rename", "{out}"]
    matrix = assert_crash_consistent(
        crash_command(command, result_file="{out}/final.pt", env={"PYTHONPATH": os.getcwd()}),
        out_dir=tmp_path / "chaos",
    )
    assert matrix.passed and {r.event for r in matrix.rows} >= {"torch.save", "rename"}


@pytest.mark.slow  # 35 s; test_command_form_crashes_an_unmodified_script fails the same protocol
def test_in_a_pytest_session_a_broken_protocol_fails_its_test_with_the_matrix(
    pytester: pytest.Pytester,
) -> None:
    pytest.importorskip("torch")
    pytester.makepyfile(
        test_save="""
        from pytest_sprite import assert_crash_consistent, crash_fn
        from pytest_sprite.save_crashes.protocols import train_in_place, train_tmp_rename

        def test_in_place(tmp_path):
            assert_crash_consistent(crash_fn(train_in_place), out_dir=tmp_path / "chaos", max_points=3)

        def test_tmp_rename(tmp_path):
            m = assert_crash_consistent(crash_fn(train_tmp_rename), out_dir=tmp_path / "chaos", max_points=3)
            assert m.kind == "crash_consistency" and m.passed
        """
    )
    result = run_pytest(pytester, timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*CrashConsistencyError: crash consistency of pytest_sprite.save_crashes.protocols.train_in_place (1 rank): FAILED",
            "*  - 2 HARD_FAIL of 3 crash points",
            "*2 HARD_FAIL + 1 PASS of 3 crash points (control PASS)",
            "*control  -*-*control*PASS*ckpt-4*ckpt-4*0",
            "*1        0*ckpt-2*mkdir*PASS*<scratch>*0",
        ]
    )
