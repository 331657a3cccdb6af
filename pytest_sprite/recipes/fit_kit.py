"""The fit kit: what every Lightning fit of a recipe shares, written once.

The arm runner (``_arm``: FP32 parity and criterion v2's BF16 arms alike), the checkpoint-resume roles
(``resume_fit``) and the crash-matrix target (``pytest_sprite.save_crashes.lora``) all train a recipe's model with a
real Lightning fit. What they share lives here: the numerics set-up (TF32 off, highest-precision FP32
matmuls) and Lightning's silenced banners, the Trainer with the arguments every fit passes (the one place a
``pl.Trainer`` is built), the strided row sharding that replaces Lightning's shuffling sampler, the
trainable and frozen parameters, full-tensor gathers of FSDP2 shards, the global gradient norm, and the
gather-and-share of a rank's trace so that every rank returns rank 0's record.

Imports torch at the top (Lightning only inside the functions that build a Trainer), so it is loaded only
when a fit runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils.data import default_collate

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.recipes.mesh import DATA_PARALLEL

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from pytest_sprite.world import World

__all__ = [
    "ArmRecipe",
    "HookedSGD",
    "IndexedRows",
    "arm_record_fields",
    "check_loss",
    "collate_indexed",
    "data_parallel_part",
    "fit_numerics",
    "frozen",
    "full_many",
    "full_tensor",
    "full_values",
    "gather_shards",
    "lightning_kwargs",
    "make_trainer",
    "node_layout",
    "norm_of",
    "quiet_lightning",
    "shard_batches",
    "share_from_rank0",
    "strategy_name",
    "trainable",
]

T = TypeVar("T")
S = TypeVar("S")


# -------------------------------------------------------------------------------------------------------
# what an arm calls of a recipe


@dataclass(frozen=True, kw_only=True, eq=False)
class ArmRecipe:
    """What an arm calls of a recipe, resolved by ``run_recipe`` (the fits never import the recipe)."""

    name: str
    """The recipe's name, for error messages."""
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    """``loss(model, batch)``: the mean over the batch's rows."""
    shard: Callable[[torch.nn.Module, Any], Any]
    """``shard(model, mesh)``: the FSDP2 units of the fsdp arm."""


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


def data_parallel_part(mesh: Any, *, require: bool = False) -> Any:
    """The mesh a recipe's ``shard`` gets: the ``data_parallel`` dimension of a mesh of several, else the mesh.

    With ``require`` a mesh without a ``data_parallel`` dimension is refused by name (the fsdp parity arm).
    No mesh (a strategy that gives none) stays None.
    """
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    if require and DATA_PARALLEL not in names:
        raise SpriteUsageError(
            f"the fsdp arm shards over the mesh dimension {DATA_PARALLEL!r}, but the strategy's mesh has "
            f"dimensions {names}; give the strategy a mesh with a {DATA_PARALLEL!r} dimension"
        )
    return mesh[DATA_PARALLEL] if len(names) > 1 else mesh


# -------------------------------------------------------------------------------------------------------
# rows


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
    """A recipe's rows as a dataset whose items carry their row id, so a fit records which rows it trained."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self._rows[i]


def collate_indexed(items: list[tuple[int, Any]]) -> tuple[list[int], Any]:
    """Row ids and the batch: ``default_collate`` of the rows, as a recipe's loss receives it."""
    return [i for i, _ in items], default_collate([row for _, row in items])


# -------------------------------------------------------------------------------------------------------
# parameters and the optimizer


