"""Criterion v2's invariants: checked on every arm and every step; any that fails fails the run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from pytest_sprite.assertions.criterion.results import (
    CLIP_RTOL,
    INVARIANTS,
    InvariantFailure,
    InvariantResult,
)
from pytest_sprite.assertions.numeric import bit_equal, rel
from pytest_sprite.assertions.tables import format_figure, format_limit
from pytest_sprite.plumbing.ranges import fold_ranks
from pytest_sprite.records import (
    BF16_SINGLE_DEVICE_ARMS,
    FP32_PRECISION,
    Bf16ArmRecord,
    Bf16StepRecord,
    LinearCall,
    RankStep,
)

if TYPE_CHECKING:
    import torch


__all__ = ["check_invariants"]

_Problem = Callable[[Bf16ArmRecord, int, int, Bf16StepRecord, RankStep], str]
"""What is wrong at one arm, step index, rank index, step and rank: ``""`` when nothing is."""
_FP32 = "torch.float32"
_BF16 = "torch.bfloat16"


def check_invariants(arms: Mapping[str, Bf16ArmRecord]) -> tuple[InvariantResult, ...]:
    """Every invariant over every arm and step, in evaluation order."""
    n = arms["ddp"].world_size
    return tuple(
        InvariantResult(name=name, description=INVARIANTS[name], failures=tuple(check(arms, n)))
        for name, check in _INVARIANT_CHECKS.items()
    )


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
            if not bit_equal(rec.initial_trainable[nm], ref32.initial_trainable[nm])
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

    def changed(rec: Bf16ArmRecord, s: int, r: int, step: Bf16StepRecord, rank: RankStep) -> str:
        moved = [k for k in rec.frozen_names if rank.frozen_digests.get(k) != want.get(k)]
        if not moved:
            return ""
        return f"{len(moved)} of {len(rec.frozen_names)} frozen tensors changed (first: {moved[0]})"

    return _per_observation(arms, changed)


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
    def problem(rec: Bf16ArmRecord, s: int, r: int, step: Bf16StepRecord, rank: RankStep) -> str:
        clip = rec.recipe.clip
        if not rank.pre_clip_norm > clip:
            return f"clip inactive: pre-clip norm {rank.pre_clip_norm:.6g} <= clip {clip:g}"
        if not abs(rank.post_clip_norm - clip) <= CLIP_RTOL * clip:
            return (
                f"post-clip norm {rank.post_clip_norm:.8g} is not within {format_limit(CLIP_RTOL)} of "
                f"the clip {clip:g} (rel {format_figure(rel(rank.post_clip_norm, clip))})"
            )
        return ""

    return _per_observation(arms, problem)


def _grads(arms: Mapping[str, Bf16ArmRecord], n: int) -> list[InvariantFailure]:
    def problem(rec: Bf16ArmRecord, s: int, r: int, step: Bf16StepRecord, rank: RankStep) -> str:
        missing = [k for k in rec.trainable_names if k not in rank.grad_dtypes]
        wrong = [k for k in rec.trainable_names if k in rank.grad_dtypes and rank.grad_dtypes[k] != _FP32]
        if missing:
            return f"{len(missing)} trainables have no gradient (first: {missing[0]})"
        if wrong:
            return f"{len(wrong)} gradients are not FP32 (first: {wrong[0]}: {rank.grad_dtypes[wrong[0]]})"
        if rank.grad_nonfinite:
            return f"{len(rank.grad_nonfinite)} gradients are not finite (first: {rank.grad_nonfinite[0]})"
        if r == 0:
            return _tensor_grad_problem(rec, step.grads)
        return ""

    return _per_observation(arms, problem)


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
    return [f for f in map(_dtype_failure, arms.values()) if f is not None]


def _dtype_failure(rec: Bf16ArmRecord) -> InvariantFailure | None:
    sites = frozenset(rec.linear_sites)
    if not sites:
        return _failure(rec, "the recipe names no Linear site", "0 sites")
    worst = 0

    def problem(rec: Bf16ArmRecord, s: int, r: int, step: Bf16StepRecord, rank: RankStep) -> str:
        nonlocal worst
        invalid = _invalid_sites(rank, rec.precision, sites)
        worst = max(worst, len(invalid))
        return next(iter(invalid.values()), "")

    hits, first = _observe(rec, problem)
    if not hits:
        return None
    return _failure(
        rec,
        first,
        f"{worst}/{len(sites)} invalid Linear sites per rank and step; {hits}/{_observations(rec)} "
        "rank-step observations",
    )


def _invalid_sites(rank: RankStep, precision: str, sites: frozenset[str]) -> dict[str, str]:
    """Linear site -> its first problem at this rank and step (a wrong dtype, or never observed)."""
    invalid: dict[str, str] = {}
    for call in rank.linear:
        problem = _linear_problem(call, precision, sites)
        if problem:
            invalid.setdefault(call.site, problem)
    for site in sorted(sites - {c.site for c in rank.linear}):
        invalid.setdefault(site, f"{site}: never observed in this step")
    return invalid


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
    return out + _per_observation({"fsdp": arms["fsdp"]}, _fsdp_problem)


def _fsdp_problem(rec: Bf16ArmRecord, s: int, r: int, step: Bf16StepRecord, rank: RankStep) -> str:
    if rank.param_sharded is None or rank.grad_sharded is None:
        return "sharding flags were not recorded"
    unsharded = [k for k in rec.trainable_names if not rank.param_sharded.get(k, False)]
    unsharded += [f"{k} (grad)" for k in rec.trainable_names if not rank.grad_sharded.get(k, False)]
    if unsharded:
        return (
            f"{len(unsharded)} trainable parameters/gradients are not sharded DTensors "
            f"(first: {unsharded[0]}); a trainable left outside fully_shard never syncs"
        )
    g0, p0 = step.ranks[0].grad_digests, step.ranks[0].param_digests
    if any(rank.grad_digests.get(k) != g0.get(k) for k in rec.trainable_names) or any(
        rank.param_digests.get(k) != p0.get(k) for k in rec.trainable_names
    ):
        return "gathered full values differ from rank 0's"
    return ""


def _per_observation(arms: Mapping[str, Bf16ArmRecord], problem: _Problem) -> list[InvariantFailure]:
    """One failure per arm where ``problem`` finds something at some rank and step: the first problem, and
    how many of the arm's rank-step observations had one."""
    out = []
    for rec in arms.values():
        hits, first = _observe(rec, problem)
        if hits:
            out.append(_failure(rec, first, f"{hits}/{_observations(rec)} rank-step observations"))
    return out


def _observe(rec: Bf16ArmRecord, problem: _Problem) -> tuple[int, str]:
    """How many rank-step observations of ``rec`` have a problem, and the first, with its step and rank."""
    hits, first = 0, ""
    for s, step in enumerate(rec.steps):
        for r, rank in enumerate(step.ranks):
            found = problem(rec, s, r, step, rank)
            if found:
                hits += 1
                first = first or f"step {s}, rank {r}: {found}"
    return hits, first


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
