"""Your own model on real ranks (issue 15): a recipe that is not Qwen goes through parity and its negative controls.

A small classifier with a frozen layer (tests/recipes/own_models.py) at 2 and 3 ranks: single, ddp and fsdp agree;
the catalogued loss-level faults and a DDP strategy that divides the summed gradients by 2N are rejected;
accumulation matches the full batch; criterion v2 passes in bf16-mixed and rejects its DDP-only controls;
a ddp fit of it killed after its checkpoint resumes bit for bit.
A body we did not write (Lightning's docs autoencoder) passes too.

Only ranks tests live here (see tests/recipes/test_recipe_ranks.py); the in-process ones are in test_own_model_unit.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("lightning")
# Loaded at collection so forked test children inherit it (see test_parity_ranks.py).
import lightning.pytorch  # noqa: F401
import torch
import torch.distributed as dist
from own_models import AUTOENCODER, MLP
from torch.nn.parallel import DistributedDataParallel

from pytest_sprite import (
    ParityError,
    Recipe,
    SpriteUsageError,
    assert_criterion_v2,
    assert_parity,
    assert_resume_bitexact,
    expect_fault_rejected,
)
from pytest_sprite.lightning import XPUDDPStrategy

pytestmark = pytest.mark.cpu


def check_parity(world: Any) -> None:
    """The issue's example: single, ddp and fsdp of a model with a frozen layer agree."""
    ref = MLP.run("single")
    result = assert_parity(ref, MLP.run("ddp"), MLP.run("fsdp"))
    assert [(a.arm, a.ranks, a.global_batch) for a in result.arms] == [
        ("ddp", world.size, 2 * world.size),
        ("fsdp", world.size, 2 * world.size),
    ]
    # embed.weight and embed.bias are frozen; the body and head train.
    assert ref.frozen_names == ("embed.weight", "embed.bias")
    assert ref.trainable_names == ("body.0.weight", "body.0.bias", "head.weight", "head.bias")
    assert ref.recipe.model.startswith("mlp:") and ref.recipe.seq_len == 0
    assert [a.frozen_total for a in result.arms] == [2, 2]
    # The clip is active, so the post-clip norms say nothing on their own: the pre-clip ones moved.
    assert all(pre > ref.recipe.clip for (pre,) in ref.pre_clip_norms)


@pytest.mark.ranks(2)
def test_own_model_parity_at_2_ranks(world: Any) -> None:
    check_parity(world)


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_own_model_parity_at_3_ranks(world: Any) -> None:
    check_parity(world)


def check_fault(fault: str) -> None:
    ref = MLP.run("single")
    with expect_fault_rejected(fault, by="pre_norm") as rejection:
        assert_parity(ref, MLP.run("ddp", fault=fault), MLP.run("fsdp", fault=fault))
    assert {f.arm for f in rejection.evidence.failed} == {f"ddp (fault {fault})", f"fsdp (fault {fault})"}


@pytest.mark.ranks(2)
@pytest.mark.parametrize("fault", ["missing-rank", "wrong-scale"])
def test_own_model_faults_are_rejected_at_2_ranks(world: Any, fault: str) -> None:
    check_fault(fault)


@pytest.mark.slow
@pytest.mark.ranks(3)
@pytest.mark.parametrize("fault", ["missing-rank", "wrong-scale"])
def test_own_model_faults_are_rejected_at_3_ranks(world: Any, fault: str) -> None:
    check_fault(fault)