def trainable(net: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a fit trains, by name, in parameter order."""
    return [(n, p) for n, p in net.named_parameters() if p.requires_grad]


def frozen(net: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters every fit must leave unchanged, by name, in parameter order."""
    return [(n, p) for n, p in net.named_parameters() if not p.requires_grad]


class HookedSGD(torch.optim.SGD):
    """SGD that asks ``before()`` whether to update (a fault may skip it) and calls ``after()`` once it has.

    ``before`` runs after Lightning's closure (forward, backward, then clipping), so it sees the gradients
    the update uses: post-clip.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        lr: float,
        before: Callable[[], bool],
        after: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(params, lr=lr)
        self._before = before
        self._after = after

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # Lightning's closure: forward, backward, then clipping
        if self._before():
            super().step()
        if self._after is not None:
            self._after()
        return loss


# -------------------------------------------------------------------------------------------------------
# the Trainer


@contextlib.contextmanager
def fit_numerics() -> Iterator[None]:
    """The fit's numerics and quiet: TF32 off and highest-precision FP32 matmuls (the FP32 parity rule), and
    Lightning's per-fit banners and few-workers hint silenced; all restored afterwards."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        with _cudnn_tf32_off(), quiet_lightning():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.set_float32_matmul_precision(precision)


@contextlib.contextmanager
def _cudnn_tf32_off() -> Iterator[None]:
    """cuDNN's TF32 off, restored afterwards; through cuDNN's ``flags()`` where plain assignment is locked.

    torch's own test utilities (``torch.testing._internal.common_utils``, imported by a collected
    ``MultiProcessTestCase`` file) lock plain assignment to the cuDNN flags for the whole process.
    """
    cudnn = torch.backends.cudnn
    before = cudnn.allow_tf32
    try:
        cudnn.allow_tf32 = False
    except RuntimeError:  # "not allowed to set torch.backends.cudnn flags after disable_global_flags"
        with cudnn.flags(
            enabled=cudnn.enabled,
            benchmark=cudnn.benchmark,
            deterministic=cudnn.deterministic,
            allow_tf32=False,
        ):
            yield
        return
    try:
        yield
    finally:
        cudnn.allow_tf32 = before


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-fit banners, its few-workers hint and one upstream deprecation, which say
    nothing about the check."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=PossibleUserWarning)
            # Lightning 2.6.6's utilities/_pytree.py tests isinstance(treespec, LeafSpec), which torch 2.13
            # deprecates: upstream's to change (Lightning-AI/pytorch-lightning), not ours to avoid.
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def lightning_kwargs(kind: str, world: World, precision: str) -> dict[str, Any]:
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
    devices, num_nodes = node_layout(world)
    return trainer_kwargs(
        kind,  # type: ignore[arg-type]
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        accelerator=accelerator,  # type: ignore[arg-type]
    )


def node_layout(world: World) -> tuple[int | list[int], int]:
    """Lightning's ``devices`` and ``num_nodes`` for this rank of the test's world.

    The ranks are launched externally (torchrun's variables): Lightning takes the rank, world size and local
    rank from them and uses devices x num_nodes only to check the world size and to size FSDP2's data-parallel
    mesh (one dimension over every rank), and ``devices[LOCAL_RANK]`` as this rank's device; no node
    structure. A world that fills its nodes evenly is described as it is. One that spans them unevenly (a
    ``ranks(3)`` test on hosts of two ranks: 2 + 1) cannot be, as Lightning's nodes are all alike, so a rank
    whose node's share does not divide the world describes one node of ``world.size`` devices: its own
    node's first, then the node's other devices as spares no rank of this node picks.
    """
    cpu = world.device.type == "cpu"
    if world.size % world.local_size == 0:
        return (world.local_size if cpu else list(world.local_devices)), world.size // world.local_size
    if cpu:
        return world.size, 1
    count = int(getattr(torch, world.device.type).device_count())
    spare = [i for i in range(count) if i not in world.local_devices]
    devices = [*world.local_devices, *spare][: world.size]
    if len(devices) < world.size:
        raise SpriteUsageError(
            f"the test's world of {world.size} ranks spans its nodes unevenly ({world.local_size} on this "
            f"node), which Lightning describes as one node of {world.size} devices, and this node has "
            f"{count} {world.device.type} devices: give the test a multiple of the ranks per node, or run it "
            f"on one node"
        )
    return devices, 1


def make_trainer(
    strategy: Mapping[str, Any],
    *,
    root: str | Path,
    max_epochs: int,
    max_steps: int = -1,
    clip: float | None = None,
    accumulate: int = 1,
    callbacks: Sequence[Callback] = (),
    reload_every_epoch: bool = False,
) -> pl.Trainer:
    """The one Lightning Trainer of the package: ``strategy`` (``lightning_kwargs`` or ``trainer_kwargs``)
    plus what every fit shares.

    The fit shards its own rows (``use_distributed_sampler=False``), logs nothing, shows no progress bar or
    model summary and runs no validation; ``clip`` is a global-norm clip; checkpoints are written only by
    the ``callbacks`` given (a fit without callbacks writes none).
    """
    import lightning.pytorch as pl

    with phase("trainer"):
        trainer = pl.Trainer(
            **strategy,
            max_steps=max_steps,
            max_epochs=max_epochs,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            gradient_clip_algorithm=None if clip is None else "norm",
            reload_dataloaders_every_n_epochs=1 if reload_every_epoch else 0,
            use_distributed_sampler=False,
            logger=False,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=root,
        )
    return trainer


def strategy_name(trainer: pl.Trainer) -> str:
    """The fully qualified class name of the strategy a fit ran with, as records show it."""
    return f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__qualname__}"


