"""Checkpoint resume on real ranks: the issue's example tests, the strategy x precision x size matrix, reshard,
export and the twelve planted faults.

Every role is a real Lightning fit of the tiny Qwen2 + LoRA recipe on CPU with gloo, in sub-worlds forked from
the test's ranks. CI runs the unmarked tests (ddp at 2 ranks with one fault, FSDP2 resharded 2 -> 1: about a
minute on 2 shared cores); the full matrix carries ``slow`` (run it with ``--run-slow``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Imported at collection, so every test child, zygote and sub-world rank starts with them loaded.
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite import (
    ResumeError,
    ResumeResult,
    SpriteUsageError,
    assert_resume_bitexact,
    expect_fault_rejected,
)

pytestmark = pytest.mark.cpu

STRATEGIES = ["single", "ddp", "fsdp", "fsdp_file"]
FAULTS = ["dropped-optimizer-state", "reset-lr-scheduler", "perturbed-weight"]
matrix = pytest.mark.slow


# -------------------------------------------------------------------------------------------------------
# CI's representative part


@pytest.mark.ranks(2)
def test_ddp_resume_with_export(world: Any, lora_qwen: Any) -> None:
    result = assert_resume_bitexact(lora_qwen, strategy="ddp", precision="32-true")
    assert isinstance(result, ResumeResult) and result.passed
    assert [a.label for a in result.arms] == ["ddp resume", "ddp reload", "ddp export"]
    assert [g.arm for g in result.gaps] == ["ddp", "ddp_export"]
    assert result.departs.startswith("never")  # same processes layout, same order: bit for bit throughout
    assert result.twin == "reproduces the fit bit for bit"
    assert result.rng.startswith("differ from the uninterrupted fit on ranks 0-1 from step 3")
    assert result.to_dict()["kind"] == "resume"
    assert world.gather_object(result.to_dict()["passed"]) == [True, True]


@pytest.mark.ranks(2)
def test_perturbed_weight_is_rejected(world: Any, lora_qwen: Any) -> None:
    with expect_fault_rejected("perturbed-weight") as rejection:
        assert_resume_bitexact(lora_qwen, strategy="ddp", fault="perturbed-weight", export=False)
    assert rejection.evidence.checks[0] == "trainables"
    assert "ddp resume (fault perturbed-weight)" in rejection.evidence.message


@pytest.mark.ranks(2)
def test_fsdp_reshard_to_half_the_world(world: Any, lora_qwen: Any) -> None:
    result = assert_resume_bitexact(lora_qwen, strategy="fsdp", reshard=True)
    assert result.reshard_ranks == 1
    assert [a.label for a in result.arms] == ["fsdp resume", "fsdp reload", "fsdp reshard 2->1"]
    assert "2 → 1" in result.verdict_table()


@pytest.mark.ranks(2)
def test_bad_arguments_are_refused(world: Any, lora_qwen: Any) -> None:
    with pytest.raises(
        SpriteUsageError, match=r"strategy='deepspeed'\): use one of single, ddp, fsdp, fsdp_file"
    ):
        assert_resume_bitexact(lora_qwen, strategy="deepspeed")
    with pytest.raises(SpriteUsageError, match=r"precision='16-mixed'\): use one of 32-true, bf16-mixed"):
        assert_resume_bitexact(lora_qwen, strategy="ddp", precision="16-mixed")
    with pytest.raises(
        SpriteUsageError, match=r"fault='wrong-scale'\): the faults planted after a restore are"
    ):
        assert_resume_bitexact(lora_qwen, strategy="ddp", fault="wrong-scale")
    with pytest.raises(
        SpriteUsageError, match=r"reshard=True resumes a sharded checkpoint at half the world"
    ):
        assert_resume_bitexact(lora_qwen, strategy="ddp", reshard=True)
    with pytest.raises(SpriteUsageError, match=r"needs the lora_qwen fixture"):
        assert_resume_bitexact(object(), strategy="ddp")


def test_single_runs_in_a_plain_test(lora_qwen: Any) -> None:
    result = assert_resume_bitexact(lora_qwen, strategy="single")
    assert result.ranks == 1 and [a.label for a in result.arms] == ["single resume", "single reload"]


def test_a_distributed_strategy_needs_ranks(lora_qwen: Any) -> None:
    with pytest.raises(SpriteUsageError, match=r"needs the ranks of a test marked @pytest.mark.ranks\(n\)"):
        assert_resume_bitexact(lora_qwen, strategy="ddp")


# -------------------------------------------------------------------------------------------------------
# the matrix: all four strategies at 2 and 4 ranks, FP32 and BF16; reshard 4 -> 2; the twelve faults


@matrix
@pytest.mark.ranks([2, 4])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume(world: Any, lora_qwen: Any, strategy: str, precision: str) -> None:
    result = assert_resume_bitexact(lora_qwen, strategy=strategy, precision=precision)
    assert result.ranks == (1 if strategy == "single" else world.size)
    assert result.global_batch == 2 * world.size
    if world.rank == 0:
        print(result.report())


@matrix
@pytest.mark.ranks(4)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_reshard_4_to_2(world: Any, lora_qwen: Any, precision: str) -> None:
    result = assert_resume_bitexact(lora_qwen, strategy="fsdp", precision=precision, reshard=True)
    assert result.reshard_ranks == 2
    if world.rank == 0:
        print(result.report())


@matrix
@pytest.mark.ranks(2)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fault_is_rejected(world: Any, lora_qwen: Any, strategy: str, fault: str) -> None:
    with expect_fault_rejected(fault) as rejection:
        assert_resume_bitexact(lora_qwen, strategy=strategy, fault=fault, export=False)
    failed = rejection.evidence.failed
    assert {f.arm for f in failed} == {f"{strategy} resume (fault {fault})"}
    assert isinstance(rejection.evidence.result, ResumeResult)


def test_resume_error_is_an_assertion_error() -> None:
    assert issubclass(ResumeError, AssertionError)
