"""BF16 parity, criterion v2: the lightning-sprite seed's rule, exactly.

Scored (ddp and fsdp against split, step 0 only): pre-clip global norm relative error at most 1e-3 on every
rank; each trainable tensor's gradient L2 difference at most ``1e-3 * reference_norm + 1e-12 * sqrt(numel)``;
the step-0 update of all trainables relative L2 at most 1e-3; each tensor's step-0 update as for gradients
plus ``2 * eps_fp32 * norm(initial_tensor)`` for endpoint quantization. Gate: split_premul must pass the same
checks against split, else the run cannot separate implementation error from rounding and the verdict is void.
Invariants hold on every arm and step. Verdict: fail if any invariant fails; otherwise void if the gate fails;
otherwise pass only if ddp and fsdp pass every scored check. Void is never a pass: the assertion raises.
Diagnostics (all five steps, five-step updates, BF16 against FP32) are reported, never scored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pytest_sprite._ranges import fold_ranks
from pytest_sprite._results import record_assertion
from pytest_sprite.assertions._evidence import AssertionFailure, FailedCheck
from pytest_sprite.assertions._tables import format_figure, format_limit, render_table
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.records import (
    BF16_ARMS,
    BF16_PRECISION,
    BF16_SINGLE_DEVICE_ARMS,
    FP32_PRECISION,
    Bf16ArmRecord,
    LinearCall,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CRITERION_CHECKS",
    "CRITERION_INVARIANTS",
    "CRITERION_SCORED",
    "CriterionError",
    "CriterionRefused",
    "CriterionResult",
    "Diagnostics",
    "InvariantFailure",
    "InvariantResult",
    "PairDiagnostic",
    "ScoredComparison",
    "TensorGap",
    "assert_criterion_v2",
    "tensor_gap",
]

RTOL = 1e-3
"""Relative limit of every scored check."""
ABS_FLOOR = 1e-12
"""Additive floor per sqrt(numel) of the per-tensor checks."""
EPS_FP32 = 2.0**-23
"""Machine epsilon of float32 (``torch.finfo(torch.float32).eps``): endpoint quantization of an update."""
CLIP_RTOL = 1e-4
"""The post-clip norm must be within this (relative) of the clip."""

INVARIANTS: dict[str, str] = {
    "metadata": "metadata and world size",
    "steps": "step count",
    "initial": "bit-identical initial trainables",
    "frozen": "frozen tensors unchanged",
    "comm": "FP32 communication configuration",
    "clip": f"clip active and post-clip norm within {format_limit(CLIP_RTOL)} of the clip",
    "grads": "present, finite FP32 gradients",
    "dtype": "every Linear at the requested dtype under the expected autocast state",
    "rows": "exact rows and rank shards",
    "synchronized": "DDP replicas bitwise equal; FSDP2 sharded DTensors gathered bitwise equal on every rank",
}
CRITERION_INVARIANTS: tuple[str, ...] = tuple(INVARIANTS)
"""Invariant names, checked on every arm and step, in evaluation order."""
CRITERION_SCORED: tuple[str, ...] = ("pre_norm", "gradients", "update", "tensor_updates")
"""Scored step-0 check names (ddp and fsdp against split; the gate runs them on split_premul)."""
CRITERION_CHECKS: tuple[str, ...] = (*CRITERION_INVARIANTS, *CRITERION_SCORED, "gate")
"""Every check name a criterion v2 failure can carry (``by=`` of ``expect_fault_rejected``)."""

Verdict = Literal["pass", "fail", "void"]
_DIAGNOSTIC_PAIRS: tuple[tuple[str, str], ...] = (
    ("ddp", "split"),
    ("fsdp", "split"),
    ("split_premul", "split"),
    ("ddp", "split_premul"),
    ("fsdp", "split_premul"),
)
_FP32 = "torch.float32"
_BF16 = "torch.bfloat16"


class CriterionRefused(SpriteUsageError):
    """The arms cannot be judged at all: an arm missing, other recipes, one-device ddp/fsdp, wrong precision."""


class CriterionError(AssertionFailure):
    """Criterion v2 did not pass (fail or void); ``result`` is the :class:`CriterionResult` with every table."""


@dataclass(frozen=True, kw_only=True)
class TensorGap:
    """One trainable tensor's L2 difference against the reference, with its additive bound."""

    name: str
    numel: int
    diff: float
    """L2 norm of (arm - reference)."""
    ref_norm: float
    """L2 norm of the reference tensor."""
    floor: float
    """Absolute part of the bound: ``1e-12 * sqrt(numel)`` (plus ``2 * eps_fp32 * norm(initial)`` for updates)."""

    @property
    def bound(self) -> float:
        """``1e-3 * ref_norm + floor``: the most this tensor may differ."""
        return RTOL * self.ref_norm + self.floor

    @property
    def over(self) -> bool:
        """True when the difference exceeds the bound (a NaN difference is over)."""
        return not self.diff <= self.bound

    @property
    def gap(self) -> float:
        """Normalized gap: the difference over the larger of the reference norm and the floor (0 if equal)."""
        if self.diff == 0:
            return 0.0
        if not math.isfinite(self.diff):
            return math.inf
        return self.diff / max(self.ref_norm, self.floor)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "name": self.name,
            "numel": self.numel,
            "diff": _json(self.diff),
            "ref_norm": _json(self.ref_norm),
            "floor": self.floor,
            "bound": _json(self.bound),
            "gap": _json(self.gap),
            "over": self.over,
        }


