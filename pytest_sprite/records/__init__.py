"""What the arms of a check leave behind: figures, tensors and digests, the same on every rank.

A record is the unit the assertions judge. It is built inside a ranks test, shared to every rank (so every
rank reaches the same verdict), optionally written under ``--sprite-artifacts`` and read back offline
(:func:`~pytest_sprite.recipes.artifacts.load_arm_record`). Three families, one module each: FP32 parity
(:mod:`.parity`), the BF16 run of criterion v2 (:mod:`.bf16`) and checkpoint resume (:mod:`.resume`); what
they share is in :mod:`.identity`, and one codec (:mod:`._codec`) stores every record from its dataclass
fields. Torch is imported only where tensors are touched.
"""

from __future__ import annotations

from pytest_sprite.errors import SpriteUsageError as SpriteUsageError  # what an inconsistent record raises
from pytest_sprite.records._codec import finite_or_repr
from pytest_sprite.records.bf16_records import (
    BF16_ARMS,
    BF16_SINGLE_DEVICE_ARMS,
    Bf16ArmRecord,
    Bf16StepRecord,
    CommConfig,
    LinearCall,
    RankStep,
)
from pytest_sprite.records.identity import (
    BF16_PRECISION,
    FP32_PRECISION,
    RecipeIdentity,
    tensor_digest,
)
from pytest_sprite.records.parity_records import ARMS, DISTRIBUTED_ARMS, ArmRecord
from pytest_sprite.records.resume_records import ResumeRun, RoleRecord, StateCapture, StepRecord

__all__ = [
    "ARMS",
    "BF16_ARMS",
    "BF16_PRECISION",
    "BF16_SINGLE_DEVICE_ARMS",
    "DISTRIBUTED_ARMS",
    "FP32_PRECISION",
    "ArmRecord",
    "Bf16ArmRecord",
    "Bf16StepRecord",
    "CommConfig",
    "LinearCall",
    "RankStep",
    "RecipeIdentity",
    "ResumeRun",
    "RoleRecord",
    "StateCapture",
    "StepRecord",
    "finite_or_repr",
    "tensor_digest",
]
