"""BF16 criterion v2 on real ranks: the six arms at 2, 3 and 4 ranks, and the eight fault cases rejected.

Every arm is a real Lightning fit of the tiny Qwen2 + LoRA recipe on CPU with gloo (BF16 autocast on CPU is
real: the Linear outputs are bfloat16). CI runs the clean criterion and two fault cases at 2 ranks; the rest
of the matrix (3 and 4 ranks, all eight cases) is marked ``slow`` (deselect with ``-m "not slow"``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Imported at collection so the rank agents hold them and every forked test child starts with them loaded.
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite import FAULTS, CriterionResult, assert_criterion_v2, expect_fault_rejected

pytestmark = pytest.mark.cpu

ARMS = ("ref32", "ref", "split", "split_premul", "ddp", "fsdp")
CASES = [
    ("missing-rank", "ddp"),
    ("missing-rank", "fsdp"),
    ("wrong-scale", "ddp"),
    ("wrong-scale", "fsdp"),
    ("fp32-backbone", "ddp"),
    ("local-adapter", "ddp"),
    ("scale-grad", "ddp"),
    ("skip-update", "ddp"),
]
"""The seed's eight arm/fault cases: both loss-level faults on both arms, and the four DDP-only controls."""
CI_CASES = [("wrong-scale", "fsdp"), ("local-adapter", "ddp")]
"""The part of the matrix CI runs at 2 ranks: one scored rejection on FSDP2, one invariant rejection on DDP."""


def run_arms(lora_qwen: Any, fault: str | None = None, on: str | None = None) -> dict[str, Any]:
    return {a: lora_qwen.run(a, precision="bf16-mixed", fault=fault if a == on else None) for a in ARMS}


def check_clean(world: Any, lora_qwen: Any) -> None:
    arms = run_arms(lora_qwen)
    result = assert_criterion_v2(arms)
    n = world.size
    assert result.verdict == "pass" and result.gate.passed and all(i.passed for i in result.invariants)
    assert result.ranks == n and result.global_batch == 2 * n and result.device_type == "cpu"
    # The records are what the seed's table says the arms are.
    assert [arms[a].world_size for a in ARMS] == [1, 1, 1, 1, n, n]
    assert (
        arms["split"].steps[0].rows
        == arms["ddp"].steps[0].rows
        == tuple(tuple(range(r, 2 * n, n)) for r in range(n))
    )
    assert arms["ref"].steps[0].rows == (tuple(range(2 * n)),)
    assert {c.strategy for c in arms["ddp"].comm} == {"ddp"}
    assert {(c.reducer_dtype, c.comm_hook) for c in arms["ddp"].comm} == {("torch.float32", None)}
    assert {(c.strategy, c.param_dtype, c.reduce_dtype) for c in arms["fsdp"].comm} == {("fsdp", None, None)}
    for step in arms["fsdp"].steps:
        assert all(all(r.param_sharded.values()) and all(r.grad_sharded.values()) for r in step.ranks)
    calls = arms["ddp"].steps[0].ranks[n - 1].linear
    assert {(c.output_dtype, c.autocast) for c in calls} == {("torch.bfloat16", True)}
    assert {(c.output_dtype, c.autocast) for c in arms["ref32"].steps[4].ranks[0].linear} == {
        ("torch.float32", False)
    }
    # BF16 differs from FP32 (the diagnostic), and the run is deterministic enough for every scored figure.
    assert max(result.diagnostics.bf16_vs_fp32.max_gap) > 0
    for comparison in (result.gate, *result.scored):
        assert comparison.pre_norm_rel <= 1e-3 and comparison.update_rel_l2 <= 1e-3
    if n in (2, 4):  # power-of-two world: dividing once and premultiplying by 1/N round alike
        assert result.gate.max_gradient_gap == 0


@pytest.mark.ranks(2)
def test_clean_criterion_passes_at_2_ranks(world: Any, lora_qwen: Any) -> None:
    check_clean(world, lora_qwen)


