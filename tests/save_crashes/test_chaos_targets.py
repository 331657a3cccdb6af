"""Crash matrices of the built-in targets: the lora_qwen recipe's Lightning fit, HF Trainer, a shared-temp race.

The full matrices are marked ``slow`` (minutes on CPU; run with ``--run-slow``); one narrowed 2-rank ddp matrix runs in CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_sprite import CrashConsistencyError, assert_crash_consistent, crash_fn, crash_hf_trainer

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def lora_target() -> Any:
    pytest.importorskip("lightning")
    pytest.importorskip("peft")
    from pytest_sprite.save_crashes.crash_targets import MatrixTarget
    from pytest_sprite.save_crashes.lora import LoraQwenTarget

    return lambda **options: MatrixTarget(LoraQwenTarget(**options))


def _last_ckpt(event: Any) -> bool:
    """The crash points between installing ck-step=N.ckpt and updating last.ckpt."""
    return event.dest == "last.ckpt"


def test_ddp_at_two_ranks_loses_work_when_it_dies_before_last_ckpt(tmp_path: Path, lora_target: Any) -> None:
    target = lora_target(strategy="ddp", ranks=2)
    matrix = assert_crash_consistent(target, out_dir=tmp_path / "ok", select=_last_ckpt)
    assert matrix.ranks == 2 and matrix.deterministic and matrix.control.verdict == "PASS"
    # Lightning renames a finished temp file into place as ck-step=N.ckpt, then again as last.ckpt; dying
    # between the two leaves a complete checkpoint that ckpt_path="last" does not use (only rank 0 writes)
    assert [(r.rank, r.file, r.verdict, r.newest_complete, r.resumed_from) for r in matrix.rows] == [
        (0, "<outside> -> last.ckpt", "LOST_WORK", "ck-step=5.ckpt", "<scratch>"),
        (0, "<outside> -> last.ckpt", "LOST_WORK", "ck-step=10.ckpt", "ck-step=5.ckpt"),
    ]
    assert [r.weight_diff for r in matrix.rows] == [0.0, 0.0]  # work redone, nothing corrupted
    with pytest.raises(CrashConsistencyError, match=r"2 LOST_WORK of 2 crash points"):
        assert_crash_consistent(target, out_dir=tmp_path / "strict", select=_last_ckpt, allow_lost_work=False)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "ranks"), [("single", 1), ("ddp", 1), ("ddp", 2)])
def test_lightning_file_checkpoints_never_break(
    tmp_path: Path, lora_target: Any, strategy: str, ranks: int
) -> None:
    matrix = assert_crash_consistent(lora_target(strategy=strategy, ranks=ranks), out_dir=tmp_path / "chaos")
    assert matrix.counts["HARD_FAIL"] == matrix.counts["SILENT_DIVERGENCE"] == 0
    assert {r.event for r in matrix.rows} == {"rename"}  # Lightning writes into the temp dir, then renames
    assert [r.verdict for r in matrix.rows if r.verdict != "PASS"] == ["LOST_WORK"] * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "ranks"), [("fsdp", 1), ("fsdp", 2), ("fsdp_file", 1), ("fsdp_file", 2)]
)
def test_fsdp_matrices_run_and_judge(tmp_path: Path, lora_target: Any, strategy: str, ranks: int) -> None:
    try:
        matrix = assert_crash_consistent(
            lora_target(strategy=strategy, ranks=ranks), out_dir=tmp_path / "chaos"
        )
    except CrashConsistencyError as exc:
        matrix = exc.result
    assert matrix.deterministic and matrix.control.verdict == "PASS"
    assert all(r.crashed for r in matrix.rows)
    if strategy == "fsdp":  # a torch.distributed.checkpoint folder written in place: crashes inside it break
        assert matrix.counts["HARD_FAIL"] > 0


@pytest.mark.slow
def test_hf_trainer_single_process_step_10_save(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(
            crash_hf_trainer(),
            out_dir=tmp_path / "chaos",
            select=lambda e: e.path.startswith("checkpoint-10"),
            tear="native",
        )
    matrix = info.value.result
    # only dying before the folder exists is clean: any later point leaves a checkpoint-10 the resume trusts
    assert matrix.rows[0].event == "mkdir" and matrix.rows[0].verdict == "PASS"
    assert {r.verdict for r in matrix.rows[1:]} == {"HARD_FAIL"}
    assert matrix.rows[-1].file == "checkpoint-10/trainer_state.json"


@pytest.mark.slow
def test_every_rank_renaming_one_shared_temp_folder_is_caught_with_flake(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pytest_sprite.save_crashes.protocols import train_shared_tmp

    with pytest.raises(CrashConsistencyError) as info:
        assert_crash_consistent(
            crash_fn(train_shared_tmp, ranks=2), out_dir=tmp_path / "chaos", flake=20, max_points=2
        )
    problems = " ".join(info.value.result.problems)
    assert "fault-free" in problems and "FileNotFoundError" in problems
