"""FP32 parity on real ranks: the issue's example test at 2, 3 and 4 ranks, planted strategy bugs, accumulation.

Every arm is a real Lightning fit of the tiny Qwen2 + LoRA recipe on CPU with gloo, through the repository's
own strategies (or a user's subclass of them), so these tests fail when the code under test is wrong.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Imported at collection so the rank agents hold them and every forked test child starts with them loaded;
# otherwise each child of each test imports Lightning, transformers and PEFT again (seconds per test).
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import torch
import torch.distributed as dist
import transformers  # noqa: F401
from torch.nn.parallel import DistributedDataParallel

from pytest_sprite import ParityError, assert_parity, expect_fault_rejected
from pytest_sprite.lightning import XPUDDPStrategy

pytestmark = pytest.mark.cpu


@pytest.mark.ranks([2, 3, 4])
def test_lora_parity(world: Any, lora_qwen: Any) -> None:
    ref = lora_qwen.run("single")
    result = assert_parity(ref, lora_qwen.run("ddp"), lora_qwen.run("fsdp"))
    assert [(a.arm, a.ranks, a.global_batch) for a in result.arms] == [
        ("ddp", world.size, 2 * world.size),
        ("fsdp", world.size, 2 * world.size),
    ]
    assert [a.frozen_total for a in result.arms] == [26, 26]
    assert result.arms[1].strategy.endswith("FSDP2Strategy")


def _allreduce_sum(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook that sums gradients over ranks and forgets to divide by the world size.

    Unannotated on purpose: DDP checks the ``bucket`` annotation, and ``from __future__ import annotations``
    would hand it a string instead of ``dist.GradBucket``.
    """
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


class SummedGradientsDDP(XPUDDPStrategy):
    """Planted bug: gradients are summed across ranks instead of averaged."""

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        ddp = super()._setup_model(model)
        ddp.register_comm_hook(state=None, hook=_allreduce_sum)
        return ddp


class OneTensorLocalDDP(XPUDDPStrategy):
    """Planted bug: one LoRA tensor is left out of DDP, so its gradient stays local to each rank."""

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        name = next(n for n, p in model.named_parameters() if p.requires_grad and ".lora_A." in n)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [name])
        return super()._setup_model(model)


class SameRowsDDP(XPUDDPStrategy):
    """Planted bug: the strategy tells the sampler there is one replica, so every rank reads the same rows."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": 1, "rank": 0}


@pytest.mark.ranks(2)
@pytest.mark.parametrize(
    ("strategy", "checks"),
    [
        (SummedGradientsDDP, {"pre_norm"}),
        # The local lora_A gradient barely moves the global norm, which the head's gradient dominates:
        # the replicas check and the update catch it.
        (OneTensorLocalDDP, {"update", "synchronized"}),
        (SameRowsDDP, {"rows", "pre_norm", "update"}),
    ],
    ids=["summed-gradients", "one-tensor-unsynchronized", "same-rows-on-every-rank"],
)
def test_planted_strategy_bug_is_caught(
    lora_qwen: Any, strategy: type[XPUDDPStrategy], checks: set[str]
) -> None:
    ref = lora_qwen.run("single")
    with pytest.raises(ParityError) as exc:
        assert_parity(ref, lora_qwen.run("ddp", strategy=strategy()))
    assert {f.check for f in exc.value.failed} >= checks


@pytest.mark.ranks(2)
def test_user_strategy_without_bug_passes(lora_qwen: Any) -> None:
    """The control for the planted bugs: the same strategy= path with a correct strategy passes."""
    ref = lora_qwen.run("single")
    result = assert_parity(ref, lora_qwen.run("ddp", strategy=XPUDDPStrategy()))
    assert result.arms[0].strategy.endswith("XPUDDPStrategy")


@pytest.mark.ranks(2)
def test_accumulation_matches_the_full_batch(lora_qwen: Any) -> None:
    ref = lora_qwen.run("single")
    assert_parity(ref, lora_qwen.run("ddp", accumulate=2), lora_qwen.run("fsdp", accumulate=2))
    with expect_fault_rejected("accumulate-sum", by="pre_norm") as rejection:
        assert_parity(
            ref,
            lora_qwen.run("ddp", accumulate=2, fault="accumulate-sum"),
            lora_qwen.run("fsdp", accumulate=2, fault="accumulate-sum"),
        )
    assert {f.arm for f in rejection.evidence.failed} == {
        "ddp (accumulate 2, fault accumulate-sum)",
        "fsdp (accumulate 2, fault accumulate-sum)",
    }
