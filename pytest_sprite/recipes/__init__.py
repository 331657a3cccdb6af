"""The parity recipe (``lora_qwen``), its arm records and the data-parallel mesh.

Importing this package imports no torch; the model and the Lightning fit load when an arm runs.
"""

from __future__ import annotations

from pytest_sprite.recipes.artifacts import ArtifactDir, ArtifactExistsError, load_arm_record
from pytest_sprite.recipes.lora_qwen import LoraQwen
from pytest_sprite.recipes.mesh import DATA_PARALLEL, data_parallel_mesh
from pytest_sprite.records import ARMS, ArmRecord, RecipeIdentity, tensor_digest

__all__ = [
    "ARMS",
    "DATA_PARALLEL",
    "ArmRecord",
    "ArtifactDir",
    "ArtifactExistsError",
    "LoraQwen",
    "RecipeIdentity",
    "data_parallel_mesh",
    "load_arm_record",
    "tensor_digest",
]
