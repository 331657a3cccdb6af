"""One arm of a recipe through a real Lightning fit, and the record of what it did on every rank.

Loaded only when ``Recipe.run`` (or ``LoraQwen.run``) is called (it imports torch and Lightning at the top). The fit uses the
code-under-test strategies from ``pytest_sprite.lightning.trainer_kwargs`` (or the user's strategy) with
Lightning's automatic optimization, accumulation and clipping, so what is checked is what users run.
Only the data order is taken out of Lightning's hands: Lightning replaces the training sampler with a
shuffling DistributedSampler (the seed's first pitfall), so the arm passes ``use_distributed_sampler=False``
and shards rows itself, strided by the rank and replica count the strategy reports, exactly as an
unshuffled DistributedSampler would. A strategy that reports the wrong ranks therefore shows up in the rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, default_collate

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.faults import Planter, PlantSite, plant
from pytest_sprite.recipes.mesh import DATA_PARALLEL, data_parallel_mesh
from pytest_sprite.records import ArmRecord, RecipeIdentity, tensor_digest
from pytest_sprite.world import World

__all__ = [
    "ArmPlan",
    "ArmRecipe",
    "IndexedRows",
    "check_loss",
    "collate_indexed",
    "run_distributed",
    "run_single",
    "shard_batches",
]


@dataclass(frozen=True, kw_only=True)
class ArmPlan:
    """What one arm trains: validated by ``Recipe.run`` before any process starts training."""

    arm: str
    identity: RecipeIdentity
    precision: str
    accumulate: int
    fault: str | None


@dataclass(frozen=True, kw_only=True, eq=False)
class ArmRecipe:
    """What the arm calls of a recipe, resolved by ``Recipe.run`` (this module never imports the recipe)."""

    name: str
    """The recipe's name, for error messages."""
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    """``loss(model, batch)``: the mean over the batch's rows."""
    shard: Callable[[torch.nn.Module, Any], Any]
    """``shard(model, mesh)``: the FSDP2 units of the fsdp arm."""


@dataclass(kw_only=True)
class _Trace:
    """What one rank saw during its fit (mutable while the fit runs)."""

    pre: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    rows: dict[int, list[int]] = field(default_factory=dict)
    trainable_names: tuple[str, ...] = ()
    frozen_names: tuple[str, ...] = ()
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen_initial: dict[str, str] = field(default_factory=dict)
    frozen_final: dict[str, str] = field(default_factory=dict)
    final_digest: str = ""
    strategy: str = ""


def shard_batches(*, total_rows: int, num_replicas: int, rank: int, micro_batch: int) -> list[list[int]]:
    """This rank's micro-batches: rows ``rank, rank + R, ...`` (unshuffled DistributedSampler), cut in order.

    With ``R`` equal to the world size, step ``s`` of every rank together covers rows ``s*B .. s*B+B-1``.
    """
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise SpriteUsageError(
            f"the strategy reports distributed_sampler_kwargs num_replicas={num_replicas}, rank={rank}; "
            "rank must lie in 0..num_replicas-1"
        )
    shard = list(range(rank, total_rows, num_replicas))
    return [shard[i : i + micro_batch] for i in range(0, len(shard) - micro_batch + 1, micro_batch)]


