"""Criterion v2's scored step-0 checks (ddp and fsdp against split; the gate on split_premul) and the
diagnostics that are reported, never scored."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from pytest_sprite.assertions.criterion.results import (
    ABS_FLOOR,
    CRITERION_SCORED,
    EPS_FP32,
    RTOL,
    Diagnostics,
    PairDiagnostic,
    ScoredComparison,
    TensorGap,
)
from pytest_sprite.assertions.evidence import FailedCheck
from pytest_sprite.assertions.numeric import rel, rel_l2_tensors
from pytest_sprite.assertions.tables import format_figure, format_limit
from pytest_sprite.records import Bf16ArmRecord

if TYPE_CHECKING:
    import torch

__all__ = ["diagnostics", "score", "tensor_gap"]

_DIAGNOSTIC_PAIRS: tuple[tuple[str, str], ...] = (
    ("ddp", "split"),
    ("fsdp", "split"),
    ("split_premul", "split"),
    ("ddp", "split_premul"),
    ("fsdp", "split_premul"),
)


def score(role: str, arm: Bf16ArmRecord, ref: Bf16ArmRecord) -> ScoredComparison:
    """``arm``'s four scored step-0 checks against ``ref`` (split)."""
    if not arm.steps or not ref.steps:
        return _no_step_zero(role, arm, ref)
    failed: list[FailedCheck] = []

    def fail(check: str, detail: str) -> None:
        failed.append(FailedCheck(arm=arm.label, check=check, fault=arm.fault, detail=detail))

    reference = ref.steps[0].ranks[0].pre_clip_norm
    pre_rel, where = -1.0, ""
    for r, rank in enumerate(arm.steps[0].ranks):
        rank_rel = rel(rank.pre_clip_norm, reference)
        if rank_rel > pre_rel:
            pre_rel = rank_rel
            where = f"rank {r}: {rank.pre_clip_norm:.8g} against split {reference:.8g}"
    if not pre_rel <= RTOL:
        fail("pre_norm", f"step 0, {where}, rel {format_figure(pre_rel)} > {format_limit(RTOL)}")

    gradients = tuple(
        tensor_gap(k, arm.steps[0].grads[k], ref.steps[0].grads[k]) for k in ref.trainable_names
    )
    _fail_over("gradients", "tensor gradients", gradients, fail)
    arm_update, ref_update = arm.step_update(0), ref.step_update(0)
    update_rel = rel_l2_tensors(arm_update, ref_update, ref.trainable_names)
    if not update_rel <= RTOL:
        fail("update", f"step-0 update rel L2 {format_figure(update_rel)} > {format_limit(RTOL)}")
    updates = tuple(
        tensor_gap(k, arm_update[k], ref_update[k], initial=ref.initial_trainable[k])
        for k in ref.trainable_names
    )
    _fail_over("tensor_updates", "tensor updates", updates, fail)
    return _comparison(role, arm, _StepZero(pre_rel, where, gradients, update_rel, updates), tuple(failed))


class _StepZero(NamedTuple):
    """An arm's step-0 figures, measured or (no step 0) infinite, under :class:`ScoredComparison`'s names:
    both ways of scoring an arm make its comparison with :func:`_comparison`."""

    pre_norm_rel: float
    pre_norm_where: str
    gradients: tuple[TensorGap, ...]
    update_rel_l2: float
    updates: tuple[TensorGap, ...]


def _comparison(
    role: str, arm: Bf16ArmRecord, figures: _StepZero, failed: tuple[FailedCheck, ...]
) -> ScoredComparison:
    """``arm``'s comparison in ``role``: the one place it is made, from figures measured or not."""
    return ScoredComparison(role=role, label=arm.label, fault=arm.fault, **figures._asdict(), failed=failed)


def _fail_over(check: str, what: str, gaps: tuple[TensorGap, ...], fail: Callable[[str, str], None]) -> None:
    over = [g for g in gaps if g.over]
    if over:
        worst = max(over, key=lambda g: g.gap)
        fail(
            check,
            f"{len(over)}/{len(gaps)} {what} over their bound; worst {worst.name}: "
            f"L2 diff {worst.diff:.3g} > {worst.bound:.3g} (gap {format_figure(worst.gap)})",
        )


