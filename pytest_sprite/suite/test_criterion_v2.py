"""BF16 parity by criterion v2 at the session's world size, and the eight fault cases it must reject.

The lightning-sprite procedure's BF16 rule: ddp and fsdp against a one-device split reference at step 0
(pre-clip norm, per-tensor gradients, update), gated by split_premul, with invariants on every arm and step
(dtypes under autocast, FP32 communication, replicas bitwise equal, sharded DTensors, rows, clip, frozen).
Each test runs the six arms once, at the whole world (``ranks("world")``: ``--ranks``, whatever it is;
the arms are the expensive part); the fault cases are the lightning-sprite procedure's: both loss-level faults on ddp and fsdp, and the four
DDP-only controls. Select the hardware cells with ``-k``: ``clean``, ``loss`` (the four loss-level cases),
``ddp_only`` (the four DDP-only controls).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Imported at collection, so every forked test child starts with them loaded.
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite import assert_criterion_v2, expect_fault_rejected

ARMS = ("ref32", "ref", "split", "split_premul", "ddp", "fsdp")
CASES = [
    pytest.param("missing-rank", "ddp", id="loss-missing-rank-ddp"),
    pytest.param("missing-rank", "fsdp", id="loss-missing-rank-fsdp"),
    pytest.param("wrong-scale", "ddp", id="loss-wrong-scale-ddp"),
    pytest.param("wrong-scale", "fsdp", id="loss-wrong-scale-fsdp"),
    pytest.param("fp32-backbone", "ddp", id="ddp_only-fp32-backbone"),
    pytest.param("local-adapter", "ddp", id="ddp_only-local-adapter"),
    pytest.param("scale-grad", "ddp", id="ddp_only-scale-grad"),
    pytest.param("skip-update", "ddp", id="ddp_only-skip-update"),
]


def _at_least_two(world: Any) -> None:
    """Criterion v2 compares ddp and fsdp against one device: a world of one has nothing to compare."""
    if world.size < 2:
        pytest.skip(
            "criterion v2 needs at least 2 ranks (ddp and fsdp against one device); run with --ranks=2 or more"
        )


def _arms(lora_qwen: Any, fault: str | None = None, on: str | None = None) -> dict[str, Any]:
    return {a: lora_qwen.run(a, precision="bf16-mixed", fault=fault if a == on else None) for a in ARMS}


@pytest.mark.ranks("world")
def test_criterion_v2_clean(world, lora_qwen) -> None:  # type: ignore[no-untyped-def]
    _at_least_two(world)
    result = assert_criterion_v2(_arms(lora_qwen))
    assert result.verdict == "pass"


@pytest.mark.ranks("world")
@pytest.mark.parametrize(("fault", "arm"), CASES)
def test_criterion_v2_fault(world, lora_qwen, fault: str, arm: str) -> None:  # type: ignore[no-untyped-def]
    _at_least_two(world)
    with expect_fault_rejected(fault):
        assert_criterion_v2(_arms(lora_qwen, fault, arm))