class IndexedRows(torch.utils.data.Dataset[tuple[int, Any]]):
    """A recipe's rows as a dataset whose items carry their row id, so the arm records which rows it trained."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self._rows[i]


def collate_indexed(items: list[tuple[int, Any]]) -> tuple[list[int], Any]:
    """Row ids and the batch: ``default_collate`` of the rows, as a recipe's loss receives it."""
    return [i for i, _ in items], default_collate([row for _, row in items])


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a possibly sharded tensor (a collective for DTensors: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _global_norm(params: list[torch.nn.Parameter]) -> float:
    """L2 norm over every gradient, in float64; one collective when the gradients are DTensors."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad.detach().to(torch.float64) for p in params if p.grad is not None]
    if not grads:
        return 0.0
    sharded = [isinstance(g, DTensor) for g in grads]
    if all(sharded) or not any(sharded):
        return float(_full(torch.nn.utils.get_total_norm(grads, norm_type=2.0)).cpu())
    total: float = sum(float(_full(g).pow(2).sum()) for g in grads)  # a mix: whole values tensor by tensor
    return float(total**0.5)


class _RecordingSGD(torch.optim.SGD):
    """SGD that records the global gradient norm it steps with, i.e. after the strategy's clipping."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        lr: float,
        on_step: Callable[[], None],
        skip: Callable[[], bool],
    ) -> None:
        super().__init__(params, lr=lr)
        self._on_step = on_step
        self._skip = skip

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # Lightning's closure: forward, backward, then clipping
        self._on_step()
        if not self._skip():  # a planted fault may skip the update (the fault registry's skip_step hook)
            super().step()
        return loss


