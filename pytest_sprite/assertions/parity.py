"""FP32 parity: distributed arms against the single-device reference, as the lightning-sprite procedure rules.

Every arm must match the reference within ``rtol`` (relative) on the per-step global gradient norm before
and after clipping (every rank) and on the whole-run weight update, and must leave every frozen tensor
unchanged. The lightning-sprite procedure's preconditions are checked too, because a run that breaks them is not a parity
run: every arm starts from the reference's weights, trains the reference's rows at every step (each row
once across ranks), and ends with bitwise-equal replicas. Records that cannot be compared at all (no
reference, a "distributed" arm on one device, different recipes) are refused with an error, never passed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pytest_sprite.assertions.evidence import ArmsResult, AssertionFailure, FailedCheck, attributes
from pytest_sprite.assertions.fault_verdict import item_verdict
from pytest_sprite.assertions.numeric import bit_equal, finite_or_repr, rel, rel_l2
from pytest_sprite.assertions.tables import (
    Row,
    figure_cell,
    format_count,
    format_figure,
    format_limit,
    pass_or_fail_kind,
    render_table,
)
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.recorded_results import record_assertion
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.plumbing.ranges import fold_ranks
from pytest_sprite.records import DISTRIBUTED_ARMS, FP32_PRECISION, ArmRecord

__all__ = [
    "PARITY_CHECKS",
    "PARITY_HEADERS",
    "PARITY_KIND",
    "ArmParity",
    "ParityError",
    "ParityRefused",
    "ParityResult",
    "assert_parity",
    "parity_rows",
    "parity_verdict",
]

PARITY_CHECKS: tuple[str, ...] = (
    "initial",
    "rows",
    "pre_norm",
    "post_norm",
    "update",
    "frozen",
    "synchronized",
)
"""Check names an arm can fail, in the order they are evaluated (``by=`` of ``expect_fault_rejected``)."""

PARITY_HEADERS: tuple[str, ...] = (
    "Arm",
    "Ranks",
    "Global batch",
    "rtol",
    "Pre-clip norm rel",
    "Post-clip norm rel",
    "Update rel L2",
    "Frozen changed",
)
"""The parity table's columns, as the terminal shows them (rows of many tests, so each names its rtol).

