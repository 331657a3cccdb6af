"""Criterion v2's results: the limits, every figure a run is judged by, and the tables they print.

Frozen dataclasses with ``to_dict()`` for the reports; the terminal's row of a result is
:func:`pytest_sprite.assertions.criterion.table.criterion_rows`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pytest_sprite.assertions.evidence import AssertionFailure, FailedCheck, attributes
from pytest_sprite.assertions.numeric import finite_or_repr
from pytest_sprite.assertions.tables import figure_cell, format_figure, format_limit, render_table
from pytest_sprite.errors import SpriteUsageError

__all__ = [
    "ABS_FLOOR",
    "CLIP_RTOL",
    "CRITERION_CHECKS",
    "CRITERION_INVARIANTS",
    "CRITERION_SCORED",
    "EPS_FP32",
    "INVARIANTS",
    "RTOL",
    "CriterionError",
    "CriterionRefused",
    "CriterionResult",
    "Diagnostics",
    "InvariantFailure",
    "InvariantResult",
    "PairDiagnostic",
    "ScoredComparison",
    "TensorGap",
    "Verdict",
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
            "diff": finite_or_repr(self.diff),
            "ref_norm": finite_or_repr(self.ref_norm),
            "floor": self.floor,
            "bound": finite_or_repr(self.bound),
            "gap": finite_or_repr(self.gap),
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
            **attributes(self, "role", "label", "fault", "passed"),
            "pre_norm_rel": finite_or_repr(self.pre_norm_rel),
            "pre_norm_where": self.pre_norm_where,
            "max_gradient_gap": finite_or_repr(self.max_gradient_gap),
            "update_rel_l2": finite_or_repr(self.update_rel_l2),
            "max_update_gap": finite_or_repr(self.max_update_gap),
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
        return {"arm": self.label, **attributes(self, "fault", "detail", "observations")}


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
            **attributes(self, "name", "description", "passed"),
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
            "max_gap": [finite_or_repr(x) for x in self.max_gap],
            "equal_tensors": list(self.equal_tensors),
            "tensors": self.tensors,
            "equal_fraction": [finite_or_repr(x) for x in self.equal_fraction],
            "five_step_update_rel_l2": finite_or_repr(self.five_step_update_rel_l2),
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
        """Per-step diagnostics: one row per pair, steps comma-separated as in criterion v2's diagnostics table."""
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
            "bf16_vs_fp32_pre_norm_rel": [finite_or_repr(x) for x in self.bf16_vs_fp32_pre_norm_rel],
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
        arm; the status is the fault's one verdict (:func:`~pytest_sprite.assertions.fault_verdict.fault_verdict`,
        which ``expect_fault_rejected`` reads too); other failed checks of the arm are listed as supporting.
        """
        from pytest_sprite.assertions.fault_verdict import fault_verdict

        out = []
        by_label = {c.label: c for c in self.scored}
        for fault, label in self.faults:
            mine = list(dict.fromkeys(f.check for f in self.failed if f.arm == label))
            others = [f for f in self.failed if f.arm != label]
            verdict = fault_verdict(fault, self.failed, kind=self.kind)
            expected = verdict.required
            rejecting = [c for c in mine if c in expected]
            rejected = verdict.rejected
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
                    "pre_norm_rel": finite_or_repr(comp.pre_norm_rel) if comp else None,
                    "max_gradient_gap": finite_or_repr(comp.max_gradient_gap) if comp else None,
                    "update_rel_l2": finite_or_repr(comp.update_rel_l2) if comp else None,
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
        """The fault table: fault, arm, status, rejecting evidence, observations, figures, tensors over."""
        rows = [
            [
                r["fault"],
                r["arm"],
                r["status"],
                ", ".join(r["rejecting_evidence"]) or "-",
                r["supporting_observations"],
                figure_cell(r["pre_norm_rel"]),
                figure_cell(r["max_gradient_gap"]),
                figure_cell(r["update_rel_l2"]),
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
            **attributes(self, "kind", "verdict", "passed", "reason", "ranks", "global_batch", "device_type"),
            "limits": {"rtol": RTOL, "abs_floor": ABS_FLOOR, "eps_fp32": EPS_FP32, "clip_rtol": CLIP_RTOL},
            "scored": [c.to_dict() for c in self.scored],
            "gate": self.gate.to_dict(),
            "invariants": [i.to_dict() for i in self.invariants],
            "diagnostics": self.diagnostics.to_dict(),
            "faults": self.rejection_rows(),
            "failed": [f.to_dict() for f in self.failed],
        }


def _short(x: float) -> str:
    """Two significant digits, as the lightning-sprite procedure's per-step diagnostic columns (``1.9e-10``, ``0.012``, ``0``)."""
    if x == 0 or not math.isfinite(x):
        return format_figure(x)
    rounded = float(f"{x:.1e}")
    if abs(rounded) < 0.01:
        mantissa, exponent = f"{rounded:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{rounded:.2g}"