@dataclass(frozen=True, kw_only=True)
class ScoredComparison:
    """One arm's step-0 figures against split: the four scored checks (ddp, fsdp; split_premul is the gate)."""

    role: str
    """``gate``, ``ddp`` or ``fsdp``."""
    label: str
    """Arm label as in the tables, e.g. ``ddp (fault scale-grad)``."""
    fault: str | None
    pre_norm_rel: float
    """Largest relative error of the step-0 pre-clip global norm over ranks."""
    pre_norm_where: str
    """Rank, value and reference of that largest error."""
    gradients: tuple[TensorGap, ...]
    """Per trainable tensor, step-0 gradient before clipping."""
    update_rel_l2: float
    """Relative L2 difference of the step-0 update of all trainables."""
    updates: tuple[TensorGap, ...]
    """Per trainable tensor, step-0 update (with the endpoint term in the floor)."""
    failed: tuple[FailedCheck, ...]
    """Scored checks this arm failed."""

    @property
    def passed(self) -> bool:
        """True when every scored check passed."""
        return not self.failed

    @property
    def max_gradient_gap(self) -> float:
        """Largest normalized per-tensor gradient gap."""
        return max((g.gap for g in self.gradients), default=math.inf)

    @property
    def max_update_gap(self) -> float:
        """Largest normalized per-tensor update gap."""
        return max((g.gap for g in self.updates), default=math.inf)

    @property
    def gradients_over(self) -> int:
        """Tensors whose gradient difference exceeds its bound."""
        return sum(g.over for g in self.gradients)

    @property
    def updates_over(self) -> int:
        """Tensors whose update difference exceeds its bound."""
        return sum(g.over for g in self.updates)

    def row(self) -> list[str]:
        """Cells of the scored step-0 table."""
        n = len(self.gradients)
        return [
            self.label if self.role != "gate" else f"gate ({self.label})",
            "pass" if self.passed else "FAIL",
            format_figure(self.pre_norm_rel),
            format_figure(self.max_gradient_gap),
            format_figure(self.update_rel_l2),
            format_figure(self.max_update_gap),
            f"{self.gradients_over}/{n}",
            f"{self.updates_over}/{len(self.updates)}",
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures, per tensor included."""
        return {
            "role": self.role,
            "label": self.label,
            "fault": self.fault,
            "passed": self.passed,
            "pre_norm_rel": _json(self.pre_norm_rel),
            "pre_norm_where": self.pre_norm_where,
            "max_gradient_gap": _json(self.max_gradient_gap),
            "update_rel_l2": _json(self.update_rel_l2),
            "max_update_gap": _json(self.max_update_gap),
            "gradients_over": self.gradients_over,
            "updates_over": self.updates_over,
            "tensors": len(self.gradients),
            "gradients": [g.to_dict() for g in self.gradients],
            "updates": [g.to_dict() for g in self.updates],
            "failed": [f.to_dict() for f in self.failed],
        }


@dataclass(frozen=True, kw_only=True)
class InvariantFailure:
    """One arm breaking one invariant."""

    label: str
    fault: str | None
    detail: str
    """The first offending step/rank/tensor, with values."""
    observations: str
    """How widespread: counts over sites, tensors or rank-step observations."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "arm": self.label,
            "fault": self.fault,
            "detail": self.detail,
            "observations": self.observations,
        }


@dataclass(frozen=True, kw_only=True)
class InvariantResult:
    """One invariant over every arm and step."""

    name: str
    description: str
    failures: tuple[InvariantFailure, ...]

    @property
    def passed(self) -> bool:
        """True when no arm broke the invariant."""
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "description": self.description,
            "passed": self.passed,
            "failures": [f.to_dict() for f in self.failures],
        }