The assertion's own table is the lightning-sprite procedure's FP32 layout: the same columns with the arm's ``Result`` in place of
the rtol, which its heading gives once.
"""
_RTOL_AT = PARITY_HEADERS.index("rtol")
SEED_HEADERS: tuple[str, ...] = (*PARITY_HEADERS[:_RTOL_AT], "Result", *PARITY_HEADERS[_RTOL_AT + 1 :])


class ParityRefused(SpriteUsageError):
    """The records cannot be compared (missing reference, one-device "distributed" arm, other recipe)."""


class ParityError(AssertionFailure):
    """FP32 parity failed; ``result`` is the :class:`ParityResult` with every figure."""


@dataclass(frozen=True, kw_only=True)
class ArmParity:
    """One arm's figures against the reference, and the checks it failed."""

    label: str
    """Arm name with accumulation and fault, as in the table."""
    arm: str
    """``single``, ``ddp`` or ``fsdp``."""
    ranks: int
    """Devices the arm ran on."""
    global_batch: int
    """Rows per optimizer step."""
    accumulate: int
    """Micro-batches per optimizer step."""
    fault: str | None
    """Planted fault, None for a clean arm."""
    strategy: str
    """Lightning strategy class that ran the arm."""
    pre_norm_rel: float
    """Largest relative error of the pre-clip global gradient norm, over steps and ranks."""
    post_norm_rel: float
    """Largest relative error of the post-clip global gradient norm, over steps and ranks."""
    update_rel_l2: float
    """Relative L2 error of the whole-run update of all trainables: |du - du_ref| / |du_ref|."""
    frozen_changed: int
    """Frozen tensors whose final value (on any rank) differs from the reference's initial value."""
    frozen_total: int
    """Frozen tensors in the model."""
    failed: tuple[FailedCheck, ...]
    """Checks this arm failed, empty when it passed."""
    pre_norm_rel_steps: tuple[float, ...] = ()
    """Per step: the largest relative error of the pre-clip norm over ranks (what the plots draw)."""
    post_norm_rel_steps: tuple[float, ...] = ()
    """Per step: the largest relative error of the post-clip norm over ranks."""

    @property
    def passed(self) -> bool:
        """True when the arm failed no check."""
        return not self.failed

    def row(self) -> list[str]:
        """This arm's cells in the FP32 parity table."""
        return list(parity_cells(self.to_dict(), "pass" if self.passed else "FAIL"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (non-finite numbers as strings)."""
        return {
            **attributes(
                self, "label", "arm", "ranks", "global_batch", "accumulate", "fault", "strategy", "passed"
            ),
            "pre_norm_rel": finite_or_repr(self.pre_norm_rel),
            "post_norm_rel": finite_or_repr(self.post_norm_rel),
            "update_rel_l2": finite_or_repr(self.update_rel_l2),
            "frozen_changed": self.frozen_changed,
            "frozen_total": self.frozen_total,
            "failed": [f.to_dict() for f in self.failed],
            "pre_norm_rel_steps": [finite_or_repr(x) for x in self.pre_norm_rel_steps],
            "post_norm_rel_steps": [finite_or_repr(x) for x in self.post_norm_rel_steps],
        }


@dataclass(frozen=True, kw_only=True)
class ParityResult(ArmsResult):
    """Every arm's figures against one reference; returned on a pass, attached to the error on a failure."""

    rtol: float
    """Relative tolerance every figure was held to."""
    reference: str
    """One line describing the reference arm (device, global batch, steps, seed)."""
    arms: tuple[ArmParity, ...]
    """One entry per compared arm, in the order given."""

    def table(self) -> str:
        """The FP32 parity table: arm, ranks, global batch, result and the four figures."""
        return render_table(SEED_HEADERS, [a.row() for a in self.arms])

    def report(self) -> str:
        """Heading, table and one line per failed check: the text of the AssertionError."""
        bad = [a for a in self.arms if not a.passed]
        verdict = "passed" if not bad else f"failed: {len(bad)} of {len(self.arms)} arms"
        lines = [
            f"FP32 parity {verdict} (rtol {format_limit(self.rtol)}; reference: {self.reference})",
            "",
            self.table(),
        ]
        if bad:
            lines += ["", "Failed checks:"]
            lines += [f"  {f.arm}: {f.check}: {f.detail}" for f in self.failed]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures of this result (for a report or an offline record)."""
        return {
            "kind": "parity",
            **attributes(self, "rtol", "reference", "passed"),
            "arms": [a.to_dict() for a in self.arms],
        }


def parity_cells(arm: Mapping[str, Any], rtol_cell: str) -> tuple[str, ...]:
    """One arm's payload as the cells under :data:`PARITY_HEADERS` (``rtol_cell`` under ``rtol``)."""
    return (
        arm["label"],
        str(arm["ranks"]),
        str(arm["global_batch"]),
        rtol_cell,
        figure_cell(arm["pre_norm_rel"]),
        figure_cell(arm["post_norm_rel"]),
        figure_cell(arm["update_rel_l2"]),
        format_count(arm["frozen_changed"], arm["frozen_total"]),
    )


def parity_verdict(arm: Mapping[str, Any], payload: Mapping[str, Any]) -> str:
    """``pass`` / ``FAIL`` for a clean arm; the fault's verdict (``rejected`` / ``NOT REJECTED``) for an arm
    carrying one, judged from every check the assertion failed."""
    return item_verdict(arm, payload)


def parity_rows(payload: Mapping[str, Any]) -> list[Row]:
    """One row per arm, in the lightning-sprite procedure's FP32 layout, with the tolerance the arm was held to."""
    rtol = format_limit(float(payload["rtol"]))
    return [
        Row(
            cells=parity_cells(arm, rtol),
            verdict=parity_verdict(arm, payload),
            figures={
                "pre_norm_rel": arm["pre_norm_rel"],
                "post_norm_rel": arm["post_norm_rel"],
                "update_rel_l2": arm["update_rel_l2"],
                "frozen_changed": arm["frozen_changed"],
                "rtol": payload["rtol"],
            },
            label=arm["label"],
        )
        for arm in payload["arms"]
    ]


PARITY_KIND = pass_or_fail_kind(
    "parity", "FP32 parity against the single-device reference", PARITY_HEADERS, parity_rows
)
"""How the reports show a parity payload (``pytest_sprite.report.kinds`` registers it)."""


@phase("judging")
def assert_parity(ref: ArmRecord, *arms: ArmRecord, rtol: float = 1e-4) -> ParityResult:
    """Require every arm to match the single-device FP32 reference within ``rtol``; return the figures.

    Raises :class:`ParityError` (an ``AssertionError``) with the parity table when any arm fails a check,
    and :class:`ParityRefused` when the records cannot be compared at all.
    """
    _check_inputs(ref, arms, rtol)
    result = ParityResult(
        rtol=rtol,
        reference=(
            f"single on 1 {ref.device_type} device, global batch {ref.recipe.global_batch}, "
            f"{ref.recipe.steps} steps, seed {ref.recipe.seed}, clip {ref.recipe.clip:g}, lr {ref.recipe.lr:g}"
        ),
        arms=tuple(_compare(ref, arm, rtol) for arm in arms),
    )
    record_assertion(result, inputs=[r.source for r in (ref, *arms)])
    if not result.passed:
        raise ParityError(result.report(), failed=result.failed, result=result)
    return result


def _configuration(rec: ArmRecord) -> tuple[object, ...]:
    """What makes a one-device arm another configuration than the reference."""
    return (rec.arm, rec.strategy, rec.precision, rec.accumulate, rec.fault)


def _describe_configuration(rec: ArmRecord) -> str:
    strategy = rec.strategy.rsplit(".", 1)[-1]
    fault = f", fault {rec.fault}" if rec.fault else ""
    return f"strategy {strategy}, precision {rec.precision}, accumulate {rec.accumulate}{fault}"


def _check_inputs(ref: object, arms: Sequence[object], rtol: object) -> None:
    if not isinstance(rtol, (int, float)) or isinstance(rtol, bool) or not (0 < rtol < 1):
        raise ParityRefused(
            f"rtol must be a number in (0, 1), got {rtol!r}; the FP32 parity rule uses rtol=1e-4"
        )
    if ref is None:
        raise ParityRefused(
            "assert_parity needs the single-device reference first, got None; "
            'pass lora_qwen.run("single") as the first argument'
        )
    for i, rec in enumerate([ref, *arms]):
        if not isinstance(rec, ArmRecord):
            what = "the reference" if i == 0 else f"arm {i}"
            raise ParityRefused(
                f"{what} must be an ArmRecord (from lora_qwen.run(...) or load_arm_record), got {type(rec).__name__}"
            )
    ref = cast(ArmRecord, ref)
    if not arms:
        raise ParityRefused(
            'assert_parity needs at least one arm to compare with the reference, e.g. lora_qwen.run("ddp")'
        )
    if ref.arm != "single" or ref.world_size != 1:
        raise ParityRefused(
            f"the reference must be the 'single' arm on 1 device, got {ref.arm!r} on {ref.world_size}; "
            'pass lora_qwen.run("single") first'
        )
    if ref.fault is not None:
        raise ParityRefused(
            f"the reference must be clean, it carries fault {ref.fault!r}; plant faults in the arms"
        )
    for i, rec in enumerate(cast("list[ArmRecord]", [ref, *arms])):
        _check_arm(i, rec, ref)
    clip = ref.recipe.clip
    for step, (norm,) in enumerate(ref.pre_clip_norms):
        if not norm > clip:
            raise ParityRefused(
                f"the clip is not active in the reference at step {step}: pre-clip norm {norm:.6g} <= clip {clip:g}; "
                "the FP32 parity rule needs an active global-norm clip at every step: pass a smaller clip="
            )


def _check_arm(i: int, rec: ArmRecord, ref: ArmRecord) -> None:
    """Refuse arm ``i`` (0: the reference) of another precision, a one-device distributed arm, the reference
    run again, another recipe or other parameter names."""
    if rec.precision != FP32_PRECISION:
        raise ParityRefused(
            f"assert_parity is the FP32 check: arm {rec.label!r} ran precision={rec.precision!r}, allowed: "
            f"{FP32_PRECISION!r}; judge BF16 arms with the BF16 criterion"
        )
    if rec.arm in DISTRIBUTED_ARMS and rec.world_size < 2:
        raise ParityRefused(
            f"arm {rec.label!r} is distributed but ran on {rec.world_size} device; a one-device run proves "
            "nothing about synchronization: run it in a test marked @pytest.mark.ranks(n) with n >= 2"
        )
    if i > 0 and rec.world_size == 1 and _configuration(rec) == _configuration(ref):
        raise ParityRefused(
            f"arm {rec.label!r} ran on 1 device with the reference's own configuration "
            f"({_describe_configuration(rec)}): it is the reference run again and proves nothing about "
            "distributed training, whose arms must have run on more than one device; compare "
            'lora_qwen.run("ddp") or lora_qwen.run("fsdp") from a test marked @pytest.mark.ranks(n) with '
            "n >= 2, or a one-device arm of another configuration (strategy=, precision= or accumulate=)"
        )
    diffs = ref.recipe.differences(rec.recipe)
    if diffs:
        raise ParityRefused(
            f"arm {rec.label!r} ran a different recipe than the reference ({'; '.join(diffs)}; "
            "reference first); run every arm from the same lora_qwen with the same steps, global_batch and clip"
        )
    if rec.trainable_names != ref.trainable_names or rec.frozen_names != ref.frozen_names:
        raise ParityRefused(
            f"arm {rec.label!r} has other parameter names than the reference "
            f"({len(rec.trainable_names)} trainable / {len(rec.frozen_names)} frozen against "
            f"{len(ref.trainable_names)} / {len(ref.frozen_names)}); the strategy must keep the model's names"
        )


def _compare(ref: ArmRecord, arm: ArmRecord, rtol: float) -> ArmParity:
    failed: list[FailedCheck] = []

    def fail(check: str, detail: str) -> None:
        failed.append(FailedCheck(arm=arm.label, check=check, fault=arm.fault, detail=detail))

    initial_bad = _initial_bad(ref, arm)
    if initial_bad:
        fail(
            "initial",
            f"{len(initial_bad)} tensors differ from the reference before the first step "
            f"(first: {initial_bad[0]}); every arm must start from bit-identical weights",
        )
    rows = _first_rows_problem(ref, arm)
    if rows:
        fail("rows", rows)
    pre = _norm_rel(ref.pre_clip_norms, arm.pre_clip_norms)
    post = _norm_rel(ref.post_clip_norms, arm.post_clip_norms)
    for check, worst in (("pre_norm", pre), ("post_norm", post)):
        if not worst[0] <= rtol:
            fail(check, _norm_detail(worst, rtol))
    update_rel = _update_rel(ref, arm)
    if not update_rel <= rtol:
        fail("update", f"whole-run update rel L2 {format_figure(update_rel)} > rtol {format_limit(rtol)}")
    changed = _frozen_changed(ref, arm)
    if changed:
        fail(
            "frozen",
            f"{format_count(len(changed), len(ref.frozen_names))} frozen tensors changed "
            f"(first: {changed[0]}); frozen weights must never move",
        )
    groups = _rank_groups(arm.final_trainable_digests)
    if len(groups) > 1:
        held = " | ".join(fold_ranks(g) for g in groups)
        fail(
            "synchronized",
            f"final trainables are not bitwise equal on every rank: {held} hold different values; "
            "a tensor is left out of gradient synchronization",
        )
    return ArmParity(
        label=arm.label,
        arm=arm.arm,
        ranks=arm.world_size,
        global_batch=arm.recipe.global_batch,
        accumulate=arm.accumulate,
        fault=arm.fault,
        strategy=arm.strategy,
        pre_norm_rel=pre[0],
        post_norm_rel=post[0],
        update_rel_l2=update_rel,
        frozen_changed=len(changed),
        frozen_total=len(ref.frozen_names),
        failed=tuple(failed),
        pre_norm_rel_steps=_norm_rel_steps(ref.pre_clip_norms, arm.pre_clip_norms),
        post_norm_rel_steps=_norm_rel_steps(ref.post_clip_norms, arm.post_clip_norms),
    )


def _first_rows_problem(ref: ArmRecord, arm: ArmRecord) -> str:
    """The first step at which the arm did not train the reference's rows, each once ("" when none)."""
    for step, (ref_rows, per_rank) in enumerate(zip(ref.rows_seen, arm.rows_seen, strict=True)):
        detail = _rows_problem(ref_rows[0], per_rank)
        if detail:
            return f"step {step}: {detail}"
    return ""


def _initial_bad(ref: ArmRecord, arm: ArmRecord) -> list[str]:
    """Tensors that differ from the reference's before the first step (trainables bit for bit, frozen by
    digest)."""
    bad = [
        n for n in ref.trainable_names if not bit_equal(arm.initial_trainable[n], ref.initial_trainable[n])
    ]
    return bad + [n for n in ref.frozen_names if arm.frozen_initial.get(n) != ref.frozen_initial.get(n)]


def _frozen_changed(ref: ArmRecord, arm: ArmRecord) -> list[str]:
    """Frozen tensors whose final digest on any rank differs from the reference's initial one."""
    return [
        n
        for n in ref.frozen_names
        if any(rank_digests.get(n) != ref.frozen_initial[n] for rank_digests in arm.frozen_final)
    ]


def _norm_rel_steps(
    ref: tuple[tuple[float, ...], ...], arm: tuple[tuple[float, ...], ...]
) -> tuple[float, ...]:
    """Per step, the largest relative error over ranks (nan counts as infinite)."""
    return tuple(
        max((rel(v, ref_step[0]) for v in arm_step), default=0.0)
        for ref_step, arm_step in zip(ref, arm, strict=True)
    )


def _norm_rel(
    ref: tuple[tuple[float, ...], ...], arm: tuple[tuple[float, ...], ...]
) -> tuple[float, int, int, float, float]:
    """Largest relative error over steps and ranks, with where it occurs and both values."""
    worst = (-1.0, 0, 0, math.nan, math.nan)
    for step, (ref_step, arm_step) in enumerate(zip(ref, arm, strict=True)):
        for rank, value in enumerate(arm_step):
            value_rel = rel(value, ref_step[0])
            if value_rel > worst[0]:
                worst = (value_rel, step, rank, value, ref_step[0])
    return worst if worst[0] >= 0 else (0.0, 0, 0, math.nan, math.nan)


def _norm_detail(worst: tuple[float, int, int, float, float], rtol: float) -> str:
    rel, step, rank, value, reference = worst
    return (
        f"step {step}, rank {rank}: {value:.6g} against reference {reference:.6g}, "
        f"rel {format_figure(rel)} > rtol {format_limit(rtol)}"
    )


def _update_rel(ref: ArmRecord, arm: ArmRecord) -> float:
    return rel_l2(arm.update_vector(), ref.update_vector())


def _rows_problem(reference: tuple[int, ...], per_rank: tuple[tuple[int, ...], ...]) -> str | None:
    seen = sorted(i for rank_rows in per_rank for i in rank_rows)
    expected = sorted(reference)
    if seen == expected:
        return None
    counts: dict[int, int] = {}
    for i in seen:
        counts[i] = counts.get(i, 0) + 1
    repeated = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(expected) - set(counts))
    foreign = sorted(set(counts) - set(expected))
    parts = [f"trained {len(seen)} rows, the reference {len(expected)} ({_ids(expected)})"]
    if repeated:
        parts.append(f"rows read by more than one rank: {_ids(repeated)}")
    if missing:
        parts.append(f"rows no rank read: {_ids(missing)}")
    if foreign:
        parts.append(f"rows outside this step: {_ids(foreign)}")
    same = len(per_rank) > 1 and all(r == per_rank[0] for r in per_rank)
    if same:
        parts.append("every rank read the same rows: the sampler ignores the rank")
    return "; ".join(parts)


def _ids(ids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in ids[:limit])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


def _rank_groups(digests: tuple[str, ...]) -> list[list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    return list(groups.values())
