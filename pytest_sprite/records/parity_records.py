"""The FP32 parity family: what one arm of a parity run leaves behind (figures, tensors, digests)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.records._codec import RECORD_FORMAT, Stored, finite_or_repr
from pytest_sprite.records.identity import RecipeIdentity

if TYPE_CHECKING:
    import torch

__all__ = ["ARMS", "DISTRIBUTED_ARMS", "ArmRecord"]

ARMS: tuple[str, ...] = ("single", "ddp", "fsdp")
"""Every arm a recipe runs: the one-device reference and the two code-under-test strategies."""
DISTRIBUTED_ARMS: tuple[str, ...] = ("ddp", "fsdp")
"""Arms that must run on more than one device to mean anything."""

_DEFAULT_STRATEGIES = {
    "single": "SingleDeviceStrategy",
    "ddp": "XPUDDPStrategy",
    "fsdp": "FSDP2Strategy",
}
"""Strategy class each arm runs unless the user passes ``strategy=``; other classes are named in labels."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ArmRecord(Stored):
    """One arm's run of the recipe, identical on every rank after the arm returns.

    Per-step lists are indexed ``[step][rank]``. Trainable tensors are full (gathered) CPU tensors
    taken on rank 0; every rank's final trainables are summarized by a digest so replicas that drift
    apart are visible without storing each rank's copy.
    """

    arm: str
    """``single``, ``ddp`` or ``fsdp``."""
    recipe: RecipeIdentity
    """What the arm ran; arms are only compared when these agree."""
    world_size: int
    """Ranks (devices) the arm ran on; 1 for ``single``."""
    device_type: str
    """``cpu``, ``cuda`` or ``xpu``."""
    precision: str
    """Lightning precision flag, e.g. ``32-true``."""
    accumulate: int
    """Micro-batches accumulated per optimizer step."""
    fault: str | None
    """Planted fault (a name from the fault catalogue), None for a clean arm."""
    strategy: str
    """Qualified class name of the Lightning strategy that ran the arm."""
    trainable_names: tuple[str, ...]
    """Names of the trainable tensors, in parameter order."""
    frozen_names: tuple[str, ...]
    """Names of the frozen tensors, in parameter order."""
    pre_clip_norms: tuple[tuple[float, ...], ...]
    """Global gradient norm before clipping, ``[step][rank]``."""
    post_clip_norms: tuple[tuple[float, ...], ...]
    """Global gradient norm after clipping (what the optimizer used), ``[step][rank]``."""
    rows_seen: tuple[tuple[tuple[int, ...], ...], ...]
    """Row ids each rank trained on, ``[step][rank]``, in the order it read them."""
    initial_trainable: Mapping[str, torch.Tensor] = field(repr=False)
    """Full trainable tensors before the first step (rank 0, CPU, FP32 as trained)."""
    final_trainable: Mapping[str, torch.Tensor] = field(repr=False)
    """Full trainable tensors after the last step (rank 0, CPU)."""
    final_trainable_digests: tuple[str, ...]
    """Per rank: one digest over all full final trainables; differing digests mean unsynchronized replicas."""
    frozen_initial: Mapping[str, str] = field(repr=False)
    """Digest of every frozen tensor before the first step (rank 0)."""
    frozen_final: tuple[Mapping[str, str], ...] = field(repr=False)
    """Per rank: digest of every frozen tensor after the last step."""
    wall_s: float = 0.0
    """Wall time of the arm, seconds (fit plus gathering the record)."""
    source: str | None = None
    """Directory the record was written to under ``--sprite-artifacts`` (or read from), None when not stored.

    Not part of the record itself: assertions name it so that ``python -m pytest_sprite judge`` finds their inputs.
    """

    HEADER: ClassVar[Mapping[str, Any]] = {"format": RECORD_FORMAT}

    @classmethod
    def refuse_stored(cls, data: Mapping[str, Any]) -> None:
        """Refuse a record written in another format."""
        if data.get("format") != RECORD_FORMAT:
            raise SpriteUsageError(
                f"arm record format {data.get('format')!r} is not readable here (this version reads "
                f"format {RECORD_FORMAT}); re-run the arm with this version of pytest-sprite"
            )

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.arm not in ARMS:
            problems.append(f"arm={self.arm!r} is not one of {', '.join(ARMS)}")
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be at least 1")
        steps = self.recipe.steps
        for name in ("pre_clip_norms", "post_clip_norms", "rows_seen"):
            per_step = getattr(self, name)
            if len(per_step) != steps:
                problems.append(f"{name} has {len(per_step)} steps, the recipe has {steps}")
            elif any(len(per_rank) != self.world_size for per_rank in per_step):
                problems.append(f"{name} must hold one entry per rank ({self.world_size}) at every step")
        if len(self.final_trainable_digests) != self.world_size:
            problems.append(
                f"final_trainable_digests has {len(self.final_trainable_digests)} ranks, world_size is {self.world_size}"
            )
        if len(self.frozen_final) != self.world_size:
            problems.append(
                f"frozen_final has {len(self.frozen_final)} ranks, world_size is {self.world_size}"
            )
        for name in ("initial_trainable", "final_trainable"):
            if tuple(getattr(self, name)) != self.trainable_names:
                problems.append(f"{name} must hold exactly trainable_names, in order")
        if problems:
            raise SpriteUsageError("inconsistent ArmRecord: " + "; ".join(problems))

    @property
    def label(self) -> str:
        """Arm name with what sets it apart: ``ddp``, ``ddp (accumulate 2)``, ``fsdp (fault missing-rank)``.

        A user's own strategy class is named too (``ddp (MyDDP)``), so several of them stay apart in a table.
        """
        extra = []
        strategy_class = self.strategy.rsplit(".", 1)[-1]
        if strategy_class and strategy_class != _DEFAULT_STRATEGIES.get(self.arm):
            extra.append(strategy_class)
        if self.accumulate != 1:
            extra.append(f"accumulate {self.accumulate}")
        if self.fault is not None:
            extra.append(f"fault {self.fault}")
        return f"{self.arm} ({', '.join(extra)})" if extra else self.arm

    def update_vector(self) -> torch.Tensor:
        """All trainables' whole-run update (final - initial), flattened in name order, float64."""
        import torch

        parts = [
            (self.final_trainable[n].double() - self.initial_trainable[n].double()).reshape(-1)
            for n in self.trainable_names
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def summary(self) -> dict[str, Any]:
        """The figures without tensors: what a JSON report stores next to the tensor file."""
        data = self.to_dict()
        for key in (
            "initial_trainable",
            "final_trainable",
            "frozen_initial",
            "frozen_final",
        ):
            data.pop(key)
        data["pre_clip_norms"] = [[finite_or_repr(x) for x in s] for s in self.pre_clip_norms]
        data["post_clip_norms"] = [[finite_or_repr(x) for x in s] for s in self.post_clip_norms]
        return data