@dataclass(frozen=True, kw_only=True)
class PairDiagnostic:
    """Per-step gradient gaps of one arm against another, never scored."""

    arm: str
    against: str
    max_gap: tuple[float, ...]
    """Largest normalized per-tensor gradient gap, per step."""
    equal_tensors: tuple[int, ...]
    """Bitwise-equal gradient tensors, per step."""
    tensors: int
    equal_fraction: tuple[float, ...]
    """Fraction of bitwise-equal gradient elements, per step."""
    five_step_update_rel_l2: float
    """Relative L2 difference of the whole-run update of all trainables."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "arm": self.arm,
            "against": self.against,
            "max_gap": [_json(x) for x in self.max_gap],
            "equal_tensors": list(self.equal_tensors),
            "tensors": self.tensors,
            "equal_fraction": [_json(x) for x in self.equal_fraction],
            "five_step_update_rel_l2": _json(self.five_step_update_rel_l2),
        }


@dataclass(frozen=True, kw_only=True)
class Diagnostics:
    """Everything reported and never scored."""

    pairs: tuple[PairDiagnostic, ...]
    """ddp, fsdp and split_premul against split; ddp and fsdp against split_premul."""
    bf16_vs_fp32: PairDiagnostic
    """Full-batch BF16 (ref) against FP32 (ref32)."""
    bf16_vs_fp32_pre_norm_rel: tuple[float, ...]
    """ref against ref32: relative pre-clip norm difference, per step."""

    def table(self) -> str:
        """Per-step diagnostics: one row per pair, steps comma-separated as in the seed."""
        rows = [
            [
                d.arm,
                d.against,
                ", ".join(_short(x) for x in d.max_gap),
                ", ".join(f"{e}/{d.tensors}" for e in d.equal_tensors),
                ", ".join(_short(x) for x in d.equal_fraction),
                format_figure(d.five_step_update_rel_l2),
            ]
            for d in (*self.pairs, self.bf16_vs_fp32)
        ]
        return render_table(
            (
                "Arm",
                "Against",
                "Largest tensor gradient gap per step",
                "Bitwise-equal tensors",
                "Bitwise-equal elements",
                "Five-step update rel L2",
            ),
            rows,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "pairs": [p.to_dict() for p in self.pairs],
            "bf16_vs_fp32": self.bf16_vs_fp32.to_dict(),
            "bf16_vs_fp32_pre_norm_rel": [_json(x) for x in self.bf16_vs_fp32_pre_norm_rel],
        }


@dataclass(frozen=True, kw_only=True)
class CriterionResult:
    """Verdict, scored comparisons, gate, invariants and diagnostics of one BF16 run; ``to_dict()`` for reports."""

    kind: ClassVar[str] = "criterion_v2"

    verdict: Verdict
    reason: str
    """Why the verdict: which invariants failed, why the gate voided the run, or which scored checks failed."""
    ranks: int
    """N: the world size of ddp and fsdp."""
    global_batch: int
    device_type: str
    scored: tuple[ScoredComparison, ...]
    """ddp and fsdp against split at step 0."""
    gate: ScoredComparison
    """split_premul against split at step 0."""
    invariants: tuple[InvariantResult, ...]
    diagnostics: Diagnostics
    faults: tuple[tuple[str, str], ...]
    """(fault, arm label) of every faulted arm."""
    failed: tuple[FailedCheck, ...]
    """The checks that decided a fail or void verdict (the rejecting evidence); empty on a pass."""

    @property
    def passed(self) -> bool:
        """True only on the verdict ``pass``."""
        return self.verdict == "pass"

    def scored_table(self) -> str:
        """Scored step-0 comparisons against split; the gate row is split_premul."""
        return render_table(
            (
                "Arm",
                "Result",
                "Pre-clip norm rel",
                "Max tensor gradient gap",
                "Update rel L2",
                "Max tensor update gap",
                "Tensor gradients over",
                "Tensor updates over",
            ),
            [c.row() for c in (self.gate, *self.scored)],
        )

    def invariants_table(self) -> str:
        """Every invariant with pass/FAIL and, for each failure, the arm and its evidence."""
        rows: list[list[str]] = []
        for inv in self.invariants:
            if inv.passed:
                rows.append([inv.name, "pass", "all arms", ""])
            for f in inv.failures:
                rows.append([inv.name, "FAIL", f.label, f"{f.detail} [{f.observations}]"])
        return render_table(("Invariant", "Result", "Arm", "Evidence"), rows)

    def rejection_rows(self) -> list[dict[str, Any]]:
        """One row per faulted arm: fault, arm, status, rejecting evidence, observations, figures.

        The rejecting evidence is the fault registry's criterion-v2 checks for the fault that failed on its
        arm. The status is ``rejected`` only when all of them failed there and no other arm failed, as
        ``expect_fault_rejected`` requires; other failed checks of the arm are listed as supporting.
        """
        from pytest_sprite.faults import FAULTS

        out = []
        by_label = {c.label: c for c in self.scored}
        for fault, label in self.faults:
            mine = list(dict.fromkeys(f.check for f in self.failed if f.arm == label))
            others = [f for f in self.failed if f.arm != label]
            entry = FAULTS.get(fault)
            expected = entry.checks_for(self.kind) if entry is not None else ()
            rejecting = [c for c in mine if c in expected]
            rejected = bool(rejecting) and set(expected) <= set(mine) and not others
            observations = [
                f"{inv.name}: {f.observations}"
                for inv in self.invariants
                for f in inv.failures
                if f.label == label
            ]
            comp = by_label.get(label)
            if comp is not None and not observations:
                observations.append(
                    f"tensor gradients over {comp.gradients_over}/{len(comp.gradients)}; "
                    f"tensor updates over {comp.updates_over}/{len(comp.updates)}"
                )
            extra = [c for c in mine if c not in rejecting]
            if extra:
                observations.append("also failed: " + ", ".join(extra))
            if others:
                observations.append(
                    "other arms failed too: " + ", ".join(dict.fromkeys(f.arm for f in others))
                )
            out.append(
                {
                    "fault": fault,
                    "arm": label,
                    "status": "rejected" if rejected else "not rejected",
                    "rejecting_evidence": rejecting,
                    "expected_evidence": list(expected),
                    "supporting_observations": "; ".join(observations),
                    "pre_norm_rel": _json(comp.pre_norm_rel) if comp else None,
                    "max_gradient_gap": _json(comp.max_gradient_gap) if comp else None,
                    "update_rel_l2": _json(comp.update_rel_l2) if comp else None,
                    "tensors_over": (
                        f"gradients {comp.gradients_over}/{len(comp.gradients)}, "
                        f"updates {comp.updates_over}/{len(comp.updates)}"
                        if comp
                        else ""
                    ),
                }
            )
        return out

    def rejection_table(self) -> str:
        """The seed's fault table: fault, arm, status, rejecting evidence, observations, figures, tensors over."""
        rows = [
            [
                r["fault"],
                r["arm"],
                r["status"],
                ", ".join(r["rejecting_evidence"]) or "-",
                r["supporting_observations"],
                _cell(r["pre_norm_rel"]),
                _cell(r["max_gradient_gap"]),
                _cell(r["update_rel_l2"]),
                r["tensors_over"],
            ]
            for r in self.rejection_rows()
        ]
        return render_table(
            (
                "Fault",
                "Arm",
                "Status",
                "Rejecting evidence",
                "Supporting observations",
                "Pre-clip norm rel",
                "Max tensor gradient gap",
                "Update rel L2",
                "Tensors over",
            ),
            rows,
        )

    def report(self) -> str:
        """Verdict line and every table: the text of the AssertionError."""
        lines = [
            f"BF16 criterion v2: verdict {self.verdict.upper()} ({self.ranks} ranks, global batch "
            f"{self.global_batch}, {self.device_type}): {self.reason}",
            "",
            "Scored step-0 comparisons against split (gate is split_premul); limits: pre-clip norm rel "
            f"{format_limit(RTOL)}, tensor L2 diff <= {format_limit(RTOL)}*norm + {format_limit(ABS_FLOOR)}*sqrt(numel)"
            " (+ 2*eps_fp32*norm(initial) for updates), update rel L2 "
            f"{format_limit(RTOL)}. Gaps divide the L2 difference by the larger of the reference norm and the floor.",
            self.scored_table(),
            "",
            "Invariants (every arm, every step):",
            self.invariants_table(),
            "",
            "Diagnostics, never scored (gradient before clipping, steps 0 onwards; last row is ref against ref32):",
            self.diagnostics.table(),
        ]
        if self.faults:
            lines += ["", "Faults:", self.rejection_table()]
        if self.failed:
            lines += ["", "Deciding checks:"]
            lines += [f"  {f.arm}: {f.check}: {f.detail}" for f in self.failed]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready result: verdict, every table's figures, the rejection rows."""
        return {
            "kind": self.kind,
            "verdict": self.verdict,
            "passed": self.passed,
            "reason": self.reason,
            "ranks": self.ranks,
            "global_batch": self.global_batch,
            "device_type": self.device_type,
            "limits": {"rtol": RTOL, "abs_floor": ABS_FLOOR, "eps_fp32": EPS_FP32, "clip_rtol": CLIP_RTOL},
            "scored": [c.to_dict() for c in self.scored],
            "gate": self.gate.to_dict(),
            "invariants": [i.to_dict() for i in self.invariants],
            "diagnostics": self.diagnostics.to_dict(),
            "faults": self.rejection_rows(),
            "failed": [f.to_dict() for f in self.failed],
        }


