"""The resume check's comparisons: a restore against the save, the continuation against the fit, and the
figures that are reported, never required. Pure: torch is imported only to compare tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_sprite.assertions.numeric import bit_equal, rel, same_float, tensor_rel
from pytest_sprite.assertions.resume.results import ResumeGaps
from pytest_sprite.plumbing.ranges import fold_ranks
from pytest_sprite.records import RoleRecord, StateCapture

if TYPE_CHECKING:
    pass

__all__ = ["continuation", "continuation_gaps", "first_departure", "fold", "restore_problems", "rng", "twin"]

_SHOWN = 4

# bit-for-bit helpers


def _same_value(a: Any, b: Any) -> bool:
    """Bitwise for floats and tensors, recursively for containers, ``==`` otherwise."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bit_equal(a, b)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and same_float(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def _show(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"{value.item()!r} ({value.dtype})"
        return f"tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, float):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


# -------------------------------------------------------------------------------------------------------
# restore checks: one restored capture against the capture taken inside the save


def _optimizer_problems(restored: StateCapture, saved: StateCapture, *, same_world: bool) -> list[str]:
    """What differs in the optimizer state (values bit for bit, and the devices they live on)."""
    opt: list[str] = []
    for name, saved_state in saved.optimizer.items():
        got = restored.optimizer.get(name, {})
        absent = [k for k in saved_state if k not in got]
        if absent:
            opt.append(f"{name}: state {', '.join(absent)} missing")
            continue
        for key, value in saved_state.items():
            if not _same_value(got[key], value):
                opt.append(f"{name}: state {key!r} {_show(got[key])} != saved {_show(value)}")
                break
        saved_dev = saved.optimizer_devices.get(name, {})
        got_dev = restored.optimizer_devices.get(name, {})
        for key, dev in saved_dev.items():
            theirs = got_dev.get(key)
            if theirs is None:
                continue
            if (theirs != dev) if same_world else (theirs.split(":")[0] != dev.split(":")[0]):
                opt.append(f"{name}: state {key!r} on {theirs}, saved on {dev}")
                break
    extra = [n for n in restored.optimizer if n not in saved.optimizer and restored.optimizer[n]]
    if extra:
        opt.append(f"state for parameters the save had none for: {_names(extra)}")
    return opt


def restore_problems(restored: StateCapture, saved: StateCapture, *, same_world: bool) -> dict[str, str]:
    """Check name -> what differs, for every restore check this capture fails."""
    problems: dict[str, str] = {}

    missing = [n for n in saved.trainables if n not in restored.trainables]
    differ = [
        n
        for n in saved.trainables
        if n in restored.trainables and not bit_equal(restored.trainables[n], saved.trainables[n])
    ]
    if missing or differ:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if differ:
            parts.append(f"{len(differ)} of {len(saved.trainables)} differ from the save, first {differ[0]}")
        problems["trainables"] = "; ".join(parts)

    opt = _optimizer_problems(restored, saved, same_world=same_world)
    if opt:
        more = f" (and {len(opt) - 1} more)" if len(opt) > 1 else ""
        problems["optimizer_state"] = opt[0] + more

    groups: list[str] = []
    if len(restored.param_groups) != len(saved.param_groups):
        groups.append(f"{len(restored.param_groups)} param groups, the save had {len(saved.param_groups)}")
    for i, (got_g, saved_g) in enumerate(zip(restored.param_groups, saved.param_groups, strict=False)):
        for key in sorted(set(saved_g) | set(got_g)):
            if not _same_value(got_g.get(key), saved_g.get(key)):
                groups.append(
                    f"group {i} {key!r}: {_show(got_g.get(key))} != saved {_show(saved_g.get(key))}"
                )
                break
    if groups:
        problems["param_groups"] = groups[0]

    for key in sorted(set(saved.scheduler) | set(restored.scheduler)):
        if not _same_value(restored.scheduler.get(key), saved.scheduler.get(key)):
            problems["lr_scheduler"] = (
                f"{key} {_show(restored.scheduler.get(key))} != saved {_show(saved.scheduler.get(key))}"
            )
            break

    frozen = [n for n in saved.frozen if restored.frozen.get(n) != saved.frozen[n]]
    if frozen:
        problems["frozen"] = (
            f"{len(frozen)} of {len(saved.frozen)} frozen tensors differ from the save ({_names(frozen)})"
        )

    if (restored.global_step, restored.epochs_done) != (saved.global_step, saved.epochs_done):
        problems["loop"] = (
            f"restored at global step {restored.global_step}, epoch {restored.epochs_done}; saved at "
            f"global step {saved.global_step}, epoch {saved.epochs_done}"
        )
    return problems


