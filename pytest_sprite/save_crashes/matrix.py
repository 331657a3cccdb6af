"""Build a crash matrix: fault-free runs, a crash at every recorded file event, a resume after each, verdicts.

Layout of ``out_dir`` (everything the matrix writes is in here; paths in ``matrix.json`` are relative):

    out_dir/
      matrix.json, matrix.txt     the judged matrix and its table
      runs/<run>/                 each run's training directory (what the target was given)
      logs/<run>.r<rank>.events   each process's event log (JSON lines)
      logs/<run>.r<rank>.out      each process's stdout and stderr

Runs: ``free-1`` and ``free-2`` (fault-free; they must agree), ``flake-<k>`` (``flake=``), then for every event
of every rank ``p<NNN>`` (the crash) resumed in place, and ``control`` (``free-2`` resumed: no crash).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pytest_sprite.assertions.crash_consistency import (
    CrashMatrix,
    CrashRow,
    MatrixSettings,
    judge_matrix,
)
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.timing import monotonic
from pytest_sprite.save_crashes.events import EventLog, FileEvent, read_event_log
from pytest_sprite.save_crashes.inject import FILE_POINT, WRITTEN_POINT, Plan
from pytest_sprite.save_crashes.target_run import RunOutcome, RunRequest
from pytest_sprite.save_crashes.targets import Target, weight_diff
from pytest_sprite.subworld.plan import KillAt

__all__ = ["CrashPoint", "Tear", "crash_points", "prepare_out_dir", "run_matrix"]


@dataclass(frozen=True, kw_only=True)
class CrashPoint:
    """Where one crashed run dies: a rank, one of its events, and whether the event's file is torn."""

    event: FileEvent
    torn: bool

    def kill_plan(self) -> KillAt:
        """The crashed run's kill plan: the rank dies at kill point ``file`` i (inside the event, before it takes
        effect) or, torn, ``written`` i (its file written, then cut to half its size)."""
        return KillAt(
            event=WRITTEN_POINT if self.torn else FILE_POINT, at=self.event.index, ranks=(self.event.rank,)
        )


Tear = Literal["all", "native", "none"]


def crash_points(
    log: EventLog,
    ranks: int,
    *,
    max_points: int | None = None,
    select: Callable[[FileEvent], bool] | None = None,
    tear: Tear = "all",
) -> list[CrashPoint]:
    """Every crash point of a fault-free run: each event of each rank, plus a torn one for each file write.

    ``select`` keeps only the events it accepts; ``tear="native"`` tears only the native writers' files
    (``torch.save``, safetensors: ckpt-chaos's built-in targets), ``"none"`` tears nothing. With ``max_points``,
    an evenly spaced sample of that many (first and last always kept).
    """
    points: list[CrashPoint] = []
    for rank in range(ranks):
        for event in log.for_rank(rank):
            if select is not None and not select(event):
                continue
            points.append(CrashPoint(event=event, torn=False))
            if event.tearable and (tear == "all" or (tear == "native" and event.kind != "open")):
                points.append(CrashPoint(event=event, torn=True))
    if max_points is not None and len(points) > max_points:
        if max_points == 1:
            return points[-1:]
        step = (len(points) - 1) / (max_points - 1)
        points = [points[round(i * step)] for i in range(max_points)]
    return points


def prepare_out_dir(out_dir: str | os.PathLike[str]) -> Path:
    """Create ``out_dir`` (and its parents); refuse one that exists, so that nothing of the user's is touched."""
    path = Path(out_dir)
    if path.exists():
        raise SpriteUsageError(
            f"out_dir {str(path)!r} exists; the crash matrix writes only into a directory it creates itself. "
            "Pass a path that does not exist yet, e.g. tmp_path / 'chaos'"
        )
    path.mkdir(parents=True)
    (path / "runs").mkdir()
    (path / "logs").mkdir()
    return path