def _no_step_zero(role: str, arm: Bf16ArmRecord, ref: Bf16ArmRecord) -> ScoredComparison:
    """Every scored check failed: an arm (or split) recorded no step 0."""
    detail = f"no step 0 recorded ({arm.label}: {len(arm.steps)} steps, split: {len(ref.steps)})"
    inf_gaps = tuple(
        TensorGap(name=k, numel=0, diff=math.inf, ref_norm=0.0, floor=0.0) for k in ref.trainable_names
    )
    failed = tuple(
        FailedCheck(arm=arm.label, check=check, fault=arm.fault, detail=detail) for check in CRITERION_SCORED
    )
    return _comparison(role, arm, _StepZero(math.inf, detail, inf_gaps, math.inf, inf_gaps), failed)


def tensor_gap(
    name: str, value: torch.Tensor, reference: torch.Tensor, *, initial: torch.Tensor | None = None
) -> TensorGap:
    """L2 difference of ``value`` against ``reference`` in float64, with the criterion's additive floor.

    The floor is ``1e-12 * sqrt(numel)``, plus ``2 * eps_fp32 * norm(initial)`` when ``initial`` is given
    (an update, whose FP32 endpoints are each rounded).
    """
    numel = int(reference.numel())
    floor = ABS_FLOOR * math.sqrt(numel)
    if initial is not None:
        floor += 2 * EPS_FP32 * float(initial.double().norm())
    if tuple(value.shape) != tuple(reference.shape):
        return TensorGap(
            name=name, numel=numel, diff=math.inf, ref_norm=float(reference.double().norm()), floor=floor
        )
    diff = float((value.double() - reference.double()).norm())
    return TensorGap(
        name=name,
        numel=numel,
        diff=diff if not math.isnan(diff) else math.inf,
        ref_norm=float(reference.double().norm()),
        floor=floor,
    )


def _pair(arm: Bf16ArmRecord, ref: Bf16ArmRecord) -> PairDiagnostic:
    max_gap: list[float] = []
    equal_tensors: list[int] = []
    equal_fraction: list[float] = []
    for a_step, r_step in zip(arm.steps, ref.steps, strict=False):
        gaps = [tensor_gap(k, a_step.grads[k], r_step.grads[k]).gap for k in ref.trainable_names]
        max_gap.append(max(gaps, default=0.0))
        eq = 0
        eq_elems = 0
        total = 0
        for k in ref.trainable_names:
            a, b = a_step.grads[k], r_step.grads[k]
            total += b.numel()
            if a.shape == b.shape and a.dtype == b.dtype:
                same = a.reshape(-1) == b.reshape(-1)
                eq_elems += int(same.sum())
                eq += bool(same.all())
        equal_tensors.append(eq)
        equal_fraction.append(eq_elems / total if total else 1.0)
    five = (
        rel_l2_tensors(arm.total_update(), ref.total_update(), ref.trainable_names)
        if arm.steps and ref.steps
        else math.inf
    )
    return PairDiagnostic(
        arm=arm.label,
        against=ref.label,
        max_gap=tuple(max_gap),
        equal_tensors=tuple(equal_tensors),
        tensors=len(ref.trainable_names),
        equal_fraction=tuple(equal_fraction),
        five_step_update_rel_l2=five,
    )


def diagnostics(arms: Mapping[str, Bf16ArmRecord]) -> Diagnostics:
    ref, ref32 = arms["ref"], arms["ref32"]
    return Diagnostics(
        pairs=tuple(_pair(arms[a], arms[b]) for a, b in _DIAGNOSTIC_PAIRS),
        bf16_vs_fp32=_pair(ref, ref32),
        bf16_vs_fp32_pre_norm_rel=tuple(
            rel(a.ranks[0].pre_clip_norm, b.ranks[0].pre_clip_norm)
            for a, b in zip(ref.steps, ref32.steps, strict=False)
        ),
    )
