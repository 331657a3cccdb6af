"""pytest-sprite: distributed-training correctness as ordinary pytest tests.

The public API is this module's ``__all__`` (and ``pytest_sprite.lightning``'s, the code under test); the
subpackages are not a second surface. It is loaded lazily: importing ``pytest_sprite`` imports neither
torch nor the plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CRITERION_CHECKS",
    "FAULTS",
    "PARITY_CHECKS",
    "ArmParity",
    "ArmRecord",
    "ArtifactExistsError",
    "AssertionFailure",
    "Bf16ArmRecord",
    "CrashConsistencyError",
    "CrashMatrix",
    "CriterionError",
    "CriterionRefused",
    "CriterionResult",
    "FailedCheck",
    "Fault",
    "FaultNotRejected",
    "FaultRejection",
    "KillAt",
    "LaunchError",
    "LoraQwen",
    "ParityError",
    "ParityRefused",
    "ParityResult",
    "RankEnvError",
    "Recipe",
    "RecipeIdentity",
    "ResumeError",
    "ResumeResult",
    "SpriteError",
    "SpriteUsageError",
    "SubworldError",
    "SubworldResult",
    "World",
    "assert_crash_consistent",
    "assert_criterion_v2",
    "assert_parity",
    "assert_resume_bitexact",
    "assertion_results",
    "collected",
    "crash_command",
    "crash_fn",
    "crash_hf_trainer",
    "crash_recipe",
    "data_parallel_mesh",
    "emit",
    "expect_fault_rejected",
    "judge_crash_matrix",
    "kill_point",
    "load_arm_record",
    "note_resumed_from",
    "note_save_complete",
    "progress",
    "record_assertion",
    "run_subworld",
    "tensor_digest",
]

_LAZY = {
    "ArmParity": "pytest_sprite.assertions.parity",
    "ArmRecord": "pytest_sprite.records",
    "ArtifactExistsError": "pytest_sprite.recipes.artifacts",
    "AssertionFailure": "pytest_sprite.assertions.evidence",
    "Bf16ArmRecord": "pytest_sprite.records",
    "CRITERION_CHECKS": "pytest_sprite.assertions.criterion_v2",
    "CriterionError": "pytest_sprite.assertions.criterion_v2",
    "CriterionRefused": "pytest_sprite.assertions.criterion_v2",
    "CriterionResult": "pytest_sprite.assertions.criterion_v2",
    "CrashConsistencyError": "pytest_sprite.assertions.crash_consistency",
    "CrashMatrix": "pytest_sprite.assertions.crash_consistency",
    "FAULTS": "pytest_sprite.planted_faults",
    "FailedCheck": "pytest_sprite.assertions.evidence",
    "Fault": "pytest_sprite.planted_faults",
    "FaultNotRejected": "pytest_sprite.assertions.expect_fault",
    "FaultRejection": "pytest_sprite.assertions.expect_fault",
    "KillAt": "pytest_sprite.subworld",
    "LaunchError": "pytest_sprite.errors",
    "LoraQwen": "pytest_sprite.recipes.lora_qwen",
    "PARITY_CHECKS": "pytest_sprite.assertions.parity",
    "ParityError": "pytest_sprite.assertions.parity",
    "ParityRefused": "pytest_sprite.assertions.parity",
    "ParityResult": "pytest_sprite.assertions.parity",
    "RankEnvError": "pytest_sprite.errors",
    "Recipe": "pytest_sprite.recipes.recipe",
    "RecipeIdentity": "pytest_sprite.records",
    "ResumeError": "pytest_sprite.assertions.resume",
    "ResumeResult": "pytest_sprite.assertions.resume",
    "SpriteError": "pytest_sprite.errors",
    "SpriteUsageError": "pytest_sprite.errors",
    "SubworldError": "pytest_sprite.subworld",
    "SubworldResult": "pytest_sprite.subworld",
    "World": "pytest_sprite.world",
    "assert_criterion_v2": "pytest_sprite.assertions.criterion_v2",
    "assert_crash_consistent": "pytest_sprite.assertions.crash_consistency",
    "crash_command": "pytest_sprite.save_crashes.crash_targets",
    "crash_fn": "pytest_sprite.save_crashes.crash_targets",
    "crash_hf_trainer": "pytest_sprite.save_crashes.crash_targets",
    "crash_recipe": "pytest_sprite.save_crashes.crash_targets",
    "emit": "pytest_sprite.subworld",
    "kill_point": "pytest_sprite.subworld",
    "note_resumed_from": "pytest_sprite.save_crashes.inject",
    "note_save_complete": "pytest_sprite.save_crashes.inject",
    "assert_parity": "pytest_sprite.assertions.parity",
    "assertion_results": "pytest_sprite.glue.recorded_results",
    "assert_resume_bitexact": "pytest_sprite.assertions.resume",
    "collected": "pytest_sprite.glue.collected",
    "data_parallel_mesh": "pytest_sprite.recipes.mesh",
    "expect_fault_rejected": "pytest_sprite.assertions.expect_fault",
    "judge_crash_matrix": "pytest_sprite.assertions.crash_consistency",
    "load_arm_record": "pytest_sprite.recipes.artifacts",
    "progress": "pytest_sprite.glue.recorded_results",
    "record_assertion": "pytest_sprite.glue.recorded_results",
    "run_subworld": "pytest_sprite.subworld",
    "tensor_digest": "pytest_sprite.records",
}
"""Where each public name lives; its module is imported on first access."""

if TYPE_CHECKING:
    from .assertions.crash_consistency import (
        CrashConsistencyError,
        CrashMatrix,
        assert_crash_consistent,
        judge_crash_matrix,
    )
    from .assertions.criterion_v2 import (
        CRITERION_CHECKS,
        CriterionError,
        CriterionRefused,
        CriterionResult,
        assert_criterion_v2,
    )
    from .assertions.evidence import AssertionFailure, FailedCheck
    from .assertions.expect_fault import FaultNotRejected, FaultRejection, expect_fault_rejected
    from .assertions.parity import (
        PARITY_CHECKS,
        ArmParity,
        ParityError,
        ParityRefused,
        ParityResult,
        assert_parity,
    )
    from .assertions.resume import ResumeError, ResumeResult, assert_resume_bitexact
    from .errors import LaunchError, RankEnvError, SpriteError, SpriteUsageError
    from .glue.collected import collected
    from .glue.recorded_results import assertion_results, progress, record_assertion
    from .planted_faults import FAULTS, Fault
    from .recipes.artifacts import ArtifactExistsError, load_arm_record
    from .recipes.lora_qwen import LoraQwen
    from .recipes.mesh import data_parallel_mesh
    from .recipes.recipe import Recipe
    from .records import ArmRecord, Bf16ArmRecord, RecipeIdentity, tensor_digest
    from .save_crashes.crash_targets import crash_command, crash_fn, crash_hf_trainer, crash_recipe
    from .save_crashes.inject import note_resumed_from, note_save_complete
    from .subworld import KillAt, SubworldError, SubworldResult, emit, kill_point, run_subworld
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
