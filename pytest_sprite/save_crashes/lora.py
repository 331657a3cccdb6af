"""The ``lora_qwen`` recipe as a crash-matrix target: a Lightning fit that saves and auto-resumes.

The recipe's model (tiny Qwen2 + LoRA r=8 on q/k/v/o + a 2-class head, seeded) and rows, trained with SGD and
momentum and the recipe's global-norm clip by a real Lightning fit under one of the shipped strategies:

- ``single``: one device; ``ddp``: :class:`~pytest_sprite.lightning.XPUDDPStrategy`;
- ``fsdp``: :class:`~pytest_sprite.lightning.FSDP2Strategy` with sharded checkpoints (a
  ``torch.distributed.checkpoint`` folder per save); ``fsdp_file``: the same with
  ``save_distributed_checkpoint=False`` (one full-state file).

The schedule is ckpt-chaos's Lightning one: 10 optimizer steps, a checkpoint every 5 (``ck-step=5.ckpt``,
``ck-step=10.ckpt``) plus ``last.ckpt``, and the resume is ``fit(ckpt_path="last")`` whenever ``last.ckpt``
exists. Every epoch is one step, so each save is at an epoch end (Lightning restarts a mid-epoch resume's data
from the epoch's first batch: a known limitation, not what this matrix tests). Saves are marked complete after
Lightning returns from writing them; the resume marks the step it restored, as the save of that step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.process import prewarm_fit, prewarm_training
from pytest_sprite.recipes.sharding_units import default_shard
from pytest_sprite.save_crashes.inject import note_resumed_from, note_save_complete
from pytest_sprite.save_crashes.target_run import RunOutcome, RunRequest, rank_envs

__all__ = ["LORA_STRATEGIES", "LoraQwenTarget", "train_in_subworld", "train_lora_qwen"]

LORA_STRATEGIES: tuple[str, ...] = ("single", "ddp", "fsdp", "fsdp_file")
"""Strategies the target trains with (the shipped ones; ``fsdp_file`` writes one full-state file)."""
STEPS = 10
SAVE_EVERY = 5
GLOBAL_BATCH = 4
LR = 0.1
CLIP = 0.01
SEED = 0


def _checkpoint_name(step: int) -> str:
    return f"ck-step={step}.ckpt"


def train_lora_qwen(train_dir: Path, strategy: str, source: Any = None) -> dict[str, Any]:
    """Fit the recipe into ``train_dir`` (this process is one rank), resuming from ``last.ckpt``; return weights.

    ``source`` is a project's :class:`~pytest_sprite.Recipe` (its model built after ``torch.manual_seed``,
    its rows, loss and FSDP2 units) trained the same way; None trains lora_qwen's tiny model and rows.
    """
    from pytest_sprite.lightning import FSDP2Strategy, trainer_kwargs
    from pytest_sprite.recipes.fit_kit import make_trainer

    if strategy not in LORA_STRATEGIES:
        raise SpriteUsageError(f"unknown strategy {strategy!r}; strategies: {', '.join(LORA_STRATEGIES)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kind = "fsdp" if strategy == "fsdp_file" else strategy
    if kind == "single":
        kwargs = trainer_kwargs("single", devices=1, precision="32-true", accelerator="cpu")
    else:
        kwargs = trainer_kwargs(kind, devices=world, precision="32-true", accelerator="cpu")  # type: ignore[arg-type]
    if strategy == "fsdp_file":
        kwargs["strategy"] = FSDP2Strategy(save_distributed_checkpoint=False)
    module = _module(strategy, source, world=world, rank=int(os.environ.get("RANK", "0")))
    trainer = make_trainer(
        kwargs,
        root=train_dir,
        max_epochs=STEPS,
        clip=CLIP,
        callbacks=[_marked_checkpoint(train_dir)],
        reload_every_epoch=True,
    )
    final: dict[str, Any] = {}
    strategy_teardown = trainer.strategy.teardown

    def teardown() -> None:
        # gather here: the strategy's teardown ends the process group before fit returns, and a resume of a
        # finished run skips every training hook
        final.update(_full_state(module.net))
        strategy_teardown()

    trainer.strategy.teardown = teardown  # type: ignore[method-assign]
    last = Path(train_dir) / "last.ckpt"
    trainer.fit(module, ckpt_path="last" if last.exists() else None)
    return final


def _module(strategy: str, source: Any, *, world: int, rank: int) -> Any:
    """The recipe as a LightningModule: epoch e trains step e's rows, this rank's strided share of them."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, default_collate

    from pytest_sprite.recipes.fit_kit import data_parallel_part, trainable
    from pytest_sprite.recipes.lora_qwen import LoraQwen
    from pytest_sprite.recipes.resolve import build_model

    recipe = source if source is not None else LoraQwen(seed=SEED)
    ranks = 1 if strategy == "single" else world
    micro = GLOBAL_BATCH // ranks
    rows = recipe.rows(STEPS * GLOBAL_BATCH)
    shard = recipe.shard or default_shard

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model(recipe)

        def configure_model(self) -> None:
            if strategy in ("fsdp", "fsdp_file"):
                shard(self.net, data_parallel_part(self.device_mesh))

        def train_dataloader(self) -> DataLoader[Any]:
            epoch = self.trainer.current_epoch
            ids = list(range(epoch * GLOBAL_BATCH + rank, (epoch + 1) * GLOBAL_BATCH, ranks))[:micro]
            return DataLoader([default_collate([rows[i] for i in ids])], batch_size=None)  # type: ignore[arg-type]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = recipe.loss(self.net, batch)
            return loss * (micro * ranks / GLOBAL_BATCH)

        def on_train_start(self) -> None:
            step = self.trainer.global_step
            note_resumed_from(_checkpoint_name(step) if step else None)

        def configure_optimizers(self) -> Any:
            # momentum: optimizer state to save (torch cannot load a full-state optimizer dict without tensors)
            return torch.optim.SGD([p for _, p in trainable(self.net)], lr=LR, momentum=0.9)

    return Module()


