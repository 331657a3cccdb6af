"""The issue's negative-control test on real ranks: planted loss-level faults must be rejected, by pre_norm."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Loaded at collection so forked test children inherit them (see test_parity_ranks.py).
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite import assert_parity, expect_fault_rejected

pytestmark = pytest.mark.cpu


@pytest.mark.ranks([2, 3, 4])
@pytest.mark.parametrize("fault", ["missing-rank", "wrong-scale"])
def test_fault_is_caught(world: Any, lora_qwen: Any, fault: str) -> None:
    ref = lora_qwen.run("single")
    with expect_fault_rejected(fault, by="pre_norm") as rejection:
        assert_parity(ref, lora_qwen.run("ddp", fault=fault), lora_qwen.run("fsdp", fault=fault))
    figures = {a.arm: a for a in rejection.evidence.result.arms}
    assert set(figures) == {"ddp", "fsdp"} and not any(a.passed for a in figures.values())
    if fault == "wrong-scale":
        # Summed instead of averaged: every pre-clip norm is N times the reference's (the seed's "3" at N=4).
        assert figures["ddp"].pre_norm_rel == pytest.approx(world.size - 1, rel=1e-3)
        # Clipping rescales every step to the clip, so the update barely moves (the seed's note).
        assert figures["ddp"].post_norm_rel < 1e-4
