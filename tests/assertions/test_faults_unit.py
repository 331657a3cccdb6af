"""expect_fault_rejected and the fault registry, on hand-made assertion failures (no processes, no torch)."""

from __future__ import annotations

import pytest

from pytest_sprite import (
    CRITERION_CHECKS,
    FAULTS,
    PARITY_CHECKS,
    AssertionFailure,
    FailedCheck,
    FaultNotRejected,
    FaultRejection,
    SpriteUsageError,
    expect_fault_rejected,
)
from pytest_sprite.assertions.resume import RESUME_CHECKS
from pytest_sprite.planted_faults import CLEAN, Planter, PlantSite, get_fault, plant

pytestmark = pytest.mark.cpu

KNOWN = (
    "missing-rank, wrong-scale, accumulate-sum, fp32-backbone, local-adapter, scale-grad, skip-update, "
    "dropped-optimizer-state, reset-lr-scheduler, perturbed-weight, unrestored-rng"
)
RESERVED: tuple[str, ...] = ()  # every fault of the seed is planted now (criterion and resume merged)


def failure(*checks: tuple[str, str, str | None]) -> AssertionFailure:
    """An assertion failure whose failed checks are (arm, check, fault) triples."""
    failed = tuple(FailedCheck(arm=a, check=c, fault=f, detail=f"{c} detail") for a, c, f in checks)
    return AssertionFailure("TABLE", failed=failed, result={"figures": 1})


def test_rejected_when_only_faulted_arms_fail() -> None:
    exc = failure(
        ("ddp (fault missing-rank)", "pre_norm", "missing-rank"),
        ("ddp (fault missing-rank)", "update", "missing-rank"),
        ("fsdp (fault missing-rank)", "pre_norm", "missing-rank"),
    )
    with expect_fault_rejected("missing-rank") as rejection:
        raise exc
    evidence = rejection.evidence
    assert isinstance(evidence, FaultRejection)
    assert evidence.checks == ("pre_norm", "update")
    assert len(evidence.failed) == 3
    assert evidence.message == "TABLE"
    assert evidence.result == {"figures": 1}
    assert evidence.to_dict()["status"] == "rejected"


def test_block_that_passes_fails_the_test() -> None:
    with pytest.raises(FaultNotRejected) as exc:
        with expect_fault_rejected("wrong-scale"):
            pass
    assert str(exc.value) == (
        "fault 'wrong-scale' was not rejected: the block passed. The assertion did not notice that every "
        "rank's loss is multiplied by N (the world size), so gradients are summed, not averaged."
    )
    assert isinstance(exc.value, AssertionError)


def test_other_exceptions_propagate_unchanged() -> None:
    with pytest.raises(KeyError, match="boom"):
        with expect_fault_rejected("missing-rank"):
            raise KeyError("boom")


def test_plain_assertion_error_is_not_attributable() -> None:
    with pytest.raises(FaultNotRejected) as exc:
        with expect_fault_rejected("missing-rank"):
            raise AssertionError("x == y")
    assert str(exc.value) == (
        "fault 'missing-rank': the block raised an AssertionError that carries no sprite evidence, so the "
        "failure cannot be attributed to the fault; put only a sprite assertion in the block. It raised: x == y"
    )


def test_clean_arm_failing_too_is_not_attributable() -> None:
    with pytest.raises(FaultNotRejected) as exc:
        with expect_fault_rejected("missing-rank"):
            raise failure(
                ("ddp (fault missing-rank)", "pre_norm", "missing-rank"),
                ("fsdp", "update", None),
            )
    assert str(exc.value).startswith(
        "fault 'missing-rank': the assertion failed, but also on arms that do not carry the fault "
        "(fsdp: update), so the failure cannot be attributed to it. Fix those arms first.\n\nTABLE"
    )


def test_failure_on_an_arm_with_another_fault_is_not_attributable() -> None:
    with pytest.raises(FaultNotRejected, match=r"also on arms that do not carry the fault \(ddp: pre_norm\)"):
        with expect_fault_rejected("missing-rank"):
            raise failure(("ddp", "pre_norm", "wrong-scale"))


def test_failure_without_any_faulted_arm_is_not_attributable() -> None:
    with pytest.raises(FaultNotRejected, match=r"without a failed check on an arm that carries the fault"):
        with expect_fault_rejected("missing-rank"):
            raise failure()