@pytest.mark.slow
@pytest.mark.ranks([3, 4])
def test_clean_criterion_passes(world: Any, lora_qwen: Any) -> None:
    check_clean(world, lora_qwen)


def check_fault(world: Any, lora_qwen: Any, fault: str, arm: str) -> None:
    n = world.size
    with expect_fault_rejected(fault) as rejection:
        assert_criterion_v2(run_arms(lora_qwen, fault, arm))
    result = rejection.evidence.result
    assert isinstance(result, CriterionResult) and result.verdict == "fail"
    expected = FAULTS[fault].checks_for("criterion_v2")
    (row,) = result.rejection_rows()
    assert row["status"] == "rejected" and row["rejecting_evidence"] == list(expected)
    assert row["arm"] == f"{arm} (fault {fault})"
    comparison = next(c for c in result.scored if c.role == arm)
    observations = 5 * n
    if fault == "scale-grad":  # the seed: N times the synchronized gradient; the clip hides it in the update
        assert comparison.pre_norm_rel == pytest.approx(n - 1, rel=1e-4)
        assert comparison.gradients_over == len(comparison.gradients) and comparison.updates_over == 0
    elif (
        fault == "wrong-scale"
    ):  # N times the loss: exactly N times the gradient only when N is a power of two
        assert comparison.pre_norm_rel == pytest.approx(n - 1, rel=1e-2)
        assert comparison.gradients_over == len(comparison.gradients)
        if n & (n - 1) == 0:
            assert comparison.updates_over == 0
    elif fault == "missing-rank":
        assert comparison.gradients_over == len(comparison.gradients)
    elif fault == "fp32-backbone":
        assert row["supporting_observations"].startswith(
            f"dtype: 30/31 invalid Linear sites per rank and step; {observations}/{observations} rank-step"
        )
    elif fault == "local-adapter":
        disagree = 5 * (n - 1)
        assert row["supporting_observations"].startswith(
            f"synchronized: gradient replica disagreements {disagree}/{observations}; parameter disagreements "
            f"{disagree}/{observations} rank-step observations"
        )
    elif fault == "skip-update":
        assert row["supporting_observations"].startswith(
            f"synchronized: gradient replica disagreements 0/{observations}; parameter disagreements "
            f"{n - 1}/{observations} rank-step observations"
        )
        assert comparison.passed  # the scored step-0 checks cannot see it; the replica check does


@pytest.mark.ranks(2)
@pytest.mark.parametrize(("fault", "arm"), CI_CASES, ids=[f"{f}-{a}" for f, a in CI_CASES])
def test_fault_is_rejected_at_2_ranks(world: Any, lora_qwen: Any, fault: str, arm: str) -> None:
    check_fault(world, lora_qwen, fault, arm)


@pytest.mark.slow
@pytest.mark.ranks([2, 3, 4])
@pytest.mark.parametrize(("fault", "arm"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_fault_is_rejected(world: Any, lora_qwen: Any, fault: str, arm: str) -> None:
    check_fault(world, lora_qwen, fault, arm)


@pytest.mark.ranks(2)
def test_a_fault_on_an_arm_the_registry_does_not_list_is_refused(world: Any, lora_qwen: Any) -> None:
    from pytest_sprite import SpriteUsageError

    with pytest.raises(SpriteUsageError, match="fault 'skip-update' applies to arms ddp, not 'fsdp'"):
        lora_qwen.run("fsdp", precision="bf16-mixed", fault="skip-update")
    with pytest.raises(SpriteUsageError, match="fault 'scale-grad' applies to arms ddp, not 'split'"):
        lora_qwen.run("split", precision="bf16-mixed", fault="scale-grad")
    with pytest.raises(SpriteUsageError, match="needs precision='bf16-mixed', the 'ddp' arm runs '32-true'"):
        lora_qwen.run("ddp", fault="fp32-backbone")
