"""Checkpoint resume, bit for bit: the lightning-sprite seed's "Checkpoints" rule as an assertion.

Required, bit for bit, on every rank: the state a resume restores equals the state captured inside the save
(trainable tensors, AdamW state and its devices, param groups, LR scheduler, digests of every frozen tensor,
the loop position); the first resumed step's loss equals the killed fit's loss for that step; the LR of every
step matches the uninterrupted fit; the same rows are trained at every step. The reload of the checkpoint
the resume wrote, the resume at half the world (FSDP2) and the resume on one device (DDP, full-state FSDP2)
must restore exactly too, and train the same LRs and rows.

Reported, never required: continuation gaps against the uninterrupted fit (loss and pre-clip norm over the
resumed steps, each trainable's final update, Adam's moments; DDP rebuilds its buckets on a process's second
iteration, so a correct resume reduces in another order), whether the twin fit reproduced the fit at all,
and whether the resumed run's RNG streams match (Lightning does not checkpoint RNG state).

The comparison is pure: it reads a :class:`~pytest_sprite.records.ResumeRun` and imports torch only to
compare tensors. :func:`assert_resume_bitexact` runs the roles (in sub-worlds; the recipe stores the run as
``resume-run.pt``, under ``--sprite-artifacts`` or beside the checkpoints), judges them, and leaves a
manifest beside the stored run, so ``python -m pytest_sprite judge DIR`` judges it again offline.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_sprite._ranges import fold_ranks
from pytest_sprite._results import record_assertion
from pytest_sprite.assertions._evidence import AssertionFailure, FailedCheck
from pytest_sprite.assertions._tables import format_figure, render_table
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.records import ResumeRun, RoleRecord, StateCapture

if TYPE_CHECKING:
    import torch

__all__ = [
    "RESTORE_CHECKS",
    "RESUME_CHECKS",
    "ResumeArm",
    "ResumeError",
    "ResumeGaps",
    "ResumeResult",
    "assert_resume_bitexact",
    "judge_resume",
]

RESTORE_CHECKS: tuple[str, ...] = (
    "trainables",
    "optimizer_state",
    "param_groups",
    "lr_scheduler",
    "frozen",
    "loop",
)
"""What a restore must reproduce exactly, against the state captured inside the save."""
RESUME_CHECKS: tuple[str, ...] = (*RESTORE_CHECKS, "first_loss", "lr", "rows")
"""Every required check, in evaluation order (``by=`` of ``expect_fault_rejected`` names these)."""

_VERDICT_HEADERS = (
    "Run",
    "Ranks",
    "Global batch",
    "Reshard ranks",
    "Required restore, continuation, reshard, export",
)
_GAP_HEADERS = (
    "Run",
    "Arm",
    "Reported loss gap",
    "Reported pre-clip norm gap",
    "Reported update gap",
    "Reported Adam first-moment gap",
    "Reported Adam second-moment gap",
)
_ARM_HEADERS = ("Arm", "Role", "Ranks", "Loads", "Result", "Failed checks")
_SHOWN = 4


class ResumeError(AssertionFailure):
    """The resume check failed; ``result`` is the :class:`ResumeResult` with every figure."""


@dataclass(frozen=True, kw_only=True)
class ResumeGaps:
    """Reported continuation gaps of one arm against the uninterrupted fit (largest relative gaps)."""

    arm: str
    """``single``, ``ddp``, ``fsdp``, ``fsdp_file``, ``fsdp_reshard`` or ``<strategy>_export``."""
    loss: float
    """Largest relative gap of the step loss (mean over ranks) over the resumed steps."""
    pre_clip_norm: float
    """Largest relative gap of the pre-clip global gradient norm over the resumed steps."""
    update: float
    """Largest per-tensor relative gap of the final weights, relative to the fit's update since the checkpoint."""
    adam_m: float
    """Largest per-tensor relative gap of Adam's first moment at the end."""
    adam_v: float
    """Largest per-tensor relative gap of Adam's second moment at the end."""

    def cells(self) -> list[str]:
        """The five figures as the seed's table prints them."""
        return [
            format_figure(x) for x in (self.loss, self.pre_clip_norm, self.update, self.adam_m, self.adam_v)
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "arm": self.arm,
            **{k: _json(getattr(self, k)) for k in ("loss", "pre_clip_norm", "update", "adam_m", "adam_v")},
        }