def test_by_must_be_among_the_failed_checks() -> None:
    with expect_fault_rejected("wrong-scale", by="pre_norm") as rejection:
        raise failure(("ddp (fault wrong-scale)", "pre_norm", "wrong-scale"))
    assert rejection.evidence.checks == ("pre_norm",)
    with pytest.raises(FaultNotRejected) as exc:
        with expect_fault_rejected("wrong-scale", by=["pre_norm", "update"]):
            raise failure(("ddp (fault wrong-scale)", "pre_norm", "wrong-scale"))
    assert str(exc.value).startswith(
        "fault 'wrong-scale' was rejected by pre_norm, but by= requires update among them.\n\nTABLE"
    )


def test_unknown_fault_lists_the_known_ones() -> None:
    with pytest.raises(SpriteUsageError) as exc:
        expect_fault_rejected("missing_rank")
    assert str(exc.value) == f"unknown fault 'missing_rank'; known faults: {KNOWN}"
    with pytest.raises(SpriteUsageError, match="unknown fault None"):
        get_fault(None)


def test_unknown_check_in_by_lists_the_known_checks() -> None:
    with pytest.raises(SpriteUsageError) as exc:
        expect_fault_rejected("missing-rank", by="gradient")
    assert str(exc.value) == (
        "expect_fault_rejected('missing-rank', by='gradient'): unknown check 'gradient'; known checks: "
        "initial, rows, pre_norm, post_norm, update, frozen, synchronized, metadata, steps, comm, clip, grads, "
        "dtype, gradients, tensor_updates, gate, trainables, optimizer_state, param_groups, lr_scheduler, loop, "
        "first_loss, lr"
    )


def test_evidence_is_only_available_after_a_rejection() -> None:
    guard = expect_fault_rejected("missing-rank")
    with pytest.raises(SpriteUsageError, match=r"no evidence for fault 'missing-rank' yet"):
        guard.evidence  # noqa: B018


def test_registry_names_every_seed_fault() -> None:
    assert ", ".join(FAULTS) == KNOWN
    assert FAULTS["missing-rank"].arms == ("ddp", "fsdp")
    for name in RESERVED:
        with pytest.raises(SpriteUsageError) as exc:
            get_fault(name)
        assert str(exc.value).startswith(f"fault {name!r} is reserved for the ")
        assert str(exc.value).endswith(f"and not planted by this version; faults it plants: {KNOWN}")


@pytest.mark.parametrize("name", list(FAULTS))
def test_every_registered_fault_has_a_planter_and_known_checks(name: str) -> None:
    fault = FAULTS[name]
    assert fault.name == name and fault.description
    assert isinstance(fault.planter, Planter) and fault.planter is not CLEAN
    assert fault.planter.hooks(), f"{name}'s planter overrides no hook, so planting it changes nothing"
    assert set(fault.by) <= set(PARITY_CHECKS) | set(CRITERION_CHECKS) | set(RESUME_CHECKS)
    # a fault an arm takes names the checks that reject it; one no arm takes is a mutant of users' fits only
    assert bool(fault.by) == bool(fault.arms)
    for kind, checks in fault.by_assertion.items():
        assert kind == "criterion_v2" and checks and set(checks) <= set(CRITERION_CHECKS)
    assert CLEAN.hooks() == ()


def test_a_fault_no_arm_takes_is_refused_on_every_arm_saying_where_it_goes() -> None:
    with pytest.raises(SpriteUsageError) as exc:
        plant("unrestored-rng", PlantSite(arm="resume", rank=0, world_size=2, accumulate=1))
    assert str(exc.value) == (
        "fault 'unrestored-rng' is planted only by --sprite-mutate, in a test's own Lightning fits: no arm of "
        "pytest-sprite's recipes takes it"
    )


def test_a_fault_planted_on_an_arm_it_is_not_for_names_the_valid_arms() -> None:
    with pytest.raises(SpriteUsageError) as exc:
        plant("wrong-scale", PlantSite(arm="single", rank=0, world_size=1, accumulate=1))
    assert str(exc.value) == (
        "fault 'wrong-scale' applies to arms ddp, fsdp, not 'single'; the reference arm always runs clean"
    )
    with pytest.raises(SpriteUsageError) as exc:
        plant("missing-rank", PlantSite(arm="ref32", rank=0, world_size=2, accumulate=1))
    assert str(exc.value) == "fault 'missing-rank' applies to arms ddp, fsdp, not 'ref32'"
    assert plant(None, PlantSite(arm="single", rank=0, world_size=1, accumulate=1)) is CLEAN


