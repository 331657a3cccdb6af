"""Criterion v2's verdict: refuse arms that cannot be judged, then fail, void or pass, and raise unless pass."""

from __future__ import annotations

from collections.abc import Mapping

from pytest_sprite.assertions.criterion.invariants import check_invariants
from pytest_sprite.assertions.criterion.results import (
    CriterionError,
    CriterionRefused,
    CriterionResult,
    InvariantResult,
    ScoredComparison,
    Verdict,
)
from pytest_sprite.assertions.criterion.scoring import diagnostics, score
from pytest_sprite.assertions.evidence import FailedCheck
from pytest_sprite.glue.recorded_results import record_assertion
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.records import (
    BF16_ARMS,
    BF16_PRECISION,
    BF16_SINGLE_DEVICE_ARMS,
    FP32_PRECISION,
    Bf16ArmRecord,
)

__all__ = ["assert_criterion_v2"]


@phase("judging")
def assert_criterion_v2(arms: Mapping[str, Bf16ArmRecord]) -> CriterionResult:
    """Judge the six BF16 arms by criterion v2; return the result on pass, raise :class:`CriterionError` otherwise.

    ``arms`` maps each of ref32, ref, split, split_premul, ddp, fsdp to its record. A void verdict raises
    too and says why. Arms that cannot be judged at all raise :class:`CriterionRefused`.
    """
    _refuse(arms)
    ref32, split, premul = arms["ref32"], arms["split"], arms["split_premul"]
    invariants = check_invariants(arms)
    gate = score("gate", premul, split)
    scored = (score("ddp", arms["ddp"], split), score("fsdp", arms["fsdp"], split))
    verdict, failed, reason = _decide(invariants, gate, scored, premul)
    result = CriterionResult(
        verdict=verdict,
        reason=reason,
        ranks=arms["ddp"].world_size,
        global_batch=ref32.recipe.global_batch,
        device_type=ref32.device_type,
        scored=scored,
        gate=gate,
        invariants=invariants,
        diagnostics=diagnostics(arms),
        faults=tuple((a.fault, a.label) for a in arms.values() if a.fault is not None),
        failed=failed,
    )
    record_assertion(result, inputs=[arms[a].source for a in BF16_ARMS])
    if verdict != "pass":
        raise CriterionError(result.report(), failed=failed, result=result)
    return result


def _decide(
    invariants: tuple[InvariantResult, ...],
    gate: ScoredComparison,
    scored: tuple[ScoredComparison, ...],
    premul: Bf16ArmRecord,
) -> tuple[Verdict, tuple[FailedCheck, ...], str]:
    """Fail if any invariant fails; otherwise void if the gate fails; otherwise pass only if every scored
    check passes. Returns the verdict, the checks that decided it and why."""
    bad_invariants = [i for i in invariants if not i.passed]
    if bad_invariants:
        failed = tuple(
            FailedCheck(arm=f.label, check=i.name, fault=f.fault, detail=f.detail)
            for i in bad_invariants
            for f in i.failures
        )
        return (
            "fail",
            failed,
            "invariants failed: "
            + "; ".join(f"{i.name} ({', '.join(f.label for f in i.failures)})" for i in bad_invariants),
        )
    if not gate.passed:
        detail = "split_premul against split failed " + "; ".join(
            f"{f.check}: {f.detail}" for f in gate.failed
        )
        return (
            "void",
            (FailedCheck(arm=premul.label, check="gate", fault=premul.fault, detail=detail),),
            "the validity gate failed (split_premul against split: "
            + ", ".join(f.check for f in gate.failed)
            + "): two correct averaging orders disagree, so the scored checks cannot separate implementation "
            "error from rounding in this run; void is not a pass",
        )
    if any(not c.passed for c in scored):
        return (
            "fail",
            tuple(f for c in scored for f in c.failed),
            "scored step-0 checks failed: "
            + "; ".join(
                f"{c.label} ({', '.join(dict.fromkeys(f.check for f in c.failed))})"
                for c in scored
                if not c.passed
            ),
        )
    return "pass", (), "invariants and gate pass; ddp and fsdp pass every scored check"


def _refuse(arms: object) -> None:
    if not isinstance(arms, Mapping):
        raise CriterionRefused(
            f"assert_criterion_v2 takes a mapping of arm name to record, got {type(arms).__name__}; "
            'pass {a: lora_qwen.run(a, precision="bf16-mixed") for a in ARMS}'
        )
    unknown = [k for k in arms if k not in BF16_ARMS]
    if unknown:
        raise CriterionRefused(
            f"unknown arm {', '.join(map(repr, unknown))}; criterion v2 judges exactly: {', '.join(BF16_ARMS)}"
        )
    missing = [a for a in BF16_ARMS if a not in arms]
    if missing:
        raise CriterionRefused(
            f"criterion v2 needs all six arms; missing: {', '.join(missing)}. Run every arm of "
            f"{', '.join(BF16_ARMS)} and pass them together"
        )
    for name, rec in arms.items():
        if not isinstance(rec, Bf16ArmRecord):
            raise CriterionRefused(
                f"arm {name!r} must be a Bf16ArmRecord (from lora_qwen.run({name!r}, precision='bf16-mixed')), "
                f"got {type(rec).__name__}"
            )
        if rec.arm != name:
            raise CriterionRefused(
                f"the record passed as {name!r} is the {rec.arm!r} arm; key each record by its arm"
            )
    recs: dict[str, Bf16ArmRecord] = dict(arms)
    for name, rec in recs.items():
        _refuse_arm(name, rec, recs["ref32"])


def _refuse_arm(name: str, rec: Bf16ArmRecord, ref32: Bf16ArmRecord) -> None:
    """Refuse one arm of the wrong precision, world, fault, recipe or model."""
    expected = FP32_PRECISION if name == "ref32" else BF16_PRECISION
    if rec.precision != expected:
        what = "the FP32 reference" if name == "ref32" else "a BF16 arm"
        raise CriterionRefused(
            f"arm {name!r} is {what} and must run precision={expected!r}, it ran {rec.precision!r}; "
            f'run it with lora_qwen.run({name!r}, precision="bf16-mixed")'
        )
    if name in ("ddp", "fsdp") and rec.world_size < 2:
        raise CriterionRefused(
            f"arm {name!r} ran on {rec.world_size} device; a one-device run proves nothing about "
            "synchronization: run it in a test marked @pytest.mark.ranks(n) with n >= 2"
        )
    if name in BF16_SINGLE_DEVICE_ARMS and rec.fault is not None:
        raise CriterionRefused(
            f"arm {name!r} carries fault {rec.fault!r}; the reference arms (ref32, ref, split, split_premul) "
            "must be clean: plant faults on ddp or fsdp"
        )
    diffs = ref32.recipe.differences(rec.recipe)
    if diffs:
        raise CriterionRefused(
            f"arm {name!r} ran a different recipe than ref32 ({'; '.join(diffs)}; ref32 first); run every arm "
            "from the same recipe with the same steps, global batch and clip"
        )
    if (
        rec.trainable_names != ref32.trainable_names
        or rec.frozen_names != ref32.frozen_names
        or rec.linear_sites != ref32.linear_sites
    ):
        raise CriterionRefused(
            f"arm {name!r} has another model than ref32 ({len(rec.trainable_names)} trainable / "
            f"{len(rec.frozen_names)} frozen / {len(rec.linear_sites)} Linear sites against "
            f"{len(ref32.trainable_names)} / {len(ref32.frozen_names)} / {len(ref32.linear_sites)}); "
            "run every arm from the same recipe"
        )