def _marked_checkpoint(train_dir: Path) -> Any:
    """Lightning's ModelCheckpoint every SAVE_EVERY steps and ``last.ckpt``, marking each save complete."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class MarkedCheckpoint(ModelCheckpoint):
        def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
            super()._save_checkpoint(trainer, filepath)
            name = os.path.basename(filepath)
            if name.startswith("ck-"):
                note_save_complete(name)

    return MarkedCheckpoint(
        dirpath=train_dir,
        filename="ck-{step}",
        every_n_epochs=SAVE_EVERY,
        save_top_k=-1,
        save_last=True,
        save_on_train_epoch_end=True,
        enable_version_counter=False,
    )


def _full_state(net: Any) -> dict[str, Any]:
    """Trainable weights as full CPU tensors (gathering DTensor shards: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, p in net.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).to("cpu").clone()
    return out


def train_in_subworld(train_dir: Path, strategy: str, source: Any = None) -> dict[str, Any]:
    """The fit as one rank of a sub-world (a ranks test's form): the sub-world has started the process group."""
    return _train_entry(train_dir, strategy, source)


def _prepare_zygote(train_dir: Path, strategy: str, source: Any = None) -> None:
    """Run once in each test rank's zygote before its sub-worlds fork: imports and the model, warm."""
    LoraQwenTarget(strategy="single", source=source).prewarm()


train_in_subworld.subworld_prepare = _prepare_zygote  # type: ignore[attr-defined]


def _train_entry(train_dir: Path, strategy: str, source: Any = None) -> dict[str, Any]:
    with _quiet():
        return train_lora_qwen(train_dir, strategy, source)


class _quiet:
    def __enter__(self) -> None:
        import logging
        import warnings

        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class LoraQwenTarget:
    """The recipe's Lightning fit under ``strategy`` at ``ranks`` processes (forks with torchrun's variables)."""

    strategy: str
    ranks: int = 1
    source: Any = None
    """A project's Recipe to train instead of lora_qwen's model (picklable: top-level callables)."""

    def __post_init__(self) -> None:
        if self.strategy not in LORA_STRATEGIES:
            raise SpriteUsageError(f"strategy={self.strategy!r} is not one of {', '.join(LORA_STRATEGIES)}")
        if self.strategy == "single" and self.ranks != 1:
            raise SpriteUsageError(f"strategy='single' trains on one process, got ranks={self.ranks}")
        if GLOBAL_BATCH % self.ranks:
            raise SpriteUsageError(f"ranks={self.ranks} must divide the global batch of {GLOBAL_BATCH}")

    @property
    def label(self) -> str:
        return f"{self.source.name if self.source is not None else 'lora_qwen'} {self.strategy}"

    def prewarm(self) -> None:
        """Import Lightning, PEFT and transformers' Qwen2 here once, so forks start warm."""
        prewarm_training()
        import lightning.pytorch  # noqa: F401

        from pytest_sprite.recipes import sharding_units  # noqa: F401 (the fit's FSDP2 units)

        prewarm_fit()

        if self.source is not None:
            return
        from pytest_sprite.recipes.lora_qwen import LoraQwen

        LoraQwen(seed=SEED).build_model()

    def run(self, request: RunRequest) -> RunOutcome:
        return request.in_forks(_train_entry, (self.strategy, self.source), rank_envs(self.ranks))
