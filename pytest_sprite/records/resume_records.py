"""The checkpoint-resume family: what each role of a resume check leaves behind on one rank."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pytest_sprite.records._codec import RECORD_FORMAT, Stored, check_stored

if TYPE_CHECKING:
    import torch

__all__ = ["ResumeRun", "RoleRecord", "StateCapture", "StepRecord"]


@dataclass(frozen=True, kw_only=True)
class StepRecord(Stored):
    """One optimizer step as one rank of a resume role saw it."""

    step: int
    """Global step index, 0-based: the ``step``-th optimizer step of the whole run."""
    epoch: int
    """Epoch the step belongs to, 0-based."""
    batch: int
    """Batch index within the epoch, 0-based."""
    loss: float
    """This rank's loss of the step (its rows' mean cross-entropy), exactly as computed."""
    lr: float
    """Learning rate the optimizer stepped with."""
    rows: tuple[int, ...]
    """Row ids this rank trained in the step, in the order it read them."""
    pre_clip_norm: float
    """Global gradient norm before clipping."""
    rng: str
    """Digest of the RNG state at the start of the step (torch's CPU generator, plus the device's)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class StateCapture(Stored):
    """The training state of one rank at one moment: inside a checkpoint save, or just after a restore.

    Tensors are full (gathered) CPU values, so captures taken at different world sizes compare directly.
    """

    rank: int
    """Rank that took the capture."""
    world_size: int
    """Ranks of the role that took it."""
    global_step: int
    """Optimizer steps done."""
    epochs_done: int
    """Epochs finished (Lightning's processed epoch count)."""
    trainables: Mapping[str, torch.Tensor] = field(repr=False)
    """Every trainable tensor's full value, by name."""
    optimizer: Mapping[str, Mapping[str, torch.Tensor]] = field(repr=False)
    """Optimizer state per trainable name: ``{"step": ..., "exp_avg": ..., "exp_avg_sq": ...}`` for AdamW."""
    optimizer_devices: Mapping[str, Mapping[str, str]] = field(repr=False)
    """Device of each local optimizer state tensor, per trainable name and state key."""
    param_devices: Mapping[str, str] = field(repr=False)
    """Device of each trainable's local value."""
    param_groups: tuple[Mapping[str, Any], ...] = field(repr=False)
    """Optimizer param groups: every hyperparameter, and ``params`` as trainable names."""
    scheduler: Mapping[str, Any] = field(repr=False)
    """The LR scheduler's ``state_dict()``."""
    frozen: Mapping[str, str] = field(repr=False)
    """Digest of every frozen tensor's full value, by name."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RoleRecord(Stored):
    """Everything one rank of one resume role reported: its steps, its saves and what it restored.

    Built from what the role emitted while it ran, so a role that was killed still has a record of the
    steps and saves it finished before it died.
    """

    role: str
    """``fit``, ``twin``, ``killed``, ``resume``, ``reload``, ``reshard`` or ``export``."""
    strategy: str
    """``single``, ``ddp``, ``fsdp`` or ``fsdp_file``: how this role trained."""
    precision: str
    """Lightning precision flag."""
    rank: int
    """This rank in the role's world."""
    world_size: int
    """Ranks the role ran on."""
    global_batch: int
    """Rows per optimizer step, all ranks together."""
    fault: str | None
    """Fault planted after the restore, None when clean."""
    steps: tuple[StepRecord, ...]
    """Steps this rank finished, in order."""
    saves: tuple[StateCapture, ...]
    """State captured inside each checkpoint save, in order."""
    restored: StateCapture | None
    """State just after the checkpoint restore (and after a planted fault), None for a fresh fit."""
    checkpoints: tuple[str, ...] = ()
    """Checkpoints this role wrote, as paths relative to its directory."""
    killed: bool = False
    """True when the role ended at its kill point instead of finishing."""

    def step(self, index: int) -> StepRecord | None:
        """The record of global step ``index``, None when this role did not train it."""
        for s in self.steps:
            if s.step == index:
                return s
        return None


@dataclass(frozen=True, kw_only=True, eq=False)
class ResumeRun(Stored):
    """Every role of one resume check, rank by rank: what ``assert_resume_bitexact`` judges.

    ``roles[name][rank]`` is that rank's :class:`RoleRecord`. Roles that a configuration does not run
    (``reshard`` outside FSDP2, ``export`` for single and sharded FSDP2) are absent.
    """

    strategy: str
    """``single``, ``ddp``, ``fsdp`` or ``fsdp_file``."""
    precision: str
    """Lightning precision flag of every role."""
    ranks: int
    """Ranks of the fit, its twin, the killed fit, the resume and the reload."""
    global_batch: int
    """Rows per optimizer step, the same in every role."""
    steps_per_epoch: int
    """Optimizer steps per epoch."""
    epochs: int
    """Epochs of the uninterrupted fit."""
    fault: str | None
    """Fault planted in the resume role after its restore, None when clean."""
    roles: Mapping[str, tuple[RoleRecord, ...]] = field(repr=False)
    """Per role, one record per rank."""
    timings: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Per role: (wall seconds, seconds until its processes were started)."""
    device_type: str = "cpu"
    """Device type the roles ran on."""
    directory: str | None = None
    """Directory the roles wrote their checkpoints under (one subdirectory per role), None when unknown."""
    source: str | None = None
    """File the run was stored in (``resume-run.pt``) or read from, None when not stored.

    Not part of the run itself: the assertion names it so that ``python -m pytest_sprite judge`` finds it.
    """

    HEADER: ClassVar[Mapping[str, Any]] = {"format": RECORD_FORMAT, "kind": "resume"}

    @classmethod
    def refuse_stored(cls, data: Mapping[str, Any]) -> None:
        """Refuse a run written in another format, or another kind of record."""
        check_stored(
            data,
            "resume",
            "a resume run",
            "judge it with the pytest-sprite version that wrote it, or re-run the resume check with this one",
        )