def assert_criterion_v2(arms: Mapping[str, Bf16ArmRecord]) -> CriterionResult:
    """Judge the six BF16 arms by criterion v2; return the result on pass, raise :class:`CriterionError` otherwise.

    ``arms`` maps each of ref32, ref, split, split_premul, ddp, fsdp to its record. A void verdict raises
    too and says why. Arms that cannot be judged at all raise :class:`CriterionRefused`.
    """
    _refuse(arms)
    ref32, split, premul = arms["ref32"], arms["split"], arms["split_premul"]
    n = arms["ddp"].world_size
    invariants = tuple(
        InvariantResult(
            name=name, description=INVARIANTS[name], failures=tuple(_INVARIANT_CHECKS[name](arms, n))
        )
        for name in CRITERION_INVARIANTS
    )
    gate = _score("gate", premul, split)
    scored = (_score("ddp", arms["ddp"], split), _score("fsdp", arms["fsdp"], split))
    bad_invariants = [i for i in invariants if not i.passed]
    verdict: Verdict
    if bad_invariants:
        verdict = "fail"
        failed = tuple(
            FailedCheck(arm=f.label, check=i.name, fault=f.fault, detail=f.detail)
            for i in bad_invariants
            for f in i.failures
        )
        reason = "invariants failed: " + "; ".join(
            f"{i.name} ({', '.join(f.label for f in i.failures)})" for i in bad_invariants
        )
    elif not gate.passed:
        verdict = "void"
        failed = (
            FailedCheck(
                arm=premul.label,
                check="gate",
                fault=premul.fault,
                detail="split_premul against split failed "
                + "; ".join(f"{f.check}: {f.detail}" for f in gate.failed),
            ),
        )
        reason = (
            "the validity gate failed (split_premul against split: "
            + ", ".join(f.check for f in gate.failed)
            + "): two correct averaging orders disagree, so the scored checks cannot separate implementation "
            "error from rounding in this run; void is not a pass"
        )
    elif any(not c.passed for c in scored):
        verdict = "fail"
        failed = tuple(f for c in scored for f in c.failed)
        reason = "scored step-0 checks failed: " + "; ".join(
            f"{c.label} ({', '.join(dict.fromkeys(f.check for f in c.failed))})"
            for c in scored
            if not c.passed
        )
    else:
        verdict = "pass"
        failed = ()
        reason = "invariants and gate pass; ddp and fsdp pass every scored check"
    result = CriterionResult(
        verdict=verdict,
        reason=reason,
        ranks=n,
        global_batch=ref32.recipe.global_batch,
        device_type=ref32.device_type,
        scored=scored,
        gate=gate,
        invariants=invariants,
        diagnostics=_diagnostics(arms),
        faults=tuple((a.fault, a.label) for a in arms.values() if a.fault is not None),
        failed=failed,
    )
    record_assertion(result, inputs=[arms[a].source for a in BF16_ARMS])
    if verdict != "pass":
        raise CriterionError(result.report(), failed=failed, result=result)
    return result


