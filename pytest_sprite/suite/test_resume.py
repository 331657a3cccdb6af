"""Checkpoint resume of the repository's strategies, bit for bit, and the faults the check must reject.

The lightning-sprite procedure's "Checkpoints" rule at the session's world size (``--ranks=W``): a fit killed one
step past its epoch-1 checkpoint resumes in new processes and must restore exactly what the save captured
and train the same LRs and rows; FSDP2 also resumes at W/2 ranks, DDP and full-state FSDP2 checkpoints also
load on one device. Three faults planted after the restore must each be rejected (12 cases per precision).
Select a seed cell's precision with ``-k 32-true`` or ``-k bf16-mixed`` (see hpc/*/README.md).
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Imported at collection, so every forked test child (and every sub-world) starts with them loaded.
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite import assert_resume_bitexact, expect_fault_rejected

STRATEGIES = ["single", "ddp", "fsdp", "fsdp_file"]
FAULTS = ["dropped-optimizer-state", "reset-lr-scheduler", "perturbed-weight"]


@pytest.fixture
def at_world_size(world) -> None:  # type: ignore[no-untyped-def]
    """The resume checks run once, at the whole world (``ranks("world")``), which must split in two."""
    if world.size < 2 or world.size % 2:
        pytest.skip(
            f"the resume checks reshard FSDP2 to half the world, so they need an even world of 2 or more "
            f"ranks, not {world.size}; run with --ranks=2, 4, ..."
        )


@pytest.mark.ranks("world")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume(world, lora_qwen, at_world_size, strategy: str, precision: str) -> None:  # type: ignore[no-untyped-def]
    assert_resume_bitexact(lora_qwen, strategy=strategy, precision=precision, reshard=strategy == "fsdp")


@pytest.mark.ranks("world")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_fault_is_rejected(  # type: ignore[no-untyped-def]
    world, lora_qwen, at_world_size, strategy: str, fault: str, precision: str
) -> None:
    with expect_fault_rejected(fault):
        assert_resume_bitexact(lora_qwen, strategy=strategy, precision=precision, fault=fault, export=False)
