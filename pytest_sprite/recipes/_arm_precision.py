"""What an arm's precision changes in the one arm runner (``_arm``), as data, and the record each one builds.

Two families of arms train through the same LightningModule, fit and record path: the FP32 parity arms
(single, ddp, fsdp at ``32-true``) and criterion v2's BF16 arms (ref32, ref, split, split_premul, and ddp/fsdp
at ``bf16-mixed``). What differs is a small :class:`ArmPrecision`: the Lightning precision flag each arm runs
(the dtype policy), whether every step is watched as criterion v2's invariants need (each trainable's whole
gradient and value, the Linear sites' dtypes, the communication configuration), and which record the traces
become. The traces themselves (:class:`StepTrace`, :class:`RankTrace`, :class:`Trace`) are the same for both.

Imports no torch: ``Recipe.run`` reads the descriptions before any fit starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final

from pytest_sprite.records import (
    BF16_PRECISION,
    BF16_SINGLE_DEVICE_ARMS,
    FP32_PRECISION,
    ArmRecord,
    Bf16ArmRecord,
    Bf16StepRecord,
    CommConfig,
    LinearCall,
    RankStep,
    RecipeIdentity,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "BF16_CRITERION",
    "FP32_PARITY",
    "SPLIT_ARMS",
    "ArmPlan",
    "ArmPrecision",
    "ArmSites",
    "RankTrace",
    "StepTrace",
    "Trace",
]

SPLIT_ARMS: Final = ("split", "split_premul")
"""Arms that emulate the N rank shards serially on one device, with manual optimization."""


@dataclass(frozen=True, kw_only=True)
class ArmSites:
    """What the arm runner needs to know about the recipe's model (module and parameter names under it)."""

    linear: Mapping[str, str] = field(default_factory=dict)
    """Every Linear site a watching arm records: module name to ``backbone``, ``lora_A``, ``lora_B``, ``head``."""
    backbone: str = ""
    """Module a planter's ``forward_context`` wraps ("" the whole model; the fp32-backbone fault names it)."""
    adapters: tuple[str, ...] = ()
    """Trainable tensors a planter's ``unsynchronized`` may leave out of gradient sync (local-adapter)."""


@dataclass(kw_only=True)
class StepTrace:
    """One rank at one optimizer step (mutable while the step runs); the watched fields stay empty unless the
    arm's precision watches every step."""

    rows: tuple[tuple[int, ...], ...] = ()
    """Row ids read in the step: one tuple (every micro-batch in order), or one per emulated shard (split arms)."""
    pre: float | None = None
    """Global gradient norm before clipping (None until the gradients are synchronized)."""
    post: float = math.nan
    """Global gradient norm after clipping (what the update used)."""
    grad_dtypes: dict[str, str] = field(default_factory=dict)
    grad_nonfinite: tuple[str, ...] = ()
    grad_digests: dict[str, str] = field(default_factory=dict)
    param_digests: dict[str, str] = field(default_factory=dict)
    frozen_digests: dict[str, str] = field(default_factory=dict)
    param_sharded: dict[str, bool] | None = None
    grad_sharded: dict[str, bool] | None = None
    linear: tuple[LinearCall, ...] = ()

    @property
    def pre_norm(self) -> float:
        """The pre-clip norm as a record holds it (NaN where none was taken)."""
        return math.nan if self.pre is None else float(self.pre)

    def rank_step(self) -> RankStep:
        """This step as criterion v2's record holds it: the two norms, and each watched field under its own name."""
        norms: dict[str, Any] = {"pre_clip_norm": self.pre_norm, "post_clip_norm": float(self.post)}
        watched = {f.name: getattr(self, f.name) for f in fields(RankStep) if f.name not in norms}
        return RankStep(**norms, **watched)


@dataclass(kw_only=True)
class RankTrace:
    """What one rank saw, without whole tensors: every rank's is gathered into the record."""

    steps: list[StepTrace] = field(default_factory=list)
    initial_digests: dict[str, str] = field(default_factory=dict)
    """Digest of every trainable and frozen tensor before the first step."""
    final_digest: str = ""
    """One digest over the whole final trainables, in parameter order."""
    frozen_final: dict[str, str] = field(default_factory=dict)
    """Digest of every frozen tensor after the last step."""
    comm: CommConfig = field(default_factory=lambda: CommConfig(strategy="none"))