@dataclass(frozen=True, kw_only=True)
class ResumeArm:
    """One restore (resume, reload, reshard or export) and the required checks it failed."""

    label: str
    """As in the tables: ``ddp resume``, ``fsdp reshard 4->2``, ``ddp export``, with the fault if any."""
    role: str
    """``resume``, ``reload``, ``reshard`` or ``export``."""
    ranks: int
    """Ranks of this role."""
    loads: str
    """Which checkpoint it loaded: the killed fit's epoch-1 checkpoint, or the resume's final one."""
    fault: str | None
    """Fault planted after its restore."""
    failed: tuple[FailedCheck, ...]
    """Required checks it failed, empty when it passed."""

    @property
    def passed(self) -> bool:
        """True when every required check passed."""
        return not self.failed

    def row(self) -> list[str]:
        """This arm's cells in the per-arm table."""
        checks = ", ".join(dict.fromkeys(f.check for f in self.failed)) or "-"
        return [self.label, self.role, str(self.ranks), self.loads, "pass" if self.passed else "FAIL", checks]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "label": self.label,
            "role": self.role,
            "ranks": self.ranks,
            "loads": self.loads,
            "fault": self.fault,
            "passed": self.passed,
            "failed": [f.to_dict() for f in self.failed],
        }


@dataclass(frozen=True, kw_only=True)
class ResumeResult:
    """Every required check and reported figure of one resume check; returned on a pass, carried on a failure."""

    kind = "resume"

    run: str
    """Row label of the verdict table, e.g. ``ddp, 32-true``."""
    strategy: str
    """``single``, ``ddp``, ``fsdp`` or ``fsdp_file``."""
    precision: str
    """Lightning precision flag."""
    ranks: int
    """Ranks of the fit and the resume."""
    global_batch: int
    """Rows per optimizer step."""
    reshard_ranks: int | None
    """Ranks of the resharded resume, None when not run."""
    export: bool
    """True when the checkpoint was also loaded on one device."""
    fault: str | None
    """Fault planted after the resume's restore."""
    arms: tuple[ResumeArm, ...]
    """Every restore that was checked."""
    gaps: tuple[ResumeGaps, ...]
    """Reported continuation gaps, per resumed arm."""
    departs: str
    """Where the resumed run first departs from the uninterrupted fit (step and what), or ``never``."""
    twin: str
    """Whether the twin fit reproduced the fit bit for bit, and if not, where it first differs."""
    rng: str
    """Whether the resumed run's RNG streams match the fit's on every rank (reported)."""
    timings: Mapping[str, tuple[float, float]]
    """Per role: wall seconds and process start-up seconds."""

    @property
    def passed(self) -> bool:
        """True when every arm passed every required check."""
        return all(a.passed for a in self.arms)

    @property
    def failed(self) -> tuple[FailedCheck, ...]:
        """Every failed required check."""
        return tuple(f for a in self.arms for f in a.failed)

    def verdict_table(self) -> str:
        """The seed's run table: run, ranks, global batch, reshard ranks, verdict."""
        reshard = f"{self.ranks} → {self.reshard_ranks}" if self.reshard_ranks else "-"
        verdict = "pass" if self.passed else "FAIL: " + ", ".join(dict.fromkeys(f.check for f in self.failed))
        if self.fault is not None:
            verdict += f" (fault {self.fault})"
        return render_table(
            _VERDICT_HEADERS, [[self.run, str(self.ranks), str(self.global_batch), reshard, verdict]]
        )

    def arms_table(self) -> str:
        """One row per checked restore."""
        return render_table(_ARM_HEADERS, [a.row() for a in self.arms])

    def gaps_table(self) -> str:
        """The seed's reported continuation and reshard gaps, one row per resumed arm."""
        return render_table(_GAP_HEADERS, [[self.run, g.arm, *g.cells()] for g in self.gaps])

    def report(self) -> str:
        """Heading, the three tables, the reported items and one line per failed check."""
        heading = "passed" if self.passed else f"failed: {len(self.failed)} required checks"
        lines = [
            f"Checkpoint resume {heading} ({self.strategy}, {self.precision}, {self.ranks} ranks"
            + (f", fault {self.fault}" if self.fault else "")
            + ")",
            "",
            self.verdict_table(),
            "",
            self.arms_table(),
            "",
            "Reported, not required:",
            self.gaps_table(),
            f"  resumed run departs from the uninterrupted fit: {self.departs}",
            f"  twin fit: {self.twin}",
            f"  RNG streams: {self.rng}",
        ]
        if not self.passed:
            lines += ["", "Failed checks:"]
            lines += [f"  {f.arm}: {f.check}: {f.detail}" for f in self.failed]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures of this result."""
        return {
            "kind": self.kind,
            "run": self.run,
            "strategy": self.strategy,
            "precision": self.precision,
            "ranks": self.ranks,
            "global_batch": self.global_batch,
            "reshard_ranks": self.reshard_ranks,
            "export": self.export,
            "fault": self.fault,
            "passed": self.passed,
            "arms": [a.to_dict() for a in self.arms],
            "gaps": [g.to_dict() for g in self.gaps],
            "departs": self.departs,
            "twin": self.twin,
            "rng": self.rng,
            "timings": {k: list(v) for k, v in self.timings.items()},
        }


# -------------------------------------------------------------------------------------------------------
# bit-for-bit helpers


def _float_bits(x: float) -> bytes:
    return struct.pack(">d", float(x))


def _same_float(a: float, b: float) -> bool:
    return _float_bits(a) == _float_bits(b)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _same_value(a: Any, b: Any) -> bool:
    """Bitwise for floats and tensors, recursively for containers, ``==`` otherwise."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and _same_float(a, b)
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