class _Runs:
    """Starts the target's runs inside ``out_dir`` with the right plans, logs and outputs."""

    def __init__(self, target: Target, out_dir: Path, *, timeout: float, grace: float) -> None:
        self.target = target
        self.out_dir = out_dir
        self.timeout = timeout
        self.grace = grace

    def train_dir(self, name: str) -> Path:
        return self.out_dir / "runs" / name

    def logs(self, name: str) -> list[Path]:
        return [self.out_dir / "logs" / f"{name}.r{r}.events" for r in range(self.target.ranks)]

    def outputs(self, name: str) -> list[Path]:
        return [self.out_dir / "logs" / f"{name}.r{r}.out" for r in range(self.target.ranks)]

    def run(self, name: str, *, crash: CrashPoint | None = None, train_dir: str | None = None) -> RunOutcome:
        """Run ``name`` (into ``train_dir``'s folder when given: a resume), every rank recording its events."""
        directory = self.train_dir(train_dir or name)
        directory.mkdir(parents=True, exist_ok=True)
        plans: list[Plan | None] = [
            Plan(root=str(directory), log=str(log), rank=rank) for rank, log in enumerate(self.logs(name))
        ]
        return self.target.run(
            RunRequest(
                train_dir=directory,
                plans=plans,
                outputs=self.outputs(name),
                timeout=self.timeout,
                grace=self.grace if crash is not None else self.timeout,
                kill=None if crash is None else crash.kill_plan(),
            )
        )

    def log(self, name: str) -> EventLog:
        return read_event_log(*self.logs(name))


def _failure(outcome: RunOutcome) -> str:
    return outcome.first_error() or "no rank returned"


def run_matrix(target: Target, out_dir: Path, settings: MatrixSettings, *, write: bool = True) -> CrashMatrix:
    """Run the whole matrix of ``target`` inside ``out_dir`` (created by :func:`prepare_out_dir`) and judge it."""
    start = monotonic()
    prewarm = getattr(target, "prewarm", None)
    if callable(prewarm):
        prewarm()
    runs = _Runs(target, out_dir, timeout=settings.timeout, grace=settings.grace)
    first = runs.run("free-1")
    if not first.ok:
        output = runs.outputs("free-1")[0].relative_to(out_dir)
        error = f"{_failure(first)} (its output: {output})"
        return _finish(_empty(target, settings, error), out_dir, start, write)
    missing = [log for log in runs.logs("free-1") if not log.exists()]
    if missing:
        raise SpriteUsageError(
            f"the fault-free run of {target.label} returned, but the crash injector never started in it "
            f"(no event log {missing[0].name}); a command's interpreter must load the generated sitecustomize "
            f"(its output: {runs.outputs('free-1')[0]})"
        )
    reference = first.value(0)
    free_log = runs.log("free-1")
    second = runs.run("free-2")
    fault_free_diff = weight_diff(reference, second.value(0)) if second.ok else float("inf")
    flake_failures = _flake_failures(runs, reference, settings)
    control = _resume_row(
        runs, reference, point=0, name="control", train_dir="free-2", crash=None, free_log=free_log
    )
    matrix = CrashMatrix(
        target=target.label,
        ranks=target.ranks,
        atol=settings.atol,
        allow_lost_work=settings.allow_lost_work,
        fault_free_diff=fault_free_diff,
        flake_runs=settings.flake,
        flake_failures=tuple(flake_failures),
        saves=free_log.completed_saves(),
        control=control,
        rows=_crash_rows(runs, reference, free_log, settings),
    )
    return _finish(matrix, out_dir, start, write)


def _flake_failures(runs: _Runs, reference: object, settings: MatrixSettings) -> list[str]:
    """The repeated fault-free runs (``flake=``) that failed or ended elsewhere than ``free-1``."""
    failures: list[str] = []
    for k in range(1, settings.flake + 1):
        outcome = runs.run(f"flake-{k}")
        if not outcome.ok:
            failures.append(f"flake-{k}: {_failure(outcome)}")
        elif (diff := weight_diff(reference, outcome.value(0))) > settings.atol or diff != diff:
            failures.append(f"flake-{k}: ended with weights {diff:.3g} away from free-1")
    return failures


def _crash_rows(
    runs: _Runs, reference: object, free_log: EventLog, settings: MatrixSettings
) -> tuple[CrashRow, ...]:
    """Crash at every point of the fault-free run, resume each, and record the facts of each row."""
    rows: list[CrashRow] = []
    points = crash_points(
        free_log,
        runs.target.ranks,
        max_points=settings.max_points,
        select=settings.select,
        tear=settings.tear,  # type: ignore[arg-type]
    )
    for number, point in enumerate(points, start=1):
        name = f"p{number:03d}{'t' if point.torn else ''}"
        crashed = runs.run(name, crash=point)
        rows.append(
            _resume_row(
                runs,
                reference,
                point=number,
                name=name,
                train_dir=name,
                crash=(point, crashed),
                free_log=free_log,
            )
        )
    return tuple(rows)