# -------------------------------------------------------------------------------------------------------
# continuation checks


def _step_rows(records: Sequence[RoleRecord], step: int) -> list[tuple[int, ...]] | None:
    per_rank = []
    for r in records:
        s = r.step(step)
        if s is None:
            return None
        per_rank.append(s.rows)
    return per_rank


def _first_loss_problem(arm_records: Sequence[RoleRecord], killed: Sequence[RoleRecord]) -> str:
    """The first resumed step's loss against the killed fit's, bit for bit on every rank ("" when equal)."""
    first = arm_records[0].steps[0].step
    bad = []
    for r_arm, r_killed in zip(arm_records, killed, strict=True):
        mine, theirs = r_arm.step(first), r_killed.step(first)
        if mine is None or theirs is None:
            bad.append((r_arm.rank, "step missing"))
        elif not same_float(mine.loss, theirs.loss):
            bad.append((r_arm.rank, f"{mine.loss!r} != killed fit's {theirs.loss!r}"))
    return f"step {first}: " + fold(bad) if bad else ""


def continuation(
    arm_records: Sequence[RoleRecord],
    fit: Sequence[RoleRecord],
    killed: Sequence[RoleRecord] | None,
    *,
    same_world: bool,
) -> dict[str, str]:
    problems: dict[str, str] = {}
    if not arm_records[0].steps:
        return problems
    if killed is not None and same_world:
        first_loss = _first_loss_problem(arm_records, killed)
        if first_loss:
            problems["first_loss"] = first_loss

    lr_bad: list[str] = []
    rows_bad: list[str] = []
    for s in sorted({s.step for r in arm_records for s in r.steps}):
        ref = fit[0].step(s)
        if ref is None:
            rows_bad.append(f"step {s}: the uninterrupted fit has no step {s}")
            break
        lrs = [(r.rank, r.step(s)) for r in arm_records]
        wrong = [
            (rank, f"{st.lr!r} != fit's {ref.lr!r}")
            for rank, st in lrs
            if st is not None and not same_float(st.lr, ref.lr)
        ]
        if wrong and not lr_bad:
            lr_bad.append(f"step {s}: " + fold(wrong))
        if rows_bad:
            continue
        positions = {(st.epoch, st.batch) for _, st in lrs if st is not None}
        if positions != {(ref.epoch, ref.batch)}:
            got = ", ".join(f"epoch {e} batch {b}" for e, b in sorted(positions))
            rows_bad.append(f"step {s}: trained at {got}, the fit at epoch {ref.epoch} batch {ref.batch}")
            continue
        rows_mine = _step_rows(arm_records, s)
        rows_theirs = _step_rows(fit, s)
        if rows_mine is None or rows_theirs is None:
            rows_bad.append(f"step {s}: a rank has no record of the step")
        elif same_world and rows_mine != rows_theirs:
            ranks = [r for r, (a, b) in enumerate(zip(rows_mine, rows_theirs, strict=True)) if a != b]
            r0 = ranks[0]
            rows_bad.append(
                f"step {s}: {fold_ranks(ranks)} trained other rows (rank {r0}: {list(rows_mine[r0])} != fit's "
                f"{list(rows_theirs[r0])})"
            )
        elif sorted(i for rows in rows_mine for i in rows) != sorted(i for rows in rows_theirs for i in rows):
            rows_bad.append(
                f"step {s}: the ranks together trained {sorted(i for rows in rows_mine for i in rows)}, the fit "
                f"{sorted(i for rows in rows_theirs for i in rows)}"
            )
    if lr_bad:
        problems["lr"] = lr_bad[0]
    if rows_bad:
        problems["rows"] = rows_bad[0]
    return problems


