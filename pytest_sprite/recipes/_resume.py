"""The checkpoint-resume roles: one Lightning fit each, run in a sub-world's fresh processes.

The lightning-sprite procedure's "Checkpoints" recipe: the LoRA classifier of ``lora_qwen`` trained with AdamW,
a per-step LR schedule and global-norm clipping for 2 epochs of 3 steps, a checkpoint at the end of every
epoch. Each role is one fit; what it sees it *emits* as it goes (every step, every save, the restore), so a
role killed at its kill point still reports what it finished. Loaded only inside a role's process: it
imports torch and Lightning at the top.

- ``fit`` / ``twin``: uninterrupted fits, the same twice (is a fault-free fit reproducible at all?).
- ``killed``: the same fit, killed one step past its epoch-1 checkpoint (``kill_point("step", n)``).
- ``resume``: a fresh process resuming the killed fit's checkpoint; a fault is planted after the restore.
- ``reload``: loads the checkpoint the resume wrote at its end, and stops after the restore.
- ``reshard`` / ``export``: the resume at half the world (FSDP2), or on one device (ddp, fsdp_file).

Before every load, four frozen tensors are changed, so only the checkpoint can restore them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from pytest_sprite import subworld
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.planted_faults import PlantSite, plant
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.recipes.fit_kit import (
    IndexedRows,
    collate_indexed,
    data_parallel_part,
    fit_numerics,
    full_many,
    lightning_kwargs,
    make_trainer,
    norm_of,
)
from pytest_sprite.recipes.mesh import data_parallel_mesh
from pytest_sprite.recipes.resolve import build_model
from pytest_sprite.recipes.resume_spec import FROZEN_CHANGED, ResumeRecipe, RoleSpec
from pytest_sprite.recipes.resume_state import capture_state, rng_digest
from pytest_sprite.recipes.sharding_units import default_shard
from pytest_sprite.records import StateCapture, StepRecord
from pytest_sprite.world import World

if TYPE_CHECKING:
    from pytest_sprite.subworld.join import Seat

__all__ = ["ResumeRecipe", "RoleSpec", "run_role"]

# -------------------------------------------------------------------------------------------------------
# data


class _EpochOrder:
    """Which epoch is being read; Lightning calls ``set_epoch`` on ``batch_sampler.sampler`` every epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _EpochBatches:
    """This rank's batches of one epoch: a seeded permutation per epoch, sharded strided by rank.

    Step ``s`` of every rank together covers rows ``perm[s*B .. s*B+B-1]`` at any world size dividing
    ``B``, so a resharded resume trains the same rows as the uninterrupted fit; each epoch reads the rows
    in its own order, so a resume that replays the wrong epoch trains the wrong rows.
    """

    def __init__(self, *, rows: int, seed: int, num_replicas: int, rank: int, micro_batch: int) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise SpriteUsageError(
                f"the strategy reports distributed_sampler_kwargs num_replicas={num_replicas}, rank={rank}"
            )
        self.rows, self.seed = rows, seed
        self.num_replicas, self.rank, self.micro_batch = num_replicas, rank, micro_batch
        self.sampler = _EpochOrder()

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.sampler.epoch)
        perm = torch.randperm(self.rows, generator=gen).tolist()
        shard = perm[self.rank :: self.num_replicas]
        for i in range(0, len(shard) - self.micro_batch + 1, self.micro_batch):
            yield shard[i : i + self.micro_batch]

    def __len__(self) -> int:
        return (self.rows // self.num_replicas) // self.micro_batch


# -------------------------------------------------------------------------------------------------------
# the LightningModule


@dataclass(kw_only=True)
class _Pending:
    """The step running, under :class:`StepRecord`'s names, so that its record is made from it whole."""

    epoch: int = 0
    batch: int = 0
    loss: float = float("nan")
    rows: tuple[int, ...] = ()
    rng: str = ""
    lr: float = float("nan")
    pre_clip_norm: float = float("nan")


class _ResumeModule(pl.LightningModule):
    """The recipe as a LightningModule that emits each step, each save and the restore."""

    def __init__(
        self,
        *,
        net: torch.nn.Module,
        rows: Sequence[Any],
        spec: RoleSpec,
        world: World,
        micro_batch: int,
        emit: Callable[[str, Any], None],
    ) -> None:
        super().__init__()
        self.net = net
        self._rows = rows
        source = spec.recipe.source
        self._loss: Callable[[torch.nn.Module, Any], torch.Tensor] = source.loss
        self._shard: Callable[[torch.nn.Module, Any], Any] = source.shard or default_shard
        self._spec = spec
        self._world = world
        self._micro_batch = micro_batch
        self._emit = emit
        self._pending = _Pending()

    def _trainables(self) -> list[torch.nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def configure_model(self) -> None:
        if self._spec.strategy not in ("fsdp", "fsdp_file"):
            return
        mesh = self.device_mesh if self.device_mesh is not None else data_parallel_mesh(self._world)
        # lora_qwen declares _no_split_modules, so default_shard is shard_model there.
        self._shard(self.net, data_parallel_part(mesh))

    def train_dataloader(self) -> DataLoader[Any]:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = _EpochBatches(
            rows=len(self._rows),
            seed=self._spec.recipe.seed,
            num_replicas=int(kwargs.get("num_replicas", 1)),
            rank=int(kwargs.get("rank", 0)),
            micro_batch=self._micro_batch,
        )
        return DataLoader(
            IndexedRows(self._rows), batch_sampler=sampler, collate_fn=collate_indexed, num_workers=0
        )

    def configure_optimizers(self) -> Any:
        recipe = self._spec.recipe
        optimizer = torch.optim.AdamW(self._trainables(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=recipe.end_factor, total_iters=recipe.total_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _capture(self) -> StateCapture:
        return capture_state(self.trainer, self.net, rank=self._world.rank, world_size=self._world.size)

    def on_train_start(self) -> None:
        if self._spec.resume_from is None:
            return
        if self._spec.fault is not None:
            site = PlantSite(arm="resume", rank=self._world.rank, world_size=self._world.size, accumulate=1)
            plant(self._spec.fault, site).after_restore(self.trainer, site)
            self._emit("fault", self._spec.fault)
        self._emit("restored", self._capture())
        if self._spec.stop_after_restore:
            self.trainer.should_stop = True

    def training_step(self, batch: tuple[list[int], Any], batch_idx: int) -> torch.Tensor:
        ids, data = batch
        p = self._pending
        p.rng = rng_digest(self._world.device)
        p.epoch, p.batch = int(self.trainer.current_epoch), int(batch_idx)
        p.rows = tuple(int(i) for i in ids)
        loss = self._loss(self.net, data)
        p.loss = float(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad.detach() for p in self._trainables() if p.grad is not None]
        self._pending.pre_clip_norm = norm_of(full_many(grads))
        self._pending.lr = float(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = int(self.trainer.global_step)
        record = StepRecord(step=step - 1, **asdict(self._pending))
        self._emit("step", record)
        subworld.kill_point("step", step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._emit("save", self._capture())


# -------------------------------------------------------------------------------------------------------
# one role


def _change_frozen(net: torch.nn.Module) -> list[str]:
    """Add 1 to the first FROZEN_CHANGED frozen tensors, so only the checkpoint can restore them."""
    changed: list[str] = []
    with torch.no_grad():
        for name, param in net.named_parameters():
            if len(changed) == FROZEN_CHANGED:
                break
            if not param.requires_grad:
                param.add_(1.0)
                changed.append(name)
    return changed


def _strategy_kwargs(spec: RoleSpec, world: World) -> dict[str, Any]:
    kind = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "fsdp_file": "fsdp"}[spec.strategy]
    kwargs = lightning_kwargs(kind, world, spec.precision)
    if spec.strategy == "fsdp_file":
        from pytest_sprite.lightning import FSDP2Strategy

        kwargs["strategy"] = FSDP2Strategy(save_distributed_checkpoint=False)
    return kwargs


def _prepare(spec: RoleSpec, emit: Any = None) -> None:
    """Import what a fit imports late and load the model, once, in the process the role's ranks are forked
    from (CPU only). A model with a copy-once cache (lora_qwen's ``warm``) is warmed, usually a no-op as the
    session warmed it before its first fork; any other is built once, for what its first build loads."""
    from pytest_sprite.plumbing.process import prewarm_fit

    prewarm_fit()
    warm = getattr(spec.recipe.source.model, "warm", None)
    if callable(warm):
        warm()  # a build here would be a copy of the cached model, thrown away
    else:
        build_model(spec.recipe.source)


def run_role(world: World, spec: RoleSpec, emit: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """Run one role on this rank of ``world`` and return its summary; steps and saves go to ``emit``.

    ``emit`` defaults to :func:`pytest_sprite.subworld.emit`, which sends them to the process that
    started the sub-world as they happen (so they survive a kill).
    """
    send = emit if emit is not None else subworld.emit
    recipe = spec.recipe
    ranks = 1 if spec.strategy == "single" else world.size
    if spec.strategy == "single" and world.size != 1:
        raise SpriteUsageError(f"the single strategy runs on a world of 1, this one has {world.size} ranks")
    if recipe.global_batch % ranks:
        raise SpriteUsageError(
            f"global_batch={recipe.global_batch} must be a multiple of the role's {ranks} ranks"
        )
    directory = Path(spec.directory)
    trainer = _fit(
        world,
        spec,
        send,
        max_epochs=spec.max_epochs if spec.max_epochs is not None else recipe.epochs,
        callbacks=_checkpoints(spec, directory),
    )
    written = sorted(p.name for p in directory.glob("*.ckpt")) if directory.is_dir() else []
    return {"strategy_class": type(trainer.strategy).__name__, "checkpoints": written}


def _fit(
    world: World,
    spec: RoleSpec,
    send: Callable[[str, Any], None],
    *,
    max_epochs: int,
    max_steps: int = -1,
    callbacks: list[Callback],
) -> pl.Trainer:
    recipe = spec.recipe
    ranks = 1 if spec.strategy == "single" else world.size
    net = build_model(recipe.source)
    rows = recipe.source.rows(recipe.steps_per_epoch * recipe.global_batch)
    changed = _change_frozen(net) if spec.resume_from is not None else []
    send("meta", _meta(spec, world, changed))
    module = _ResumeModule(
        net=net, rows=rows, spec=spec, world=world, micro_batch=recipe.global_batch // ranks, emit=send
    )
    with fit_numerics():
        trainer = make_trainer(
            _strategy_kwargs(spec, world),
            root=spec.directory,
            max_epochs=max_epochs,
            max_steps=max_steps,
            clip=recipe.clip,
            callbacks=callbacks,
        )
        with phase("fit setup"):
            trainer.fit(module, ckpt_path=spec.resume_from)
    return trainer


REHEARSAL_STEPS = 2
"""Steps a rehearsal trains: the first fills the caches, the second the optimizer's state."""

REHEARSED_KINDS: tuple[tuple[str, str], ...] = (
    ("ddp", "32-true"),
    ("ddp", "bf16-mixed"),
    ("fsdp", "32-true"),
    ("fsdp", "bf16-mixed"),
)
"""The strategies and precisions a check's first role rehearses after its own: a session that resumes one
kind usually resumes the others next (the hardware cells run both precisions, the shipped suite every
strategy), and a test whose zygote was forked before its kind was rehearsed starts cold. ``fsdp_file``
shares ``fsdp``'s model, steps and restore copies; only its checkpoint file differs."""

_rehearsed: set[tuple[Any, ...]] = set()


def _rehearse(seat: Seat, spec: RoleSpec, emit: Any = None) -> Iterator[None]:
    """Rehearse the role's fit (:func:`_rehearse_kind`), then, for a check's first role (``fit``), the
    other :data:`REHEARSED_KINDS` at the same rank and world size; yields after each one that ran, so the
    warm process serves a waiting test between them."""
    kinds = [(spec.strategy, spec.precision)]
    if spec.role == "fit":
        kinds += [kind for kind in REHEARSED_KINDS if kind != kinds[0]]
    for strategy, precision in kinds:
        if _rehearse_kind(seat, replace(spec, strategy=strategy, precision=precision)):
            yield


def _rehearse_kind(seat: Seat, spec: RoleSpec) -> bool:
    """Run the role's fit once, on a dry world in this process, as the rank ``seat`` names, so the ranks
    forked from here later start with torch's caches filled, then its restore's copies
    (:func:`_restore_in_memory`); once per rank, world size, strategy, precision and recipe (False: done
    before, or not rehearsed). No checkpoint is written or read and no fault planted. Only the tiny model on
    the CPU: the caches a real model fills are the same, and the dry fit would cost its steps."""
    family = "fsdp" if spec.strategy == "fsdp_file" else spec.strategy
    key = (seat.rank, seat.world_size, family, spec.precision, pickle.dumps(spec.recipe))
    if (
        key in _rehearsed
        or spec.strategy == "single"
        or seat.world_size < 2
        or seat.device != "cpu"
        or spec.recipe.qwen_path is not None
        or spec.recipe.global_batch % seat.world_size
    ):
        return False
    _rehearsed.add(key)
    import tempfile

    from pytest_sprite.subworld.dry_world import rehearsing

    with tempfile.TemporaryDirectory(prefix="sprite-rehearsal-") as directory, rehearsing(seat) as world:
        dry = replace(
            spec,
            directory=directory,
            resume_from=None,
            fault=None,
            max_epochs=None,
            stop_after_restore=False,
            save_every_n_steps=None,
        )
        trainer = _fit(
            world, dry, lambda _name, _value: None, max_epochs=1, max_steps=REHEARSAL_STEPS, callbacks=[]
        )
        _restore_in_memory(trainer)
    _prepare(spec)  # the dry fit took this process's spare model: a spare again for the zygotes forked next
    return True


def _restore_in_memory(trainer: pl.Trainer) -> None:
    """What a restore runs on a sharded model's DTensors, from the model's own state instead of a file, so
    the ranks forked after a rehearsal restore with DTensor's sharding propagation cached too: the state
    dict a sharded checkpoint is read into, copied into the model as Lightning does (a full-state file's
    tensors are split into shards with plain tensor operations and copied in the same way). A model
    without DTensors (DDP, one device) is left alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    model = trainer.strategy.model
    if model is not None and any(isinstance(p, DTensor) for p in model.parameters()):
        model.load_state_dict(get_model_state_dict(model))


run_role.subworld_prepare = _prepare  # type: ignore[attr-defined]
run_role.subworld_rehearse = _rehearse  # type: ignore[attr-defined]


def _meta(spec: RoleSpec, world: World, changed: list[str]) -> dict[str, Any]:
    """What the role is, emitted first: the host side reads every other event against it."""
    return {
        "role": spec.role,
        "strategy": spec.strategy,
        "precision": spec.precision,
        "rank": world.rank,
        "world_size": world.size,
        "global_batch": spec.recipe.global_batch,
        "fault": spec.fault,
        "frozen_changed": changed,
    }


def _checkpoints(spec: RoleSpec, directory: Path) -> list[Callback]:
    """A checkpoint at the end of every epoch, and every ``save_every_n_steps`` steps when asked."""
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=directory,
            filename="{epoch}",
            every_n_epochs=1,
            save_top_k=-1,
            save_on_train_epoch_end=True,
            enable_version_counter=False,
        )
    ]
    if spec.save_every_n_steps is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=directory,
                filename="{epoch}-{step}",
                every_n_train_steps=spec.save_every_n_steps,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    return callbacks
