"""pytest-sprite: distributed-training correctness as ordinary pytest tests.

The public API is loaded lazily: importing ``pytest_sprite`` imports neither torch nor the plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "ArmRecord",
    "CrashConsistencyError",
    "CrashMatrix",
    "FaultNotRejected",
    "LaunchError",
    "LoraQwen",
    "ParityError",
    "ParityRefused",
    "ParityResult",
    "RankEnvError",
    "SpriteError",
    "SpriteUsageError",
    "World",
    "assert_crash_consistent",
    "assert_parity",
    "collected",
    "expect_fault_rejected",
    "judge_crash_matrix",
    "load_arm_record",
]

_LAZY = {
    "ArmRecord": "pytest_sprite.records",
    "CrashConsistencyError": "pytest_sprite.assertions.crash_consistency",
    "CrashMatrix": "pytest_sprite.assertions.crash_consistency",
    "FaultNotRejected": "pytest_sprite.assertions.faults",
    "LaunchError": "pytest_sprite.errors",
    "LoraQwen": "pytest_sprite.recipes.lora_qwen",
    "ParityError": "pytest_sprite.assertions.parity",
    "ParityRefused": "pytest_sprite.assertions.parity",
    "ParityResult": "pytest_sprite.assertions.parity",
    "RankEnvError": "pytest_sprite.errors",
    "SpriteError": "pytest_sprite.errors",
    "SpriteUsageError": "pytest_sprite.errors",
    "World": "pytest_sprite.world",
    "assert_crash_consistent": "pytest_sprite.chaos.api",
    "assert_parity": "pytest_sprite.assertions.parity",
    "collected": "pytest_sprite._collected",
    "expect_fault_rejected": "pytest_sprite.assertions.faults",
    "judge_crash_matrix": "pytest_sprite.assertions.crash_consistency",
    "load_arm_record": "pytest_sprite.recipes.artifacts",
}

if TYPE_CHECKING:
    from ._collected import collected
    from .assertions.crash_consistency import CrashConsistencyError, CrashMatrix, judge_crash_matrix
    from .assertions.faults import FaultNotRejected, expect_fault_rejected
    from .assertions.parity import ParityError, ParityRefused, ParityResult, assert_parity
    from .chaos.api import assert_crash_consistent
    from .errors import LaunchError, RankEnvError, SpriteError, SpriteUsageError
    from .recipes.artifacts import load_arm_record
    from .recipes.lora_qwen import LoraQwen
    from .records import ArmRecord
    from .world import World


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_sprite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