class _ArmModule(pl.LightningModule):
    """The recipe as a LightningModule that writes what it sees into a :class:`_Trace`."""

    def __init__(
        self,
        *,
        recipe: ArmRecipe,
        net: torch.nn.Module,
        rows: Sequence[Any],
        plan: ArmPlan,
        world_size: int,
        micro_batch: int,
        planter: Planter,
        site: PlantSite,
        shard: bool,
        mesh_factory: Callable[[], Any],
    ) -> None:
        super().__init__()
        self.net = net
        self.trace = _Trace()
        self._recipe = recipe
        self._rows = rows
        self._plan = plan
        self._world_size = world_size
        self._micro_batch = micro_batch
        self._planter = planter
        self._site = site
        self._shard = shard
        self._mesh_factory = mesh_factory

    def _trainables(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.net.named_parameters() if p.requires_grad]

    def _frozen(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.net.named_parameters() if not p.requires_grad]

    def configure_model(self) -> None:
        if not self._shard:
            return
        mesh = self.device_mesh if self.device_mesh is not None else self._mesh_factory()
        names = tuple(mesh.mesh_dim_names or ())
        if DATA_PARALLEL not in names:
            raise SpriteUsageError(
                f"the fsdp arm shards over the mesh dimension {DATA_PARALLEL!r}, but the strategy's mesh has "
                f"dimensions {names}; give the strategy a mesh with a {DATA_PARALLEL!r} dimension"
            )
        self._recipe.shard(self.net, mesh[DATA_PARALLEL] if len(names) > 1 else mesh)

    def train_dataloader(self) -> DataLoader[Any]:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        batches = shard_batches(
            total_rows=len(self._rows),
            num_replicas=int(kwargs.get("num_replicas", 1)),
            rank=int(kwargs.get("rank", 0)),
            micro_batch=self._micro_batch,
        )
        return DataLoader(
            IndexedRows(self._rows), batch_sampler=batches, collate_fn=collate_indexed, num_workers=0
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainables = [p for _, p in self._trainables()]
        return _RecordingSGD(
            trainables,
            lr=self._plan.identity.lr,
            on_step=lambda: self.trace.post.append(_global_norm(trainables)),
            skip=lambda: self._planter.skip_step(
                self.trainer.global_step, self._plan.identity.steps, self._site
            ),
        )

    def on_train_start(self) -> None:
        trainables, frozen = self._trainables(), self._frozen()
        self.trace.trainable_names = tuple(n for n, _ in trainables)
        self.trace.frozen_names = tuple(n for n, _ in frozen)
        self.trace.initial = {n: _full(p.detach()).to("cpu", copy=True) for n, p in trainables}
        self.trace.frozen_initial = {n: tensor_digest(_full(p.detach())) for n, p in frozen}
        self.trace.strategy = (
            f"{type(self.trainer.strategy).__module__}.{type(self.trainer.strategy).__qualname__}"
        )

    def training_step(self, batch: tuple[list[int], Any], batch_idx: int) -> torch.Tensor:
        ids, data = batch
        self.trace.rows.setdefault(self.trainer.global_step, []).extend(int(i) for i in ids)
        with self._planter.forward_context(self._site, self.device.type):
            loss = self._recipe.loss(self.net, data)
        check_loss(self._recipe, loss, len(ids))
        return self._planter.loss(loss, self._site)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls this after backward (gradients synchronized) and before clipping.
        trainables = self._trainables()
        self._planter.gradients(trainables, self._site)
        self.trace.pre.append(_global_norm([p for _, p in trainables]))

    def on_train_end(self) -> None:
        trainables = self._trainables()
        self.trace.final = {n: _full(p.detach()).to("cpu", copy=True) for n, p in trainables}
        self.trace.frozen_final = {n: tensor_digest(_full(p.detach())) for n, p in self._frozen()}
        h = hashlib.sha256()
        for n in self.trace.trainable_names:
            h.update(tensor_digest(self.trace.final[n]).encode())
        self.trace.final_digest = h.hexdigest()


def check_loss(recipe: ArmRecipe, loss: object, rows: int) -> None:
    """Refuse a loss that is not one differentiable number (the mean the arms average over ranks)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else repr(loss)
        )
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: loss(model, batch) returned {shape} for a batch of {rows} rows; it must "
            "return a scalar floating-point tensor, the mean over the batch's rows (e.g. F.cross_entropy(...))"
        )
    if not loss.requires_grad:
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: loss(model, batch) returned a tensor that does not require grad; compute it "
            "from model(...) without torch.no_grad() or .detach()"
        )


@contextlib.contextmanager
def _fp32_numerics() -> Iterator[None]:
    """TF32 off and highest-precision FP32 matmuls for the fit (the seed's rule); restored afterwards."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.set_float32_matmul_precision(precision)


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-fit banners and its few-workers hint, which say nothing about parity."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=PossibleUserWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _lightning_kwargs(kind: str, world: World, precision: str) -> dict[str, Any]:
    """Trainer arguments from the code under test's ``trainer_kwargs`` for this rank's device (xpu, cuda, cpu).

    On an accelerator ``devices`` is the list of this test's devices on the node (``world.local_devices``):
    Lightning gives local rank i ``devices[i]``, which for a packed test is its agents' devices (4 and 5,
    say), not 0 and 1, which a test beside it may be using. On CPU it stays the count of local ranks.
    """
    from pytest_sprite.lightning import trainer_kwargs

    accelerator = world.device.type
    if kind == "single":
        devices: Any = 1 if accelerator == "cpu" else [world.device.index or 0]
        return trainer_kwargs("single", devices=devices, precision=precision, accelerator=accelerator)  # type: ignore[arg-type]
    if world.size % world.local_size:
        raise SpriteUsageError(
            f"the test's world of {world.size} ranks does not split into nodes of {world.local_size} ranks"
        )
    return trainer_kwargs(
        kind,  # type: ignore[arg-type]
        devices=world.local_size if accelerator == "cpu" else list(world.local_devices),
        num_nodes=world.size // world.local_size,
        precision=precision,
        accelerator=accelerator,  # type: ignore[arg-type]
    )


def _fit(
    plan: ArmPlan,
    *,
    kind: str,
    recipe: ArmRecipe,
    model: torch.nn.Module,
    rows: Sequence[Any],
    world: World,
    world_size: int,
    strategy: Any,
) -> _Trace:
    ident = plan.identity
    kwargs = _lightning_kwargs(kind, world, plan.precision)
    if strategy is not None:
        kwargs["strategy"] = strategy
    site = PlantSite(
        arm=plan.arm,
        rank=world.rank,
        world_size=world_size,
        accumulate=plan.accumulate,
        precision=plan.precision,
    )
    module = _ArmModule(
        recipe=recipe,
        net=model,
        rows=rows,
        plan=plan,
        world_size=world_size,
        micro_batch=ident.global_batch // (world_size * plan.accumulate),
        planter=plant(plan.fault, site),
        site=site,
        shard=kind == "fsdp",
        mesh_factory=lambda: data_parallel_mesh(world),
    )
    with tempfile.TemporaryDirectory(prefix="sprite-arm-") as root, _fp32_numerics(), _quiet_lightning():
        trainer = pl.Trainer(
            **kwargs,
            max_steps=ident.steps,
            max_epochs=1,
            accumulate_grad_batches=plan.accumulate,
            gradient_clip_val=ident.clip,
            gradient_clip_algorithm="norm",
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=root,
        )
        trainer.fit(module)
    trace = module.trace
    if (
        len(trace.pre) != ident.steps
        or len(trace.post) != ident.steps
        or sorted(trace.rows) != list(range(ident.steps))
    ):
        raise RuntimeError(
            f"arm {plan.arm!r} on rank {world.rank} trained {len(trace.post)} optimizer steps "
            f"(pre-clip norms for {len(trace.pre)}, rows for steps {sorted(trace.rows)}), the recipe asks for "
            f"{ident.steps}; the strategy skipped or added optimizer steps"
        )
    return trace


def _record(plan: ArmPlan, *, trace: _Trace, per_rank: list[dict[str, Any]], device_type: str) -> ArmRecord:
    steps = plan.identity.steps
    return ArmRecord(
        arm=plan.arm,
        recipe=plan.identity,
        world_size=len(per_rank),
        device_type=device_type,
        precision=plan.precision,
        accumulate=plan.accumulate,
        fault=plan.fault,
        strategy=trace.strategy,
        trainable_names=trace.trainable_names,
        frozen_names=trace.frozen_names,
        pre_clip_norms=tuple(tuple(r["pre"][s] for r in per_rank) for s in range(steps)),
        post_clip_norms=tuple(tuple(r["post"][s] for r in per_rank) for s in range(steps)),
        rows_seen=tuple(tuple(tuple(r["rows"][s]) for r in per_rank) for s in range(steps)),
        initial_trainable=trace.initial,
        final_trainable=trace.final,
        final_trainable_digests=tuple(r["final_digest"] for r in per_rank),
        frozen_initial=trace.frozen_initial,
        frozen_final=tuple(r["frozen_final"] for r in per_rank),
    )


def _summary(trace: _Trace) -> dict[str, Any]:
    return {
        "pre": trace.pre,
        "post": trace.post,
        "rows": trace.rows,
        "final_digest": trace.final_digest,
        "frozen_final": trace.frozen_final,
    }


def run_single(
    plan: ArmPlan,
    *,
    recipe: ArmRecipe,
    model: torch.nn.Module,
    rows: Sequence[Any],
    world: World,
    strategy: Any = None,
) -> ArmRecord:
    """The reference: the full global batch on this rank's one device, no collectives."""
    trace = _fit(
        plan,
        kind="single",
        recipe=recipe,
        model=model,
        rows=rows,
        world=world,
        world_size=1,
        strategy=strategy,
    )
    return _record(plan, trace=trace, per_rank=[_summary(trace)], device_type=world.device.type)


def run_distributed(
    plan: ArmPlan,
    *,
    recipe: ArmRecipe,
    model: torch.nn.Module,
    rows: Sequence[Any],
    world: World,
    strategy: Any = None,
) -> ArmRecord:
    """A ddp or fsdp arm on every rank of the test; every rank returns the same record (rank 0's tensors)."""
    trace = _fit(
        plan,
        kind=plan.arm,
        recipe=recipe,
        model=model,
        rows=rows,
        world=world,
        world_size=world.size,
        strategy=strategy,
    )
    per_rank = world.gather_object(_summary(trace))
    tensors = world.broadcast_object(
        (
            trace.trainable_names,
            trace.frozen_names,
            trace.initial,
            trace.final,
            trace.frozen_initial,
            trace.strategy,
        )
    )
    shared = _Trace(
        trainable_names=tensors[0],
        frozen_names=tensors[1],
        initial=tensors[2],
        final=tensors[3],
        frozen_initial=tensors[4],
        strategy=tensors[5],
    )
    return _record(plan, trace=shared, per_rank=per_rank, device_type=world.device.type)