@dataclass(kw_only=True)
class Trace:
    """One arm's fit on one rank: its own :class:`RankTrace`, and the names and whole tensors every rank takes
    from rank 0 (the tensors are kept on rank 0 only)."""

    mine: RankTrace = field(default_factory=RankTrace)
    trainable_names: tuple[str, ...] = ()
    frozen_names: tuple[str, ...] = ()
    strategy: str = ""
    tf32: bool = False
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Watched arms: each trainable's whole gradient before clipping, per step."""
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Watched arms: each trainable's whole value after the step's update, per step."""


SHARED_FROM_RANK0: Final = (
    "trainable_names",
    "frozen_names",
    "strategy",
    "tf32",
    "initial",
    "final",
    "grads",
    "params",
)
"""The :class:`Trace` fields every rank takes from rank 0, so that every rank builds the same record."""

RecordBuilder = Callable[["ArmPlan", Trace, list[RankTrace], "ArmSites", Mapping[str, Any]], Any]


@dataclass(frozen=True, kw_only=True)
class ArmPrecision:
    """What an arm's precision changes in the one arm runner: its dtype policy, what it watches, its record."""

    name: str
    """``fp32`` (the FP32 parity check) or ``bf16`` (criterion v2)."""
    fixed_flags: Mapping[str, str]
    """Dtype policy: arms that run one Lightning precision flag whatever was asked (criterion v2's ref32 runs FP32)."""
    flag: str | None
    """Dtype policy: the flag of the other arms; None runs the flag ``run`` was given."""
    watches_steps: bool
    """Whether every step is watched as criterion v2's invariants need: each trainable's whole gradient and value
    (digested on every rank, kept on rank 0), hooks on the recipe's Linear sites, the communication config."""
    record: RecordBuilder
    """``record(plan, trace, per_rank, sites, common)``: the arm's record, from rank 0's trace and every rank's."""

    def lightning_precision(self, arm: str, requested: str) -> str:
        """The Lightning precision flag ``arm`` runs when ``run`` was given ``requested``."""
        return self.fixed_flags.get(arm, self.flag or requested)


@dataclass(frozen=True, kw_only=True)
class ArmPlan:
    """What one arm trains: validated by ``Recipe.run`` before any process starts training."""

    arm: str
    identity: RecipeIdentity
    family: ArmPrecision
    """What the arm's precision changes in the runner."""
    precision: str
    """The Lightning precision flag the arm runs (``family.lightning_precision``)."""
    fault: str | None
    accumulate: int = 1
    shards: int = 1
    """N: the test's world size, which ddp/fsdp run on and the split arms emulate."""


def _parity_record(
    plan: ArmPlan, trace: Trace, per_rank: list[RankTrace], sites: ArmSites, common: Mapping[str, Any]
) -> ArmRecord:
    """The FP32 parity check's record: norms and rows ``[step][rank]``, whole trainables and digests."""
    steps = range(plan.identity.steps)
    return ArmRecord(
        **common,
        accumulate=plan.accumulate,
        pre_clip_norms=tuple(tuple(r.steps[s].pre_norm for r in per_rank) for s in steps),
        post_clip_norms=tuple(tuple(r.steps[s].post for r in per_rank) for s in steps),
        rows_seen=tuple(tuple(r.steps[s].rows[0] for r in per_rank) for s in steps),
        initial_trainable=trace.initial,
        final_trainable=trace.final,
        final_trainable_digests=tuple(r.final_digest for r in per_rank),
        frozen_initial={n: per_rank[0].initial_digests[n] for n in trace.frozen_names},
        frozen_final=tuple(r.frozen_final for r in per_rank),
    )


def _criterion_record(
    plan: ArmPlan, trace: Trace, per_rank: list[RankTrace], sites: ArmSites, common: Mapping[str, Any]
) -> Bf16ArmRecord:
    """Criterion v2's record: every step's rows, rank 0's whole tensors and every rank's observations."""
    one_device = plan.arm in BF16_SINGLE_DEVICE_ARMS
    steps = tuple(
        Bf16StepRecord(
            rows=per_rank[0].steps[s].rows if one_device else tuple(r.steps[s].rows[0] for r in per_rank),
            grads=trace.grads[s],
            params=trace.params[s],
            ranks=tuple(r.steps[s].rank_step() for r in per_rank),
        )
        for s in range(len(per_rank[0].steps))
    )
    return Bf16ArmRecord(
        **common,
        shards=plan.shards,
        tf32=trace.tf32,
        linear_sites=tuple(sites.linear),
        initial_trainable=trace.initial,
        initial_digests=tuple(r.initial_digests for r in per_rank),
        comm=tuple(r.comm for r in per_rank),
        steps=steps,
    )


FP32_PARITY: Final = ArmPrecision(
    name="fp32", fixed_flags={}, flag=None, watches_steps=False, record=_parity_record
)
"""The FP32 parity arms: the flag ``run`` was given, norms and rows per step, whole trainables at both ends."""

BF16_CRITERION: Final = ArmPrecision(
    name="bf16",
    fixed_flags={"ref32": FP32_PRECISION},
    flag=BF16_PRECISION,
    watches_steps=True,
    record=_criterion_record,
)
"""Criterion v2's arms: bf16-mixed (ref32 in FP32), every step watched on every rank."""