def test_by_defaults_to_the_registry_checks() -> None:
    with pytest.raises(FaultNotRejected) as exc:
        with expect_fault_rejected("missing-rank"):
            raise failure(("ddp (fault missing-rank)", "update", "missing-rank"))
    assert str(exc.value).startswith(
        "fault 'missing-rank' was rejected by update, but by= requires pre_norm among them.\n\nTABLE"
    )
    with expect_fault_rejected("missing-rank", by="update") as rejection:
        raise failure(("ddp (fault missing-rank)", "update", "missing-rank"))
    assert rejection.evidence.checks == ("update",)


def test_importing_the_assertions_and_recipes_loads_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import pytest_sprite.assertions.expect_fault, pytest_sprite.assertions.parity, pytest_sprite.planted_faults\n"
        "import pytest_sprite.recipes.lora_qwen, pytest_sprite.recipes.recipe_fixtures, pytest_sprite.recipes.artifacts\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'transformers', 'peft') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _Result:
    kind = "criterion_v2"


def test_by_defaults_to_the_registry_checks_of_the_assertion_that_failed() -> None:
    """missing-rank needs pre_norm in assert_parity, pre_norm and gradients in assert_criterion_v2."""
    exc = AssertionFailure(
        "TABLE",
        failed=(
            FailedCheck(arm="ddp (fault missing-rank)", check="pre_norm", fault="missing-rank", detail=""),
        ),
        result=_Result(),
    )
    with pytest.raises(FaultNotRejected, match="by= requires gradients among them"):
        with expect_fault_rejected("missing-rank"):
            raise exc
    with expect_fault_rejected("missing-rank", by="pre_norm") as rejection:
        raise exc
    assert rejection.evidence.checks == ("pre_norm",)
    assert FAULTS["missing-rank"].checks_for("criterion_v2") == ("pre_norm", "gradients")
    assert FAULTS["missing-rank"].checks_for("parity") == FAULTS["missing-rank"].by == ("pre_norm",)


@pytest.mark.parametrize(
    ("name", "by"),
    [
        ("fp32-backbone", ("dtype",)),
        ("local-adapter", ("synchronized",)),
        ("scale-grad", ("pre_norm", "gradients")),
        ("skip-update", ("synchronized",)),
    ],
)
def test_the_ddp_only_controls_are_bf16_criterion_faults(name: str, by: tuple[str, ...]) -> None:
    fault = FAULTS[name]
    assert fault.arms == ("ddp",) and fault.by == by
    bf16 = PlantSite(arm="ddp", rank=0, world_size=2, accumulate=1, precision="bf16-mixed")
    assert plant(name, bf16) is fault.planter
    with pytest.raises(SpriteUsageError) as exc:
        plant(name, PlantSite(arm="ddp", rank=0, world_size=2, accumulate=1, precision="32-true"))
    assert str(exc.value) == (
        f"fault {name!r} is a control of the BF16 criterion v2 and needs precision='bf16-mixed', "
        "the 'ddp' arm runs '32-true'"
    )
    with pytest.raises(SpriteUsageError, match=f"fault {name!r} applies to arms ddp, not 'fsdp'"):
        plant(name, PlantSite(arm="fsdp", rank=0, world_size=2, accumulate=1, precision="bf16-mixed"))


def test_the_ddp_only_planters_act_where_the_seed_says() -> None:
    torch = pytest.importorskip("torch")

    def site(rank: int) -> PlantSite:
        return PlantSite(arm="ddp", rank=rank, world_size=4, accumulate=1, precision="bf16-mixed")

    skip = FAULTS["skip-update"].planter
    skipped = {(r, s) for r in (0, 1, 3) for s in (3, 4) if skip.skip_step(s, 5, site(r))}
    assert skipped == {(1, 4), (3, 4)}  # ranks other than 0, the last update only
    assert FAULTS["local-adapter"].planter.unsynchronized(("a.lora_A", "a.lora_B"), site(1)) == ("a.lora_A",)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    FAULTS["scale-grad"].planter.gradients([("w", p)], site(2))
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with FAULTS["fp32-backbone"].planter.forward_context(site(0), "cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