def _restore_problems(restored: StateCapture, saved: StateCapture, *, same_world: bool) -> dict[str, str]:
    """Check name -> what differs, for every restore check this capture fails."""
    problems: dict[str, str] = {}

    missing = [n for n in saved.trainables if n not in restored.trainables]
    differ = [
        n
        for n in saved.trainables
        if n in restored.trainables and not _same_tensor(restored.trainables[n], saved.trainables[n])
    ]
    if missing or differ:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if differ:
            parts.append(f"{len(differ)} of {len(saved.trainables)} differ from the save, first {differ[0]}")
        problems["trainables"] = "; ".join(parts)

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


def _continuation(
    arm_records: Sequence[RoleRecord],
    fit: Sequence[RoleRecord],
    killed: Sequence[RoleRecord] | None,
    *,
    same_world: bool,
) -> dict[str, str]:
    problems: dict[str, str] = {}
    if not arm_records[0].steps:
        return problems
    first = arm_records[0].steps[0].step
    if killed is not None and same_world:
        bad = []
        for r_arm, r_killed in zip(arm_records, killed, strict=True):
            mine, theirs = r_arm.step(first), r_killed.step(first)
            if mine is None or theirs is None:
                bad.append((r_arm.rank, "step missing"))
            elif not _same_float(mine.loss, theirs.loss):
                bad.append((r_arm.rank, f"{mine.loss!r} != killed fit's {theirs.loss!r}"))
        if bad:
            problems["first_loss"] = f"step {first}: " + _fold(bad)

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
            if st is not None and not _same_float(st.lr, ref.lr)
        ]
        if wrong and not lr_bad:
            lr_bad.append(f"step {s}: " + _fold(wrong))
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