def _allreduce_over_2n(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook that sums the gradients over ranks and divides by 2N instead of N.

    Unannotated on purpose: DDP checks the ``bucket`` annotation, and ``from __future__ import annotations``
    would hand it a string instead of ``dist.GradBucket``.
    """
    buffer = bucket.buffer()
    buffer.div_(2 * dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


class HalvedMeanDDP(XPUDDPStrategy):
    """Planted bug: the gradient average divides the sum by 2N, so every step uses half the mean gradient."""

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        ddp = super()._setup_model(model)
        ddp.register_comm_hook(state=None, hook=_allreduce_over_2n)
        return ddp


def check_halved_mean() -> None:
    ref = MLP.run("single")
    with pytest.raises(ParityError) as exc:
        assert_parity(ref, MLP.run("ddp", strategy=HalvedMeanDDP()))
    assert "pre_norm" in {f.check for f in exc.value.failed}
    (arm,) = exc.value.result.arms
    # Half the mean gradient: the pre-clip norm is off by 50 %, not by rounding.
    assert arm.pre_norm_rel == pytest.approx(0.5, rel=1e-3)
    # The control: the same strategy= path with the unmodified strategy passes.
    assert_parity(ref, MLP.run("ddp", strategy=XPUDDPStrategy()))


@pytest.mark.ranks(2)
def test_ddp_dividing_by_2n_is_caught_at_2_ranks(world: Any) -> None:
    check_halved_mean()


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_ddp_dividing_by_2n_is_caught_at_3_ranks(world: Any) -> None:
    check_halved_mean()


@pytest.mark.ranks(2)
def test_own_model_accumulation_matches_the_full_batch(world: Any) -> None:
    ref = MLP.run("single")
    assert_parity(ref, MLP.run("ddp", accumulate=2), MLP.run("fsdp", accumulate=2))
    with expect_fault_rejected("accumulate-sum", by="pre_norm"):
        assert_parity(ref, MLP.run("ddp", accumulate=2, fault="accumulate-sum"))


@pytest.mark.ranks(2)
def test_a_model_body_from_the_lightning_docs(world: Any) -> None:
    """Lightning's docs autoencoder, its loss unchanged, is one more recipe: default sharding, parity."""
    ref = AUTOENCODER.run("single")
    result = assert_parity(ref, AUTOENCODER.run("ddp"), AUTOENCODER.run("fsdp"))
    assert result.passed and ref.frozen_names == ()
    assert ref.trainable_names[0] == "encoder.l1.0.weight"


def _rank_rows(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic in each process, but each rank draws other rows: the bug the cross-rank check catches."""
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    xs, ys = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(xs[i], ys[i]) for i in range(n)]


@pytest.mark.ranks(2)
def test_rows_that_differ_between_ranks_are_refused(world: Any) -> None:
    recipe = Recipe(name="rank-rows", model=MLP.model, rows=_rank_rows, loss=MLP.loss)
    with pytest.raises(SpriteUsageError) as exc:
        recipe.run("ddp")
    assert str(exc.value).startswith("recipe 'rank-rows': rows(20) differs between ranks (digests by rank: ")
    assert str(exc.value).endswith("rows must not depend on the rank or the process")


CRITERION_ARMS = ("ref32", "ref", "split", "split_premul", "ddp", "fsdp")

MLP_WITH_BACKBONE = dataclasses.replace(MLP, name="mlp-backbone", backbone="body")
"""The same model, naming ``body`` as its backbone, so the fp32-backbone control has somewhere to act."""


def criterion_arms(recipe: Recipe, fault: str | None = None) -> dict[str, Any]:
    return {
        a: recipe.run(a, precision="bf16-mixed", fault=fault if a == "ddp" else None) for a in CRITERION_ARMS
    }


def check_criterion(world: Any) -> None:
    arms = criterion_arms(MLP)
    result = assert_criterion_v2(arms)
    assert result.verdict == "pass" and result.ranks == world.size
    # Every nn.Linear is a site, the frozen one included, and under autocast each one gave BF16.
    assert arms["ddp"].linear_sites == ("embed", "body.0", "head")
    calls = arms["ddp"].steps[0].ranks[0].linear
    assert {(c.site, c.output_dtype, c.autocast) for c in calls} == {
        (s, "torch.bfloat16", True) for s in ("embed", "body.0", "head")
    }


@pytest.mark.ranks(2)
def test_own_model_criterion_v2_in_bf16_at_2_ranks(world: Any) -> None:
    check_criterion(world)


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_own_model_criterion_v2_in_bf16_at_3_ranks(world: Any) -> None:
    check_criterion(world)


@pytest.mark.ranks(2)
@pytest.mark.parametrize(
    ("recipe", "fault"),
    [
        pytest.param(MLP, "local-adapter", marks=pytest.mark.slow),
        pytest.param(MLP, "scale-grad", marks=pytest.mark.slow),
        pytest.param(MLP, "skip-update", marks=pytest.mark.slow),
        (MLP_WITH_BACKBONE, "fp32-backbone"),
    ],
    ids=["local-adapter", "scale-grad", "skip-update", "fp32-backbone"],
)
def test_own_model_criterion_controls_are_rejected(world: Any, recipe: Recipe, fault: str) -> None:
    """The DDP-only controls on a plain model: local-adapter leaves its first trainable tensor local."""
    with expect_fault_rejected(fault):
        assert_criterion_v2(criterion_arms(recipe, fault))


@pytest.mark.ranks(2)
def test_fp32_backbone_needs_a_backbone_and_is_refused_by_name(world: Any) -> None:
    with pytest.raises(SpriteUsageError) as exc:
        MLP.run("ddp", precision="bf16-mixed", fault="fp32-backbone")
    assert str(exc.value) == (
        "fault 'fp32-backbone' needs the recipe's backbone module, and recipe 'mlp' names none; "
        "pass Recipe(backbone='<module name>') to plant it"
    )


@pytest.mark.ranks(2)
def test_own_model_resume_is_bit_exact_for_ddp(world: Any) -> None:
    """The resume check on the recipe's own model: killed, resumed in new processes, restored bit for bit."""
    result = assert_resume_bitexact(MLP, strategy="ddp")
    assert result.passed and [a.label for a in result.arms] == ["ddp resume", "ddp reload", "ddp export"]
    assert result.twin == "reproduces the fit bit for bit"


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_own_model_resume_rejects_a_perturbed_weight_and_reshards(world: Any) -> None:
    with expect_fault_rejected("perturbed-weight") as rejection:
        assert_resume_bitexact(MLP, strategy="ddp", fault="perturbed-weight", export=False)
    assert rejection.evidence.checks[0] == "trainables"
    assert assert_resume_bitexact(MLP, strategy="fsdp", reshard=True).reshard_ranks == 1
