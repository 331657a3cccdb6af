"""The BF16 family (criterion v2): one record per arm, every step, every rank's observations."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.records._codec import (
    AS_ROWS,
    RECORD_FORMAT,
    Stored,
    check_stored,
    finite_or_repr,
)
from pytest_sprite.records.identity import RecipeIdentity

if TYPE_CHECKING:
    import torch

__all__ = [
    "BF16_ARMS",
    "BF16_SINGLE_DEVICE_ARMS",
    "Bf16ArmRecord",
    "Bf16StepRecord",
    "CommConfig",
    "LinearCall",
    "RankStep",
]

BF16_ARMS: tuple[str, ...] = ("ref32", "ref", "split", "split_premul", "ddp", "fsdp")
"""The six arms of criterion v2's BF16 table, in its order."""
BF16_SINGLE_DEVICE_ARMS: tuple[str, ...] = ("ref32", "ref", "split", "split_premul")
"""Arms that run on one device (the split arms emulate the N rank shards serially)."""


@dataclass(frozen=True, kw_only=True)
class LinearCall(Stored):
    """One Linear site as one forward call saw it: what the dtype invariant checks."""

    site: str
    """Qualified module name, e.g. ``model.layers.0.self_attn.q_proj.base_layer``."""
    kind: str
    """``backbone``, ``lora_A``, ``lora_B`` or ``head`` (the recipe says which)."""
    output_dtype: str
    """dtype of the output, e.g. ``torch.bfloat16``."""
    param_dtype: str
    """dtype of the weight, e.g. ``torch.float32``."""
    autocast: bool
    """Whether autocast was enabled for the device type at the call."""
    autocast_dtype: str | None
    """Autocast dtype at the call when enabled, else None."""
    calls: int = 1
    """Identical calls folded into this entry (one per shard forward on the split arms)."""


@dataclass(frozen=True, kw_only=True)
class CommConfig(Stored):
    """The communication configuration one rank actually ran with (what the FP32 comm invariant checks)."""

    strategy: str
    """``none`` (single device), ``ddp`` or ``fsdp``."""
    reducer_dtype: str | None = None
    """DDP: dtype of the reducer's gradient buckets."""
    comm_hook: str | None = None
    """DDP: the registered communication hook, None when there is none."""
    param_dtype: str | None = None
    """FSDP2: ``MixedPrecisionPolicy.param_dtype`` (None: parameters keep their own dtype)."""
    reduce_dtype: str | None = None
    """FSDP2: ``MixedPrecisionPolicy.reduce_dtype`` (None: gradients reduce in their own dtype)."""


