"""The lightning-sprite seed's "Known to fail in Lightning 2.6.5" items about resume, as they behave on 2.6.6.

Each test pins today's behaviour, so a Lightning release that changes it fails here and the seed's list can
be updated: a mid-epoch resume with an ordinary DataLoader restarts the epoch's data; Lightning's
``consolidate_checkpoint`` cannot read an FSDP2Strategy checkpoint; and (fixed by our FSDP2Strategy, kept so
it stays fixed) a DDP checkpoint of a LoRA optimizer resumes under FSDP2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch  # noqa: F401  (loaded before the sub-worlds fork, as README advises)
import peft  # noqa: F401
import pytest
import transformers  # noqa: F401

from pytest_sprite.assertions.resume import _restore_problems
from pytest_sprite.recipes._resume import ResumeRecipe, RoleSpec, run_role
from pytest_sprite.recipes.lora_qwen import LoraQwen
from pytest_sprite.recipes.resume_roles import records_from_events
from pytest_sprite.records import RoleRecord
from pytest_sprite.subworld import KillAt, run_subworld

pytestmark = pytest.mark.cpu


def _role(
    role: str, strategy: str, ranks: int, root: Path, *, kill: KillAt | None = None, **fields: Any
) -> tuple[RoleRecord, ...]:
    spec = RoleSpec(
        role=role,
        strategy=strategy,
        precision="32-true",
        recipe=ResumeRecipe(source=LoraQwen(), global_batch=4),
        directory=str(root / role),
        **fields,
    )
    result = run_subworld(run_role, args=(spec,), ranks=ranks, kill=kill)
    if kill is None:
        result.values()  # raises with every rank's story unless all returned
    else:
        assert result.killed() == list(range(ranks)), result.report()
    return tuple(records_from_events(list(o.events), killed=kill is not None) for o in result.outcomes)


def test_mid_epoch_resume_restarts_the_epoch_data(tmp_path: Path) -> None:
    """Seed: "Resuming a mid-epoch checkpoint with an ordinary DataLoader restarts the epoch's data"."""
    (fit,) = _role("fit", "single", 1, tmp_path)
    (killed,) = _role("killed", "single", 1, tmp_path, kill=KillAt(event="step", at=3), save_every_n_steps=2)
    assert killed.saves[0].global_step == 2  # saved after step 1, in the middle of epoch 0's 3 steps
    (resume,) = _role(
        "resume", "single", 1, tmp_path, resume_from=str(tmp_path / "killed" / "epoch=0-step=2.ckpt")
    )
    first = resume.steps[0]
    assert (first.step, first.epoch, first.batch) == (2, 0, 2)  # Lightning's counters say "batch 2" ...
    assert first.rows == fit.steps[0].rows  # ... but the rows are epoch 0's first batch again
    assert first.rows != fit.steps[2].rows
    assert [s.rows for s in resume.steps[1:]] == [s.rows for s in fit.steps[3:]]  # the next epoch is right


def test_consolidate_checkpoint_cannot_read_an_fsdp2_checkpoint(tmp_path: Path) -> None:
    """Seed: consolidate_checkpoint "fails on FSDP2Strategy checkpoints (KeyError: 'model')"."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    _role("fit", "fsdp", 2, tmp_path, max_epochs=1)
    sharded = tmp_path / "fit" / "epoch=0.ckpt"
    assert sharded.is_dir()
    checkpoint = _load_distributed_checkpoint(sharded)
    assert "state_dict" in checkpoint and "model" not in checkpoint
    with pytest.raises(KeyError, match="'model'"):
        _format_checkpoint(checkpoint)


def test_a_ddp_checkpoint_of_a_lora_optimizer_resumes_under_fsdp2(tmp_path: Path) -> None:
    """Seed: a 1-device or DDP checkpoint under FSDP2 failed with "Missing optimizer state"; ours restores it."""
    ddp = _role("killed", "ddp", 2, tmp_path, kill=KillAt(event="step", at=4))
    fsdp = _role("resume", "fsdp", 2, tmp_path, resume_from=str(tmp_path / "killed" / "epoch=0.ckpt"))
    for rank in (0, 1):
        restored = fsdp[rank].restored
        assert restored is not None
        assert _restore_problems(restored, ddp[rank].saves[0], same_world=False) == {}
    assert [s.rows for s in fsdp[0].steps[:1]] == [ddp[0].steps[3].rows]  # it carries on from step 3