# --- refusals ------------------------------------------------------------------------------------------


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
    ref32 = recs["ref32"]
    for name, rec in recs.items():
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


# --- invariants -----------------------------------------------------------------------------------------


def _failure(rec: Bf16ArmRecord, detail: str, observations: str) -> InvariantFailure:
    return InvariantFailure(label=rec.label, fault=rec.fault, detail=detail, observations=observations)


def _metadata(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    out = []
    ref32 = arms["ref32"]
    for name, rec in arms.items():
        problems = []
        want_world = 1 if name in BF16_SINGLE_DEVICE_ARMS else n
        if rec.world_size != want_world:
            problems.append(f"ran on {rec.world_size} devices, expected {want_world}")
        if rec.shards != n:
            problems.append(f"records {rec.shards} rank shards, the world size is {n}")
        if rec.device_type != ref32.device_type:
            problems.append(f"device {rec.device_type!r}, ref32 ran on {ref32.device_type!r}")
        if name == "ref32" and rec.tf32:
            problems.append("TF32 matmuls were allowed; ref32 must run with TF32 disabled")
        if rec.recipe.global_batch % n:
            problems.append(f"global batch {rec.recipe.global_batch} is not divisible by {n} ranks")
        if problems:
            out.append(_failure(rec, "; ".join(problems), f"{len(problems)} metadata problems"))
    return out


def _steps(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    return [
        _failure(
            rec, f"took {len(rec.steps)} steps, the recipe has {rec.recipe.steps}", f"{len(rec.steps)} steps"
        )
        for rec in arms.values()
        if len(rec.steps) != rec.recipe.steps
    ]


def _initial(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    ref32 = arms["ref32"]
    want = ref32.initial_digests[0]
    out = []
    for rec in arms.values():
        bad = [
            nm
            for nm in rec.trainable_names
            if not _bit_equal(rec.initial_trainable[nm], ref32.initial_trainable[nm])
        ]
        where = "rank 0 tensors"
        for rank, digests in enumerate(rec.initial_digests):
            rank_bad = [k for k in (*rec.trainable_names, *rec.frozen_names) if digests.get(k) != want.get(k)]
            if rank_bad and not bad:
                bad, where = rank_bad, f"rank {rank} digests"
        if bad:
            total = len(rec.trainable_names) + len(rec.frozen_names)
            out.append(
                _failure(
                    rec,
                    f"{where}: {len(bad)} tensors differ from ref32 before the first step (first: {bad[0]})",
                    f"{len(bad)}/{total} tensors",
                )
            )
    return out


def _frozen(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    want = arms["ref32"].initial_digests[0]
    out = []
    for rec in arms.values():
        first = ""
        hits = 0
        for s, step in enumerate(rec.steps):
            for r, rank in enumerate(step.ranks):
                changed = [k for k in rec.frozen_names if rank.frozen_digests.get(k) != want.get(k)]
                if changed:
                    hits += 1
                    first = first or (
                        f"step {s}, rank {r}: {len(changed)} of {len(rec.frozen_names)} frozen tensors changed "
                        f"(first: {changed[0]})"
                    )
        if hits:
            out.append(_failure(rec, first, f"{hits}/{_observations(rec)} rank-step observations"))
    return out


def _comm(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    out = []
    for name, rec in arms.items():
        bad: list[str] = []
        for r, c in enumerate(rec.comm):
            if name in BF16_SINGLE_DEVICE_ARMS:
                if c.strategy != "none":
                    bad.append(f"rank {r}: communication {c.strategy!r} on a single-device arm")
            elif name == "ddp":
                if c.strategy != "ddp" or c.reducer_dtype != _FP32 or c.comm_hook is not None:
                    bad.append(
                        f"rank {r}: strategy {c.strategy!r}, reducer dtype {c.reducer_dtype}, comm hook "
                        f"{c.comm_hook}; required: ddp, {_FP32}, no hook"
                    )
            elif (
                c.strategy != "fsdp"
                or c.param_dtype not in (None, _FP32)
                or c.reduce_dtype not in (None, _FP32)
            ):
                bad.append(
                    f"rank {r}: strategy {c.strategy!r}, param_dtype {c.param_dtype}, reduce_dtype {c.reduce_dtype}; "
                    f"required: fsdp with FP32 (or None) param and reduce dtypes"
                )
        if bad:
            out.append(_failure(rec, bad[0], f"{len(bad)}/{len(rec.comm)} ranks"))
    return out


def _clip(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    out = []
    for rec in arms.values():
        clip = rec.recipe.clip
        first = ""
        hits = 0
        for s, step in enumerate(rec.steps):
            for r, rank in enumerate(step.ranks):
                problem = ""
                if not rank.pre_clip_norm > clip:
                    problem = f"clip inactive: pre-clip norm {rank.pre_clip_norm:.6g} <= clip {clip:g}"
                elif not abs(rank.post_clip_norm - clip) <= CLIP_RTOL * clip:
                    problem = (
                        f"post-clip norm {rank.post_clip_norm:.8g} is not within {format_limit(CLIP_RTOL)} of "
                        f"the clip {clip:g} (rel {format_figure(_rel(rank.post_clip_norm, clip))})"
                    )
                if problem:
                    hits += 1
                    first = first or f"step {s}, rank {r}: {problem}"
        if hits:
            out.append(_failure(rec, first, f"{hits}/{_observations(rec)} rank-step observations"))
    return out


def _grads(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    out = []
    for rec in arms.values():
        first = ""
        hits = 0
        for s, step in enumerate(rec.steps):
            for r, rank in enumerate(step.ranks):
                missing = [k for k in rec.trainable_names if k not in rank.grad_dtypes]
                wrong = [
                    k for k in rec.trainable_names if k in rank.grad_dtypes and rank.grad_dtypes[k] != _FP32
                ]
                problem = ""
                if missing:
                    problem = f"{len(missing)} trainables have no gradient (first: {missing[0]})"
                elif wrong:
                    problem = f"{len(wrong)} gradients are not FP32 (first: {wrong[0]}: {rank.grad_dtypes[wrong[0]]})"
                elif rank.grad_nonfinite:
                    problem = f"{len(rank.grad_nonfinite)} gradients are not finite (first: {rank.grad_nonfinite[0]})"
                elif r == 0:
                    problem = _tensor_grad_problem(rec, step.grads)
                if problem:
                    hits += 1
                    first = first or f"step {s}, rank {r}: {problem}"
        if hits:
            out.append(_failure(rec, first, f"{hits}/{_observations(rec)} rank-step observations"))
    return out


def _tensor_grad_problem(rec: Bf16ArmRecord, grads: Mapping[str, torch.Tensor]) -> str:
    import torch

    for k in rec.trainable_names:
        g = grads.get(k)
        if g is None:
            return f"recorded gradient of {k} is missing"
        if g.dtype != torch.float32:
            return f"recorded gradient of {k} is {g.dtype}, not FP32"
        if not bool(torch.isfinite(g).all()):
            return f"recorded gradient of {k} is not finite"
    return ""


def _linear_problem(call: LinearCall, precision: str, sites: frozenset[str]) -> str:
    if call.site not in sites:
        return f"{call.site}: not a Linear site of the recipe"
    if precision == FP32_PRECISION:
        ok = call.output_dtype == _FP32 and call.param_dtype == _FP32 and not call.autocast
        want = f"output {_FP32}, parameter {_FP32}, autocast off"
    else:
        ok = (
            call.output_dtype == _BF16
            and call.param_dtype == _FP32
            and call.autocast
            and call.autocast_dtype == _BF16
        )
        want = f"output {_BF16}, parameter {_FP32}, autocast on ({_BF16})"
    if ok:
        return ""
    state = f"autocast on ({call.autocast_dtype})" if call.autocast else "autocast off"
    return f"{call.site} ({call.kind}): output {call.output_dtype}, parameter {call.param_dtype}, {state}; want {want}"


def _dtype(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    out = []
    for rec in arms.values():
        sites = frozenset(rec.linear_sites)
        first = ""
        hits = 0
        worst = 0
        if not sites:
            out.append(_failure(rec, "the recipe names no Linear site", "0 sites"))
            continue
        for s, step in enumerate(rec.steps):
            for r, rank in enumerate(step.ranks):
                invalid: dict[str, str] = {}
                for call in rank.linear:
                    problem = _linear_problem(call, rec.precision, sites)
                    if problem:
                        invalid.setdefault(call.site, problem)
                unseen = sites - {c.site for c in rank.linear}
                for site in sorted(unseen):
                    invalid.setdefault(site, f"{site}: never observed in this step")
                if invalid:
                    hits += 1
                    worst = max(worst, len(invalid))
                    first = first or f"step {s}, rank {r}: {next(iter(invalid.values()))}"
        if hits:
            out.append(
                _failure(
                    rec,
                    first,
                    f"{worst}/{len(sites)} invalid Linear sites per rank and step; {hits}/{_observations(rec)} "
                    "rank-step observations",
                )
            )
    return out


def _rows(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    ref32 = arms["ref32"]
    out = []
    seen: set[int] = set()
    ref_problem = ""
    for s, step in enumerate(ref32.steps):
        batch = step.rows[0] if len(step.rows) == 1 else ()
        if len(step.rows) != 1 or len(batch) != ref32.recipe.global_batch or len(set(batch)) != len(batch):
            ref_problem = ref_problem or (
                f"step {s}: ref32 must read one full global batch of {ref32.recipe.global_batch} distinct rows, "
                f"read {[len(x) for x in step.rows]} rows in {len(step.rows)} shards"
            )
        elif seen & set(batch):
            ref_problem = (
                ref_problem or f"step {s}: rows {sorted(seen & set(batch))[:8]} were already trained"
            )
        seen |= set(batch)
    if ref_problem:
        out.append(_failure(ref32, ref_problem, "reference rows"))
    for name, rec in arms.items():
        if name == "ref32":
            continue
        first = ""
        hits = 0
        for s, (step, ref_step) in enumerate(zip(rec.steps, ref32.steps, strict=False)):
            batch = ref_step.rows[0] if ref_step.rows else ()
            want = (batch,) if name == "ref" else tuple(batch[r::n] for r in range(n))
            if step.rows != want:
                hits += 1
                first = first or f"step {s}: read {_show(step.rows)}, expected {_show(want)}"
        if hits:
            out.append(_failure(rec, first, f"{hits}/{len(rec.steps)} steps"))
    return out


def _synchronized(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    out = []
    ddp = arms["ddp"]
    grad_bad: list[tuple[int, int]] = []
    param_bad: list[tuple[int, int]] = []
    for s, step in enumerate(ddp.steps):
        g0, p0 = step.ranks[0].grad_digests, step.ranks[0].param_digests
        for r, rank in enumerate(step.ranks):
            if any(rank.grad_digests.get(k) != g0.get(k) for k in ddp.trainable_names):
                grad_bad.append((s, r))
            if any(rank.param_digests.get(k) != p0.get(k) for k in ddp.trainable_names):
                param_bad.append((s, r))
    if grad_bad or param_bad:
        total = _observations(ddp)
        first = (grad_bad or param_bad)[0]
        what = "gradients before clipping" if grad_bad else "parameters after the update"
        groups = _digest_groups(ddp, first[0], "grad" if grad_bad else "param")
        out.append(
            _failure(
                ddp,
                f"step {first[0]}: {what} are not bitwise equal on every rank ("
                + " | ".join(fold_ranks(g) for g in groups)
                + " hold different values)",
                f"gradient replica disagreements {len(grad_bad)}/{total}; parameter disagreements "
                f"{len(param_bad)}/{total} rank-step observations",
            )
        )
    fsdp = arms["fsdp"]
    first_f = ""
    hits = 0
    for s, step in enumerate(fsdp.steps):
        g0, p0 = step.ranks[0].grad_digests, step.ranks[0].param_digests
        for r, rank in enumerate(step.ranks):
            problem = ""
            if rank.param_sharded is None or rank.grad_sharded is None:
                problem = "sharding flags were not recorded"
            else:
                unsharded = [k for k in fsdp.trainable_names if not rank.param_sharded.get(k, False)]
                unsharded += [
                    f"{k} (grad)" for k in fsdp.trainable_names if not rank.grad_sharded.get(k, False)
                ]
                if unsharded:
                    problem = (
                        f"{len(unsharded)} trainable parameters/gradients are not sharded DTensors "
                        f"(first: {unsharded[0]}); a trainable left outside fully_shard never syncs"
                    )
            if not problem and (
                any(rank.grad_digests.get(k) != g0.get(k) for k in fsdp.trainable_names)
                or any(rank.param_digests.get(k) != p0.get(k) for k in fsdp.trainable_names)
            ):
                problem = "gathered full values differ from rank 0's"
            if problem:
                hits += 1
                first_f = first_f or f"step {s}, rank {r}: {problem}"
    if hits:
        out.append(_failure(fsdp, first_f, f"{hits}/{_observations(fsdp)} rank-step observations"))
    return out


_INVARIANT_CHECKS = {
    "metadata": _metadata,
    "steps": _steps,
    "initial": _initial,
    "frozen": _frozen,
    "comm": _comm,
    "clip": _clip,
    "grads": _grads,
    "dtype": _dtype,
    "rows": _rows,
    "synchronized": _synchronized,
}


# --- scored checks --------------------------------------------------------------------------------------


def _score(role: str, arm: Bf16ArmRecord, ref: Bf16ArmRecord) -> ScoredComparison:
    failed: list[FailedCheck] = []
    label = arm.label

    def fail(check: str, detail: str) -> None:
        failed.append(FailedCheck(arm=label, check=check, fault=arm.fault, detail=detail))

    if not arm.steps or not ref.steps:
        detail = f"no step 0 recorded ({label}: {len(arm.steps)} steps, split: {len(ref.steps)})"
        for check in CRITERION_SCORED:
            fail(check, detail)
        inf_gaps = tuple(
            TensorGap(name=k, numel=0, diff=math.inf, ref_norm=0.0, floor=0.0) for k in ref.trainable_names
        )
        return ScoredComparison(
            role=role,
            label=label,
            fault=arm.fault,
            pre_norm_rel=math.inf,
            pre_norm_where=detail,
            gradients=inf_gaps,
            update_rel_l2=math.inf,
            updates=inf_gaps,
            failed=tuple(failed),
        )

    reference = ref.steps[0].ranks[0].pre_clip_norm
    pre_rel, where = -1.0, ""
    for r, rank in enumerate(arm.steps[0].ranks):
        rel = _rel(rank.pre_clip_norm, reference)
        if rel > pre_rel:
            pre_rel = rel
            where = f"rank {r}: {rank.pre_clip_norm:.8g} against split {reference:.8g}"
    if not pre_rel <= RTOL:
        fail("pre_norm", f"step 0, {where}, rel {format_figure(pre_rel)} > {format_limit(RTOL)}")

    gradients = tuple(
        tensor_gap(k, arm.steps[0].grads[k], ref.steps[0].grads[k]) for k in ref.trainable_names
    )
    over = [g for g in gradients if g.over]
    if over:
        worst = max(over, key=lambda g: g.gap)
        fail(
            "gradients",
            f"{len(over)}/{len(gradients)} tensor gradients over their bound; worst {worst.name}: "
            f"L2 diff {worst.diff:.3g} > {worst.bound:.3g} (gap {format_figure(worst.gap)})",
        )

    arm_update, ref_update = arm.step_update(0), ref.step_update(0)
    update_rel = _update_rel(arm_update, ref_update, ref.trainable_names)
    if not update_rel <= RTOL:
        fail("update", f"step-0 update rel L2 {format_figure(update_rel)} > {format_limit(RTOL)}")
    updates = tuple(
        tensor_gap(k, arm_update[k], ref_update[k], initial=ref.initial_trainable[k])
        for k in ref.trainable_names
    )
    over = [g for g in updates if g.over]
    if over:
        worst = max(over, key=lambda g: g.gap)
        fail(
            "tensor_updates",
            f"{len(over)}/{len(updates)} tensor updates over their bound; worst {worst.name}: "
            f"L2 diff {worst.diff:.3g} > {worst.bound:.3g} (gap {format_figure(worst.gap)})",
        )
    return ScoredComparison(
        role=role,
        label=label,
        fault=arm.fault,
        pre_norm_rel=pre_rel,
        pre_norm_where=where,
        gradients=gradients,
        update_rel_l2=update_rel,
        updates=updates,
        failed=tuple(failed),
    )


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


def _update_rel(
    arm: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], names: Sequence[str]
) -> float:
    diff_sq = 0.0
    base_sq = 0.0
    for k in names:
        a, b = arm[k], ref[k]
        if a.shape != b.shape:
            return math.inf
        diff_sq += float(((a - b) ** 2).sum())
        base_sq += float((b**2).sum())
    if diff_sq == 0:
        return 0.0
    if base_sq == 0 or not math.isfinite(diff_sq):
        return math.inf
    return math.sqrt(diff_sq) / math.sqrt(base_sq)


# --- diagnostics ----------------------------------------------------------------------------------------


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
        _update_rel(arm.total_update(), ref.total_update(), ref.trainable_names)
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


def _diagnostics(arms: Mapping[str, Bf16ArmRecord]) -> Diagnostics:
    ref, ref32 = arms["ref"], arms["ref32"]
    return Diagnostics(
        pairs=tuple(_pair(arms[a], arms[b]) for a, b in _DIAGNOSTIC_PAIRS),
        bf16_vs_fp32=_pair(ref, ref32),
        bf16_vs_fp32_pre_norm_rel=tuple(
            _rel(a.ranks[0].pre_clip_norm, b.ranks[0].pre_clip_norm)
            for a, b in zip(ref.steps, ref32.steps, strict=False)
        ),
    )


# --- small helpers --------------------------------------------------------------------------------------


def _rel(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    if reference == 0 or not math.isfinite(reference) or not math.isfinite(value):
        return math.inf
    return abs(value - reference) / abs(reference)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def _observations(rec: Bf16ArmRecord) -> int:
    return sum(len(s.ranks) for s in rec.steps)


def _digest_groups(rec: Bf16ArmRecord, step: int, which: str) -> list[list[int]]:
    groups: dict[tuple[str | None, ...], list[int]] = {}
    for r, rank in enumerate(rec.steps[step].ranks):
        digests = rank.grad_digests if which == "grad" else rank.param_digests
        groups.setdefault(tuple(digests.get(k) for k in rec.trainable_names), []).append(r)
    return list(groups.values())


def _show(shards: tuple[tuple[int, ...], ...], limit: int = 4) -> str:
    shown = " | ".join(",".join(map(str, s)) for s in shards[:limit])
    return shown + (f" | ... ({len(shards)} shards)" if len(shards) > limit else "")


def _short(x: float) -> str:
    """Two significant digits, as the seed's per-step diagnostic columns (``1.9e-10``, ``0.012``, ``0``)."""
    if x == 0 or not math.isfinite(x):
        return format_figure(x)
    rounded = float(f"{x:.1e}")
    if abs(rounded) < 0.01:
        mantissa, exponent = f"{rounded:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{rounded:.2g}"


def _cell(x: float | str | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format_figure(x)


def _json(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)