@dataclass(frozen=True, kw_only=True)
class RankStep(Stored):
    """One rank at one step: norms, gradient health, replica digests, frozen digests, Linear sites."""

    pre_clip_norm: float
    """Global gradient norm before clipping, as this rank computed it."""
    post_clip_norm: float
    """Global gradient norm after clipping (what the optimizer used)."""
    grad_dtypes: Mapping[str, str]
    """Trainable name to the dtype of its gradient before clipping; a missing name had no gradient."""
    grad_nonfinite: tuple[str, ...] = ()
    """Trainables whose gradient before clipping holds a NaN or an infinity."""
    grad_digests: Mapping[str, str]
    """Digest of each trainable's full (gathered) gradient before clipping."""
    param_digests: Mapping[str, str]
    """Digest of each trainable's full (gathered) value after this step's update."""
    frozen_digests: Mapping[str, str] = field(repr=False)
    """Digest of every frozen tensor after this step's update."""
    param_sharded: Mapping[str, bool] | None = None
    """FSDP2 only: whether each trainable parameter is a sharded DTensor; None on other arms."""
    grad_sharded: Mapping[str, bool] | None = None
    """FSDP2 only: whether each trainable's gradient is a sharded DTensor; None on other arms."""
    linear: tuple[LinearCall, ...] = field(default=(), repr=False, metadata=AS_ROWS)
    """Every Linear call this rank made in this step's forward passes."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Bf16StepRecord(Stored):
    """One optimizer step of one arm: rows, rank-0 full tensors, and every rank's observations."""

    rows: tuple[tuple[int, ...], ...]
    """Row ids per shard in the order read: per rank (ddp, fsdp), per emulated shard (split arms), or the one
    full global batch (ref32, ref)."""
    grads: Mapping[str, torch.Tensor] = field(repr=False)
    """Each trainable's full gradient before clipping, on rank 0 (the averaged gradient for split arms)."""
    params: Mapping[str, torch.Tensor] = field(repr=False)
    """Each trainable's full value after this step's update, on rank 0."""
    ranks: tuple[RankStep, ...]
    """One entry per rank."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Bf16ArmRecord(Stored):
    """One arm of the BF16 run, per step; identical on every rank after the arm returns."""

    arm: str
    """One of :data:`BF16_ARMS`."""
    recipe: RecipeIdentity
    """What the arm ran; arms of different recipes are refused."""
    world_size: int
    """Devices the arm ran on: 1 for the single-device arms."""
    shards: int
    """N, the rank shards of the global batch: the world size of ddp/fsdp, emulated serially by the split arms."""
    device_type: str
    """``cpu``, ``cuda`` or ``xpu``."""
    precision: str
    """Lightning precision flag: ``32-true`` for ref32, ``bf16-mixed`` for the others."""
    tf32: bool
    """Whether TF32 matmuls were allowed (ref32 requires False)."""
    fault: str | None
    """Planted fault, None for a clean arm."""
    strategy: str
    """Qualified class name of the strategy that ran the arm."""
    trainable_names: tuple[str, ...]
    """Trainable tensors in parameter order."""
    frozen_names: tuple[str, ...]
    """Frozen tensors in parameter order."""
    linear_sites: tuple[str, ...]
    """Every Linear site the recipe's model has (backbone, LoRA A/B, head): each must be seen every step."""
    initial_trainable: Mapping[str, torch.Tensor] = field(repr=False)
    """Full trainables before the first step (rank 0, CPU, FP32)."""
    initial_digests: tuple[Mapping[str, str], ...] = field(repr=False)
    """Per rank: digest of every trainable and frozen tensor before the first step."""
    comm: tuple[CommConfig, ...]
    """Per rank: the communication configuration in effect."""
    steps: tuple[Bf16StepRecord, ...]
    """One entry per optimizer step taken."""
    wall_s: float = 0.0
    """Wall time of the arm, seconds."""
    source: str | None = None
    """Directory the record was written to under ``--sprite-artifacts`` (or read from), None when not stored."""

    HEADER: ClassVar[Mapping[str, Any]] = {"format": RECORD_FORMAT, "kind": "bf16"}

    @classmethod
    def refuse_stored(cls, data: Mapping[str, Any]) -> None:
        """Refuse a record written in another format."""
        check_stored(data, "bf16", "a BF16 arm record", "re-run the arm with this version of pytest-sprite")

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.arm not in BF16_ARMS:
            problems.append(f"arm={self.arm!r} is not one of {', '.join(BF16_ARMS)}")
        if self.world_size < 1 or self.shards < 1:
            problems.append(f"world_size={self.world_size} and shards={self.shards} must be at least 1")
        if len(self.initial_digests) != self.world_size:
            problems.append(
                f"initial_digests has {len(self.initial_digests)} ranks, world_size is {self.world_size}"
            )
        if len(self.comm) != self.world_size:
            problems.append(f"comm has {len(self.comm)} ranks, world_size is {self.world_size}")
        if tuple(self.initial_trainable) != self.trainable_names:
            problems.append("initial_trainable must hold exactly trainable_names, in order")
        for i, step in enumerate(self.steps):
            if len(step.ranks) != self.world_size:
                problems.append(f"step {i} has {len(step.ranks)} ranks, world_size is {self.world_size}")
        if problems:
            raise SpriteUsageError("inconsistent Bf16ArmRecord: " + "; ".join(problems))

    @property
    def label(self) -> str:
        """Arm name with its fault: ``ddp``, ``ddp (fault skip-update)``."""
        return f"{self.arm} (fault {self.fault})" if self.fault is not None else self.arm

    def step_update(self, step: int) -> dict[str, torch.Tensor]:
        """Each trainable's update produced by ``step`` (after - before), float64."""
        before = self.initial_trainable if step == 0 else self.steps[step - 1].params
        after = self.steps[step].params
        return {n: after[n].double() - before[n].double() for n in self.trainable_names}

    def total_update(self) -> dict[str, torch.Tensor]:
        """Each trainable's update over all steps (final - initial), float64."""
        if not self.steps:
            return {n: self.initial_trainable[n].double() * 0 for n in self.trainable_names}
        final = self.steps[-1].params
        return {n: final[n].double() - self.initial_trainable[n].double() for n in self.trainable_names}

    def summary(self) -> dict[str, Any]:
        """JSON-ready metadata and per-step norms, without tensors."""
        return {
            "kind": "bf16",
            "arm": self.arm,
            "label": self.label,
            "world_size": self.world_size,
            "shards": self.shards,
            "device_type": self.device_type,
            "precision": self.precision,
            "tf32": self.tf32,
            "fault": self.fault,
            "strategy": self.strategy,
            "steps": len(self.steps),
            "pre_clip_norms": [[finite_or_repr(r.pre_clip_norm) for r in s.ranks] for s in self.steps],
            "post_clip_norms": [[finite_or_repr(r.post_clip_norm) for r in s.ranks] for s in self.steps],
            "comm": [c.to_dict() for c in self.comm],
            "wall_s": self.wall_s,
        }