def _finish(matrix: CrashMatrix, out_dir: Path, start: float, write: bool) -> CrashMatrix:
    matrix = judge_matrix(replace(matrix, wall_s=monotonic() - start))
    if write:
        matrix.write(out_dir)
    return matrix


def _empty(target: Target, settings: MatrixSettings, error: str) -> CrashMatrix:
    """The matrix of a target whose fault-free run failed: no rows, the reason, a control that never ran."""
    control = CrashRow(
        point=0,
        rank=None,
        event="control",
        file="-",
        torn=False,
        crashed=False,
        resume_status="raised",
        error="not run: the fault-free run failed",
    )
    return CrashMatrix(
        target=target.label,
        ranks=target.ranks,
        atol=settings.atol,
        allow_lost_work=settings.allow_lost_work,
        fault_free_diff=float("nan"),
        flake_runs=settings.flake,
        flake_failures=(),
        saves=(),
        control=control,
        rows=(),
        fault_free_error=error,
    )


def _resume_row(
    runs: _Runs,
    reference: object,
    *,
    point: int,
    name: str,
    train_dir: str,
    crash: tuple[CrashPoint, RunOutcome] | None,
    free_log: EventLog,
) -> CrashRow:
    """Resume ``train_dir`` in fresh processes and record the facts of the row."""
    note = ""
    newest = None
    if crash is not None:
        cp, outcome = crash
        crashed = outcome.crashed_at(cp.event.rank, cp.event.index)
        crash_log = runs.log(name)
        if not crashed:
            note = "the crash point was not reached: " + (
                outcome.first_error() or "the run finished without reaching it (its file events differ)"
            )
        else:
            last = crash_log.for_rank(cp.event.rank)[-1:]
            if not last or not last[0].same_operation(cp.event):
                seen = last[0].describe() if last else "no event"
                note = f"died at {seen}, the fault-free run had {cp.event.describe()} there"
        newest = _newest_complete(free_log, crash_log)
        event, file, torn, rank = cp.event.kind, _file(cp.event), cp.torn, cp.event.rank
    else:
        crashed, event, file, torn, rank = False, "control", "-", False, None
        newest = free_log.completed_saves()[-1] if free_log.completed_saves() else None
    resume_name = f"{name}.resume"
    resumed = runs.run(resume_name, train_dir=train_dir)
    resume_log = runs.log(resume_name)
    error = None
    diff = None
    if resumed.ok:
        status = "returned"
        diff = weight_diff(reference, resumed.value(0))
    else:
        failed = [r for r in resumed.ranks if r.status != "returned"]
        status = "died" if failed[0].status == "crashed" else failed[0].status
        error = resumed.first_error()
    return CrashRow(
        point=point,
        rank=rank,
        event=event,
        file=file,
        torn=torn,
        crashed=crashed,
        resume_status=status,  # type: ignore[arg-type]
        error=error,
        weight_diff=diff,
        newest_complete=newest,
        resumed_from=resume_log.resumed_from(),
        note=note,
    )


def _file(event: FileEvent) -> str:
    return f"{event.path} -> {event.dest}" if event.dest is not None else event.path


def _newest_complete(free_log: EventLog, crash_log: EventLog) -> str | None:
    """Newest checkpoint every rank that marked it in the fault-free run also marked before dying."""
    saves = free_log.completed_saves()
    if not saves:
        return None
    wanted = {
        name: {m.rank for m in free_log.marks if m.mark == "save_complete" and m.name == name}
        for name in saves
    }
    have: dict[str, set[int]] = {}
    for m in crash_log.marks:
        if m.mark == "save_complete":
            have.setdefault(m.name, set()).add(m.rank)
    complete = [name for name in saves if wanted[name] <= have.get(name, set())]
    return complete[-1] if complete else None


def ranks_of(points: Sequence[CrashPoint]) -> list[int]:
    """Ranks that have at least one crash point."""
    return sorted({p.event.rank for p in points})
