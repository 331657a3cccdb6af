"""The checkpoint-resume roles: one Lightning fit each, run in a sub-world's fresh processes.

The lightning-sprite seed's "Checkpoints" recipe: the LoRA classifier of ``lora_qwen`` trained with AdamW,
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

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from pytest_sprite import subworld
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.faults import FAULTS, PlantSite, plant
from pytest_sprite.recipes._arm import (
    IndexedRows,
    _fp32_numerics,
    _full,
    _global_norm,
    _lightning_kwargs,
    _quiet_lightning,
    collate_indexed,
)
from pytest_sprite.recipes._model import fresh_lora_qwen, make_rows
from pytest_sprite.recipes._shard import default_shard
from pytest_sprite.recipes.mesh import DATA_PARALLEL, data_parallel_mesh
from pytest_sprite.records import RoleRecord, StateCapture, StepRecord, tensor_digest
from pytest_sprite.world import World

__all__ = [
    "FROZEN_CHANGED",
    "ROLES",
    "STRATEGIES",
    "ResumeRecipe",
    "RoleSpec",
    "capture_state",
    "records_from_events",
    "run_role",
]

STRATEGIES: tuple[str, ...] = ("single", "ddp", "fsdp", "fsdp_file")
"""How a role trains: one device, XPUDDPStrategy, FSDP2Strategy sharded (torch.distributed.checkpoint
directories) and FSDP2Strategy with ``save_distributed_checkpoint=False`` (one full-state file)."""
ROLES: tuple[str, ...] = ("fit", "twin", "killed", "resume", "reload", "reshard", "export")
"""Every role of a resume check."""
RESUME_FAULTS: tuple[str, ...] = tuple(name for name, f in FAULTS.items() if "resume" in f.arms)
"""Faults a resume role plants right after its restore (the registry's entries for the ``resume`` arm)."""
FROZEN_CHANGED = 4
"""Frozen tensors changed before every load: only the checkpoint can put them back."""


@dataclass(frozen=True, kw_only=True)
class ResumeRecipe:
    """The training recipe every role of one check shares (picklable: it travels to the role's processes)."""

    seed: int = 0
    """Seed of the model's weights and of the rows."""
    qwen_path: str | None = None
    """Real Qwen2 weights, or None for the tiny in-memory model."""
    seq_len: int = 8
    """Tokens per row."""
    lr: float = 1e-2
    """AdamW's base learning rate."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    end_factor: float = 0.1
    """The per-step schedule: LinearLR from lr down to lr x end_factor over the whole run."""
    clip: float = 0.01
    """Global gradient-norm clip (active at every step of the tiny model)."""
    epochs: int = 2
    """Epochs of the uninterrupted fit."""
    steps_per_epoch: int = 3
    """Optimizer steps per epoch."""
    global_batch: int = 8
    """Rows per optimizer step, all ranks together."""
    source: Any = None
    """A project's :class:`~pytest_sprite.Recipe` whose model, rows, loss and sharding the roles train
    (picklable: top-level callables); None for lora_qwen's LoRA classifier (``seed``, ``qwen_path``, ``seq_len``)."""

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the uninterrupted fit."""
        return self.epochs * self.steps_per_epoch


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """One role: how it trains, where it writes, what it loads and which fault it plants."""

    role: str
    """A name from :data:`ROLES`."""
    strategy: str
    """A name from :data:`STRATEGIES`."""
    precision: str
    """Lightning precision flag: ``32-true`` or ``bf16-mixed``."""
    recipe: ResumeRecipe
    """The shared training recipe."""
    directory: str
    """Where this role writes its checkpoints (shared by its ranks)."""
    resume_from: str | None = None
    """Checkpoint to load before training, None for a fresh fit."""
    fault: str | None = None
    """Fault planted right after the restore."""
    max_epochs: int | None = None
    """Epochs to train up to; default the recipe's."""
    stop_after_restore: bool = False
    """End the fit right after the restore (the reload role)."""
    save_every_n_steps: int | None = None
    """Also save every n optimizer steps (a mid-epoch checkpoint); None saves at epoch ends only."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SpriteUsageError(f"unknown resume role {self.role!r}; roles: {', '.join(ROLES)}")
        if self.strategy not in STRATEGIES:
            raise SpriteUsageError(
                f"unknown resume strategy {self.strategy!r}; strategies: {', '.join(STRATEGIES)}"
            )
        if self.fault is not None and self.fault not in RESUME_FAULTS:
            raise SpriteUsageError(
                f"fault {self.fault!r} is not planted by a resume role; resume faults: {', '.join(RESUME_FAULTS)}"
            )
        if self.fault is not None and self.resume_from is None:
            raise SpriteUsageError(f"fault {self.fault!r} is planted after a restore; give resume_from=")


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
# state capture


def _rng_digest(device: torch.device) -> str:
    h = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes())
    if device.type == "cuda":
        h.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    elif device.type == "xpu":
        h.update(torch.xpu.get_rng_state(device).numpy().tobytes())
    return h.hexdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _names(net: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in net.named_parameters()}


def capture_state(trainer: pl.Trainer, net: torch.nn.Module, *, rank: int, world_size: int) -> StateCapture:
    """The training state on this rank now: full trainables and optimizer state, groups, scheduler, frozen.

    A collective under FSDP2 (full values are gathered): every rank must call it at the same point.
    """
    optimizer = trainer.optimizers[0]
    names = _names(net)
    trainables = {n: p for n, p in net.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in net.named_parameters() if not p.requires_grad}
    state_by_name = {names[id(p)]: s for p, s in optimizer.state.items() if id(p) in names}
    wanted: list[tuple[str, torch.Tensor]] = [(f"param:{n}", p.detach()) for n, p in trainables.items()]
    wanted += [(f"frozen:{n}", p.detach()) for n, p in frozen.items()]
    opt_devices: dict[str, dict[str, str]] = {}
    opt_keys: dict[str, tuple[str, str]] = {}
    for name in trainables:
        state = {k: v for k, v in sorted(state_by_name.get(name, {}).items()) if torch.is_tensor(v)}
        for k, v in state.items():
            opt_keys[f"opt:{name}:{k}"] = (name, k)
            wanted.append((f"opt:{name}:{k}", v.detach()))
        opt_devices[name] = {k: str(_local(v).device) for k, v in state.items()}
    full = _full_values(wanted)  # every rank, the same order: one collective under FSDP2
    opt_full: dict[str, dict[str, torch.Tensor]] = {name: {} for name in trainables}
    for key, (name, state_key) in opt_keys.items():
        opt_full[name][state_key] = full[key]
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names.get(id(p), "?") for p in group["params"]],
            }
        )
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    return StateCapture(
        rank=rank,
        world_size=world_size,
        global_step=int(trainer.global_step),
        epochs_done=int(getattr(trainer.fit_loop.epoch_progress.current, "processed", 0)),
        trainables={n: full[f"param:{n}"] for n in trainables},
        optimizer=opt_full,
        optimizer_devices=opt_devices,
        param_devices={n: str(_local(p).device) for n, p in trainables.items()},
        param_groups=tuple(groups),
        scheduler=dict(scheduler.state_dict()),
        frozen={n: tensor_digest(full[f"frozen:{n}"]) for n in frozen},
    )


def _full_values(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full CPU values of possibly sharded tensors, with one collective for all of them.

    FSDP2 shards every tensor along dim 0 over a 1-D mesh of every rank: the full value is the ranks'
    local shards concatenated in rank order. Gathering them all at once costs one collective instead of one
    per tensor (about 80 per capture here); any other layout falls back to ``full_tensor`` tensor by tensor.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    out = {n: t.to("cpu", copy=True) for n, t in named if not isinstance(t, DTensor)}
    sharded = [(n, t) for n, t in named if isinstance(t, DTensor)]
    if not sharded:
        return {n: out[n] for n, _ in named}
    size = dist.get_world_size() if dist.is_initialized() else 1
    fast = all(
        t.device_mesh.ndim == 1 and t.device_mesh.size() == size and tuple(t.placements) == (Shard(0),)
        for _, t in sharded
    )
    if fast:
        gathered = _gather_shards([t.to_local() for _, t in sharded], size)
        for (n, t), parts in zip(sharded, gathered, strict=True):
            value = torch.cat(parts, dim=0)
            if tuple(value.shape) != tuple(t.shape):
                fast = False
                break
            out[n] = value
    if not fast:
        for n, t in sharded:
            out[n] = _full(t).to("cpu", copy=True)
    return {n: out[n] for n, _ in named}


def _gather_shards(local: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """Every rank's ``local`` tensors, as CPU copies: ``result[k][r]`` is rank r's k-th tensor.

    Two tensor collectives, whatever the number of tensors: the byte length of each, then all of them as one
    padded byte buffer. Bytes, not values, so every dtype travels bit for bit in one buffer;
    ``all_gather_object`` would pickle every tensor on every rank (0.6 s per FSDP2 capture at 4 ranks here).
    """
    import torch.distributed as dist

    device = local[0].device
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in local]
    lengths = torch.tensor([f.numel() for f in flat], dtype=torch.int64, device=device)
    all_lengths = [torch.empty_like(lengths) for _ in range(size)]
    dist.all_gather(all_lengths, lengths)
    table = torch.stack(all_lengths).cpu().tolist()
    longest = max(sum(row) for row in table)
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine = torch.cat(flat)
    buffer[: mine.numel()] = mine
    buffers = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(buffers, buffer)
    result: list[list[torch.Tensor]] = [[] for _ in local]
    for row, data in zip(table, buffers, strict=True):
        data = data.cpu()
        offset = 0
        for k, (length, t) in enumerate(zip(row, local, strict=True)):
            # a copy starts at offset 0, so any dtype can view it whatever came before it in the buffer
            part = data[offset : offset + length].clone().view(t.dtype)
            tail = tuple(t.shape[1:])
            result[k].append(part.reshape(part.numel() // max(1, math.prod(tail)), *tail))
            offset += length
    return result


# -------------------------------------------------------------------------------------------------------
# the LightningModule


@dataclass(kw_only=True)
class _Pending:
    epoch: int = 0
    batch: int = 0
    loss: float = float("nan")
    rows: tuple[int, ...] = ()
    rng: str = ""
    lr: float = float("nan")
    pre: float = float("nan")
    done: list[StepRecord] = field(default_factory=list)


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
        self._loss: Callable[[torch.nn.Module, Any], torch.Tensor] = (
            source.loss if source is not None else _lora_loss
        )
        self._shard: Callable[[torch.nn.Module, Any], Any] = (
            (source.shard or default_shard) if source is not None else default_shard
        )
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
        names = tuple(mesh.mesh_dim_names or ())
        # lora_qwen declares _no_split_modules, so default_shard is shard_model there.
        self._shard(self.net, mesh[DATA_PARALLEL] if len(names) > 1 else mesh)

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
        p.rng = _rng_digest(self._world.device)
        p.epoch, p.batch = int(self.trainer.current_epoch), int(batch_idx)
        p.rows = tuple(int(i) for i in ids)
        loss = self._loss(self.net, data)
        p.loss = float(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._pending.pre = _global_norm(self._trainables())
        self._pending.lr = float(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        p = self._pending
        step = int(self.trainer.global_step)
        record = StepRecord(
            step=step - 1,
            epoch=p.epoch,
            batch=p.batch,
            loss=p.loss,
            lr=p.lr,
            rows=p.rows,
            pre_clip_norm=p.pre,
            rng=p.rng,
        )
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
    kwargs = _lightning_kwargs(kind, world, spec.precision)
    if spec.strategy == "fsdp_file":
        from pytest_sprite.lightning import FSDP2Strategy

        kwargs["strategy"] = FSDP2Strategy(save_distributed_checkpoint=False)
    return kwargs


def _lora_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """lora_qwen's loss: mean cross-entropy of the logits taken in FP32."""
    return F.cross_entropy(model(batch["input_ids"]).float(), batch["labels"])


def _fresh_model(recipe: ResumeRecipe) -> torch.nn.Module:
    """A fresh copy of the recipe's model, built once per process (and once per zygote, see prepare).

    A project's recipe builds its model after ``torch.manual_seed(seed)`` on every call, as its arms do.
    """
    if recipe.source is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            net: torch.nn.Module = recipe.source.model()
        net.train()
        return net
    return fresh_lora_qwen(seed=recipe.seed, qwen_path=recipe.qwen_path)


def _vocab(net: torch.nn.Module) -> int:
    return int(net.vocab_size)  # type: ignore[arg-type]


def _prepare(spec: RoleSpec, emit: Any = None) -> None:
    """Build the model and import what a fit imports late, once, in the process the role's ranks are
    forked from (CPU only)."""
    from pytest_sprite._process import prewarm_fit

    prewarm_fit()
    _fresh_model(spec.recipe)


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
    net = _fresh_model(recipe)
    n_rows = recipe.steps_per_epoch * recipe.global_batch
    rows: Sequence[Any]
    if recipe.source is not None:
        rows = recipe.source.rows(n_rows)
    else:
        lora = make_rows(seed=recipe.seed, rows=n_rows, seq_len=recipe.seq_len, vocab_size=_vocab(net))
        rows = [{"input_ids": lora.input_ids[i], "labels": lora.labels[i]} for i in range(n_rows)]
    changed = _change_frozen(net) if spec.resume_from is not None else []
    send(
        "meta",
        {
            "role": spec.role,
            "strategy": spec.strategy,
            "precision": spec.precision,
            "rank": world.rank,
            "world_size": world.size,
            "global_batch": recipe.global_batch,
            "fault": spec.fault,
            "frozen_changed": changed,
        },
    )
    module = _ResumeModule(
        net=net, rows=rows, spec=spec, world=world, micro_batch=recipe.global_batch // ranks, emit=send
    )
    directory = Path(spec.directory)
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
    with _fp32_numerics(), _quiet_lightning():
        trainer = pl.Trainer(
            **_strategy_kwargs(spec, world),
            max_epochs=spec.max_epochs if spec.max_epochs is not None else recipe.epochs,
            gradient_clip_val=recipe.clip,
            gradient_clip_algorithm="norm",
            use_distributed_sampler=False,
            logger=False,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=directory,
        )
        trainer.fit(module, ckpt_path=spec.resume_from)
    written = sorted(p.name for p in directory.glob("*.ckpt")) if directory.is_dir() else []
    return {"strategy_class": type(trainer.strategy).__name__, "checkpoints": written}


run_role.subworld_prepare = _prepare  # type: ignore[attr-defined]


def records_from_events(
    events: list[tuple[str, Any]], *, killed: bool, checkpoints: tuple[str, ...] = ()
) -> RoleRecord:
    """Rebuild one rank's :class:`RoleRecord` from what its role emitted (works for a killed role too)."""
    meta: dict[str, Any] | None = None
    steps: list[StepRecord] = []
    saves: list[StateCapture] = []
    restored: StateCapture | None = None
    for name, value in events:
        if name == "meta":
            meta = value
        elif name == "step":
            steps.append(value)
        elif name == "save":
            saves.append(value)
        elif name == "restored":
            restored = value
    if meta is None:
        raise RuntimeError(
            "the role ended before it said what it was (no 'meta' event): it failed at start-up"
        )
    return RoleRecord(
        role=meta["role"],
        strategy=meta["strategy"],
        precision=meta["precision"],
        rank=meta["rank"],
        world_size=meta["world_size"],
        global_batch=meta["global_batch"],
        fault=meta["fault"],
        steps=tuple(steps),
        saves=tuple(saves),
        restored=restored,
        checkpoints=checkpoints,
        killed=killed,
    )