def fold(per_rank: Sequence[tuple[int, str]]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, text in per_rank:
        groups.setdefault(text, []).append(rank)
    return "; ".join(f"{fold_ranks(ranks)}: {text}" for text, ranks in groups.items())


# -------------------------------------------------------------------------------------------------------
# reported figures


def _mean_loss(records: Sequence[RoleRecord], step: int) -> float | None:
    losses = [r.step(step) for r in records]
    if any(s is None for s in losses):
        return None
    return sum(s.loss for s in losses if s is not None) / len(losses)


def continuation_gaps(
    label: str, arm: Sequence[RoleRecord], fit: Sequence[RoleRecord], checkpoint: StateCapture
) -> ResumeGaps:
    loss = pre = 0.0
    for s in sorted({s.step for s in arm[0].steps}):
        mine, theirs = _mean_loss(arm, s), _mean_loss(fit, s)
        if mine is None or theirs is None:
            loss = math.inf
        else:
            loss = max(loss, rel(mine, theirs))
        a, b = arm[0].step(s), fit[0].step(s)
        pre = max(pre, math.inf if a is None or b is None else rel(a.pre_clip_norm, b.pre_clip_norm))
    end_arm = arm[0].saves[-1] if arm[0].saves else None
    end_fit = fit[0].saves[-1] if fit[0].saves else None
    update = m = v = math.inf
    if end_arm is not None and end_fit is not None:
        update = max(
            (
                tensor_rel(
                    end_arm.trainables[n],
                    end_fit.trainables[n],
                    end_fit.trainables[n] - checkpoint.trainables[n],
                )
                for n in end_fit.trainables
                if n in end_arm.trainables
            ),
            default=math.inf,
        )
        m = _moment_gap(end_arm, end_fit, "exp_avg")
        v = _moment_gap(end_arm, end_fit, "exp_avg_sq")
    return ResumeGaps(arm=label, loss=loss, pre_clip_norm=pre, update=update, adam_m=m, adam_v=v)


def _moment_gap(arm: StateCapture, fit: StateCapture, key: str) -> float:
    worst = 0.0
    for name, state in fit.optimizer.items():
        theirs = state.get(key)
        mine = arm.optimizer.get(name, {}).get(key)
        if theirs is None:
            continue
        if mine is None:
            return math.inf
        worst = max(worst, tensor_rel(mine, theirs, theirs))
    return worst


def first_departure(arm: Sequence[RoleRecord], fit: Sequence[RoleRecord]) -> str:
    for s in sorted({s.step for s in arm[0].steps}):
        for r_arm, r_fit in zip(arm, fit, strict=False):
            a, b = r_arm.step(s), r_fit.step(s)
            if a is None or b is None:
                return f"step {s} (rank {r_arm.rank} has no record of it)"
            for what, x, y in (
                ("rows", a.rows, b.rows),
                ("lr", a.lr, b.lr),
                ("loss", a.loss, b.loss),
                ("pre-clip norm", a.pre_clip_norm, b.pre_clip_norm),
            ):
                if not _same_value(x, y):
                    return f"step {s}, rank {r_arm.rank}: {what} {x!r} != fit's {y!r}"
    return "never (every resumed step matches bit for bit)"


def twin(fit: Sequence[RoleRecord], twin: Sequence[RoleRecord]) -> str:
    departs = first_departure(twin, fit)
    if not departs.startswith("never"):
        return f"differs from the fit at {departs}: a fault-free fit is not reproducible here"
    for r_fit, r_twin in zip(fit, twin, strict=True):
        for i, (a, b) in enumerate(zip(r_fit.saves, r_twin.saves, strict=False)):
            for name in a.trainables:
                if not bit_equal(a.trainables[name], b.trainables[name]):
                    return (
                        f"differs from the fit in save {i}, rank {r_fit.rank}, {name}: not reproducible here"
                    )
    return "reproduces the fit bit for bit"


def rng(arm: Sequence[RoleRecord], fit: Sequence[RoleRecord]) -> str:
    differ: dict[int, int] = {}
    for r_arm, r_fit in zip(arm, fit, strict=False):
        for s in r_arm.steps:
            theirs = r_fit.step(s.step)
            if theirs is not None and s.rng != theirs.rng:
                differ[r_arm.rank] = s.step
                break
    if not differ:
        return "match the uninterrupted fit on every rank"
    first = min(differ.values())
    return (
        f"differ from the uninterrupted fit on {fold_ranks(differ)} from step {first} (Lightning does not "
        "checkpoint RNG state; a recipe that draws random numbers while training, such as dropout, resumes "
        "with other draws)"
    )