def _fold(per_rank: Sequence[tuple[int, str]]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, text in per_rank:
        groups.setdefault(text, []).append(rank)
    return "; ".join(f"{fold_ranks(ranks)}: {text}" for text, ranks in groups.items())


# -------------------------------------------------------------------------------------------------------
# reported figures


def _rel(value: float, reference: float) -> float:
    if _same_float(value, reference):
        return 0.0
    if not (math.isfinite(value) and math.isfinite(reference)) or reference == 0:
        return math.inf
    return abs(value - reference) / abs(reference)


def _mean_loss(records: Sequence[RoleRecord], step: int) -> float | None:
    losses = [r.step(step) for r in records]
    if any(s is None for s in losses):
        return None
    return sum(s.loss for s in losses if s is not None) / len(losses)


def _tensor_rel(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor) -> float:
    if _same_tensor(a, b):
        return 0.0
    diff = float((a.double() - b.double()).norm())
    denom = float(base.double().norm())
    if denom == 0 or not math.isfinite(diff):
        return math.inf
    return diff / denom


def _gaps(
    label: str, arm: Sequence[RoleRecord], fit: Sequence[RoleRecord], checkpoint: StateCapture
) -> ResumeGaps:
    loss = pre = 0.0
    for s in sorted({s.step for s in arm[0].steps}):
        mine, theirs = _mean_loss(arm, s), _mean_loss(fit, s)
        if mine is None or theirs is None:
            loss = math.inf
        else:
            loss = max(loss, _rel(mine, theirs))
        a, b = arm[0].step(s), fit[0].step(s)
        pre = max(pre, math.inf if a is None or b is None else _rel(a.pre_clip_norm, b.pre_clip_norm))
    end_arm = arm[0].saves[-1] if arm[0].saves else None
    end_fit = fit[0].saves[-1] if fit[0].saves else None
    update = m = v = math.inf
    if end_arm is not None and end_fit is not None:
        update = max(
            (
                _tensor_rel(
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
        worst = max(worst, _tensor_rel(mine, theirs, theirs))
    return worst


def _first_departure(arm: Sequence[RoleRecord], fit: Sequence[RoleRecord]) -> str:
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


def _twin(fit: Sequence[RoleRecord], twin: Sequence[RoleRecord]) -> str:
    departs = _first_departure(twin, fit)
    if not departs.startswith("never"):
        return f"differs from the fit at {departs}: a fault-free fit is not reproducible here"
    for r_fit, r_twin in zip(fit, twin, strict=True):
        for i, (a, b) in enumerate(zip(r_fit.saves, r_twin.saves, strict=False)):
            for name in a.trainables:
                if not _same_tensor(a.trainables[name], b.trainables[name]):
                    return (
                        f"differs from the fit in save {i}, rank {r_fit.rank}, {name}: not reproducible here"
                    )
    return "reproduces the fit bit for bit"


def _rng(arm: Sequence[RoleRecord], fit: Sequence[RoleRecord]) -> str:
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


# -------------------------------------------------------------------------------------------------------
# judging a run


def _arm_label(strategy: str, role: str, ranks: int, from_ranks: int, fault: str | None) -> str:
    label = {
        "resume": f"{strategy} resume",
        "reload": f"{strategy} reload",
        "reshard": f"{strategy} reshard {from_ranks}->{ranks}",
        "export": f"{strategy} export",
    }[role]
    return f"{label} (fault {fault})" if fault else label


def judge_resume(run: ResumeRun, *, run_label: str | None = None) -> ResumeResult:
    """Every required check and reported figure of ``run``; pure (no processes, no assertion)."""
    for needed in ("fit", "twin", "killed", "resume", "reload"):
        if needed not in run.roles or not run.roles[needed]:
            raise SpriteUsageError(
                f"the resume run has no {needed!r} role (roles: {', '.join(run.roles)}); run every role "
                "with pytest_sprite.recipes.resume.run_resume_roles"
            )
    fit, killed, resume = run.roles["fit"], run.roles["killed"], run.roles["resume"]
    if not killed[0].saves:
        raise SpriteUsageError(
            "the killed fit reported no checkpoint save before it died; it must be killed one step past its "
            "epoch-1 checkpoint"
        )
    arms: list[ResumeArm] = []
    arm_specs: list[tuple[str, str, str | None]] = [
        ("resume", "killed fit's epoch-1 checkpoint", run.fault),
        ("reload", "resume's final checkpoint", None),
        ("reshard", "killed fit's epoch-1 checkpoint", None),
        ("export", "killed fit's epoch-1 checkpoint", None),
    ]
    for role, loads, fault in arm_specs:
        records = run.roles.get(role)
        if not records:
            continue
        source = run.roles["resume"] if role == "reload" else killed
        label = _arm_label(run.strategy, role, len(records), len(source), fault)
        failed: list[FailedCheck] = []
        restore: dict[str, list[tuple[int, str]]] = {}
        same_world = len(records) == len(source)
        for rec in records:
            origin = source[rec.rank] if same_world else source[0]
            if not origin.saves:
                restore.setdefault("loop", []).append((rec.rank, f"the {loads} was never saved"))
                continue
            saved = origin.saves[-1] if role == "reload" else origin.saves[0]
            if rec.restored is None:
                restore.setdefault("loop", []).append((rec.rank, "the role reported no restored state"))
                continue
            for check, detail in _restore_problems(rec.restored, saved, same_world=same_world).items():
                restore.setdefault(check, []).append((rec.rank, detail))
        for check in RESTORE_CHECKS:
            if check in restore:
                failed.append(FailedCheck(arm=label, check=check, fault=fault, detail=_fold(restore[check])))
        if role != "reload":
            problems = _continuation(
                records, fit, killed if role == "resume" else None, same_world=same_world and role == "resume"
            )
            for check in ("first_loss", "lr", "rows"):
                if check in problems:
                    failed.append(FailedCheck(arm=label, check=check, fault=fault, detail=problems[check]))
        arms.append(
            ResumeArm(
                label=label, role=role, ranks=len(records), loads=loads, fault=fault, failed=tuple(failed)
            )
        )
    checkpoint = killed[0].saves[0]
    gaps = [_gaps(run.strategy, resume, fit, checkpoint)]
    if run.roles.get("reshard"):
        gaps.append(_gaps(f"{run.strategy}_reshard", run.roles["reshard"], fit, checkpoint))
    if run.roles.get("export"):
        gaps.append(_gaps(f"{run.strategy}_export", run.roles["export"], fit, checkpoint))
    departs = _first_departure(resume, fit)
    reshard = run.roles.get("reshard")
    return ResumeResult(
        run=run_label or f"{run.strategy}, {run.precision}",
        strategy=run.strategy,
        precision=run.precision,
        ranks=run.ranks,
        global_batch=run.global_batch,
        reshard_ranks=len(reshard) if reshard else None,
        export=bool(run.roles.get("export")),
        fault=run.fault,
        arms=tuple(arms),
        gaps=tuple(gaps),
        departs=departs,
        twin=_twin(fit, run.roles["twin"]),
        rng=_rng(resume, fit),
        timings=dict(run.timings),
    )


# -------------------------------------------------------------------------------------------------------
# the assertion


def assert_resume_bitexact(
    recipe: Any,
    *,
    strategy: str = "ddp",
    precision: str = "32-true",
    reshard: bool = False,
    export: bool | None = None,
    fault: str | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> ResumeResult:
    """Kill a fit after its epoch-1 checkpoint, resume it in new processes, and require the restore bit for bit.

    ``recipe`` is the ``lora_qwen`` fixture, or any recipe with a ``resume_roles(...)`` method returning a
    :class:`~pytest_sprite.records.ResumeRun`; a ``ResumeRun`` itself is judged as it is (offline). Call it
    on every rank of a ranks test (a plain test runs ``single``): every role runs in a sub-world of the
    test's ranks. ``reshard=True`` (FSDP2) also resumes at half the world; ``export`` (default on for ddp and
    fsdp_file) also loads the checkpoint on one device; ``fault`` plants a resume fault after the restore
    (a negative control for ``expect_fault_rejected``). Checkpoints go to ``directory`` (default: a fresh
    directory of rank 0's, shared with every rank).

    The recipe stores the run it hands back (rank 0 writes ``resume-run.pt``: in a fresh
    ``NN-resume-<strategy>`` directory of the test under ``--sprite-artifacts``, else beside the
    checkpoints in ``directory``); the manifest this assertion leaves beside it lets
    ``python -m pytest_sprite judge`` judge it again. A ``ResumeRun`` read back with
    :func:`~pytest_sprite.recipes.artifacts.load_resume_run` names its file the same way.

    Raises :class:`ResumeError` with the seed's tables when a required check fails; returns the
    :class:`ResumeResult` otherwise.
    """
    if isinstance(recipe, ResumeRun):
        run = recipe
    else:
        roles = getattr(recipe, "resume_roles", None)
        if not callable(roles):
            raise SpriteUsageError(
                f"assert_resume_bitexact needs the lora_qwen fixture (or a recipe with a resume_roles(...) "
                f"method, or a ResumeRun to judge again), got {type(recipe).__name__}"
            )
        run = roles(
            strategy=strategy,
            precision=precision,
            reshard=reshard,
            export=export,
            fault=fault,
            directory=directory,
        )
    result = record_assertion(judge_resume(run), inputs=[run.source])
    if not result.passed:
        raise ResumeError(result.report(), failed=result.failed, result=result)
    return result


def _json(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)