# -------------------------------------------------------------------------------------------------------
# whole values of sharded tensors, and norms


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a possibly sharded tensor (a collective for DTensors: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def norm_of(values: list[torch.Tensor]) -> float:
    """The global L2 norm of whole (gathered) tensors, as criterion v2 defines the pre-clip global gradient norm:
    the square root of the sum of every element's square, summed in float64; computed alike on every rank."""
    if not values:
        return 0.0
    total = sum(float(v.detach().to(torch.float64).pow(2).sum()) for v in values)
    return float(total**0.5)


def full_many(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole values of many tensors with one collective instead of one per DTensor, on their device.

    Every rank must call it with the same tensors. DTensors sharded on dim 0 over one 1-D mesh (FSDP2's
    layout) are gathered together as one flat buffer; anything else goes through ``full_tensor`` one by one.
    Each rank's share of a ``Shard(0)`` tensor follows ``torch.chunk`` (DTensor's documented split), so the
    sizes are known without asking the other ranks.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    batched = [
        i
        for i, t in enumerate(tensors)
        if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),)
    ]
    out = [t if i in batched else full_tensor(t) for i, t in enumerate(tensors)]
    if not batched:
        return out
    group = tensors[batched[0]].device_mesh.get_group()  # type: ignore[attr-defined]
    size = dist.get_world_size(group)
    locals_ = [tensors[i].to_local() for i in batched]  # type: ignore[attr-defined]
    all_counts = [[_chunk_numel(tuple(tensors[i].shape), size, r) for i in batched] for r in range(size)]
    dtype = locals_[0].dtype
    if any(t.dtype != dtype for t in locals_):
        return [full_tensor(t) for t in tensors]
    longest = max(sum(c) for c in all_counts)
    flat = torch.zeros(longest, dtype=dtype, device=locals_[0].device)
    joined = torch.cat([t.reshape(-1) for t in locals_])
    flat[: joined.numel()] = joined
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=group)
    offsets = [0] * size
    for k, i in enumerate(batched):
        pieces = []
        for r in range(size):
            n = all_counts[r][k]
            pieces.append(gathered[r][offsets[r] : offsets[r] + n])
            offsets[r] += n
        out[i] = torch.cat(pieces).reshape(tuple(tensors[i].shape))
    return out


def _chunk_numel(shape: tuple[int, ...], size: int, rank: int) -> int:
    """Elements of ``rank``'s share of a tensor of ``shape`` split on dim 0 into ``size`` as ``torch.chunk`` does."""
    rows = shape[0] if shape else 1
    per = math.ceil(rows / size)
    return max(0, min(per, rows - rank * per)) * math.prod(shape[1:])


def full_values(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
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
        gathered = gather_shards([t.to_local() for _, t in sharded], size)
        for (n, t), parts in zip(sharded, gathered, strict=True):
            value = torch.cat(parts, dim=0)
            if tuple(value.shape) != tuple(t.shape):
                fast = False
                break
            out[n] = value
    if not fast:
        for n, t in sharded:
            out[n] = full_tensor(t).to("cpu", copy=True)
    return {n: out[n] for n, _ in named}


def gather_shards(local: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
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
# one record on every rank


def share_from_rank0(world: World, trace: T, *, own: S, shared: Sequence[str]) -> tuple[list[S], T]:
    """Every rank's ``own`` (rank order), and ``trace`` with its ``shared`` fields set to rank 0's.

    Two collectives: a gather of the small per-rank traces, and a broadcast of rank 0's tensors, so every
    rank builds the same record.
    """
    with phase("records"):
        per_rank = world.gather_object(own)
        values = world.broadcast_object(tuple(getattr(trace, name) for name in shared))
    return per_rank, dataclasses.replace(trace, **dict(zip(shared, values, strict=True)))  # type: ignore[type-var]


def arm_record_fields(plan: Any, trace: Any, *, ranks: int, device_type: str) -> dict[str, Any]:
    """What every arm's record says of the arm itself (FP32 and BF16 alike), from its plan and rank 0's trace."""
    return {
        "arm": plan.arm,
        "recipe": plan.identity,
        "world_size": ranks,
        "device_type": device_type,
        "precision": plan.precision,
        "fault": plan.fault,
        "strategy": trace.strategy,
        "trainable_names": trace.trainable_names,
        "frozen_names": trace.frozen_names,
    }
