"""FP32 parity of the repository's DDP and FSDP2 strategies against one device, and faults it must reject.

The lightning-sprite parity rule: every distributed arm within 1e-4 (relative) of the single-device
reference on per-step gradient norms before and after clipping and on the whole-run update, with every
frozen weight unchanged; a loss-level fault (a missing rank, summed instead of averaged) must fail it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Imported at collection, so every forked test child starts with them loaded.
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite import assert_parity, expect_fault_rejected

SIZES = [2, 3, 4, 12, 24, 48, "world"]  # "world": --ranks, whatever it is


@pytest.mark.ranks(SIZES)
def test_lora_parity(world, lora_qwen) -> None:  # type: ignore[no-untyped-def]
    ref = lora_qwen.run("single")
    assert_parity(ref, lora_qwen.run("ddp"), lora_qwen.run("fsdp"))


@pytest.mark.ranks(SIZES)
@pytest.mark.parametrize("arm", ["ddp", "fsdp"])
@pytest.mark.parametrize("fault", ["missing-rank", "wrong-scale"])
def test_fault_is_rejected(world, lora_qwen, arm: str, fault: str) -> None:  # type: ignore[no-untyped-def]
    ref = lora_qwen.run("single")
    with expect_fault_rejected(fault):
        assert_parity(ref, lora_qwen.run(arm, fault=fault))
