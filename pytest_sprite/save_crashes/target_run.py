"""One run of a crash matrix's target: a sub-world of fresh forks of the test process, one per rank.

The runs are sub-worlds (``subworld.host.run_plain_world``), not a second process runner: each
rank is a fork of the calling process (so it costs a fork, not an ``import torch``), reports through the
sub-world's frames and is watched, timed out and ended by its host. A matrix's rank joins no world of the
harness's: it leads its own session, prints into the matrix's log file, takes the launcher variables it is
given, installs its :class:`~pytest_sprite.save_crashes.inject.Plan` (the recorder), calls the function and hands
back what it returned (or the exception it raised, as text). Where a run crashes is the sub-world's kill plan
(``kill=``, built by the matrix): the injector reports every file event as a kill point, the plan decides, the
sub-world kills the rank there and says where (``killed_at``). A killed rank leaves the others running on for
``grace`` seconds, as a killed process would; then they are ended.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pytest_sprite.env.rank_variables import become_rank
from pytest_sprite.plumbing.collectives import TRANSPORT_ERROR
from pytest_sprite.plumbing.process import exit_text, redirect_output
from pytest_sprite.plumbing.timing import monotonic
from pytest_sprite.save_crashes.inject import Plan
from pytest_sprite.subworld.plan import KillAt

__all__ = [
    "RankOutcome",
    "RunOutcome",
    "RunRequest",
    "crash_outcome",
    "forked_envs",
    "portable",
    "rank_envs",
    "run_ranks",
]

Status = Literal["returned", "raised", "crashed", "died", "timeout"]


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one process of a run ended."""

    rank: int
    status: Status
    """``returned`` (value is set), ``raised`` (error is set), ``crashed`` where the run's kill plan killed it
    (``crashed_at`` is set), ``died`` (any other exit or signal), ``timeout`` (killed by the run's deadline)."""
    value: Any = None
    error: str | None = None
    """The exception (``Type: message``) or how the process ended."""
    traceback: str | None = None
    crashed_at: int | None = None
    """The index of this rank's file event where the kill plan killed it (``crashed`` only)."""


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """Every rank of one run, and the run's wall time."""

    ranks: tuple[RankOutcome, ...]
    wall_s: float

    @property
    def crashed(self) -> bool:
        """True when the kill plan killed some rank."""
        return any(r.status == "crashed" for r in self.ranks)

    def crashed_at(self, rank: int, index: int) -> bool:
        """True when the kill plan killed ``rank`` at its file event ``index``."""
        return any(r.status == "crashed" and r.rank == rank and r.crashed_at == index for r in self.ranks)

    @property
    def ok(self) -> bool:
        """True when every rank returned."""
        return all(r.status == "returned" for r in self.ranks)

    def first_error(self) -> str | None:
        """The failure that explains the run, with the rank named when there are several.

        A rank's own error (it raised or died) comes first, then a timeout, then an error that only says its
        transport broke under it (a peer failed first: the consequence, not the cause); lowest rank first.
        """
        failed = [r for r in self.ranks if r.status not in ("returned", "crashed")]
        if not failed:
            return None

        def consequence(r: RankOutcome) -> int:
            if TRANSPORT_ERROR.search(r.error or ""):
                return 2
            return 1 if r.status == "timeout" else 0

        first = min(failed, key=lambda r: (consequence(r), r.rank))
        prefix = f"rank {first.rank}: " if len(self.ranks) > 1 else ""
        return prefix + (first.error or first.status)

    def value(self, rank: int = 0) -> Any:
        """What ``rank`` returned (raises when it did not return)."""
        r = self.ranks[rank]
        if r.status != "returned":
            raise RuntimeError(f"rank {rank} did not return ({r.status}: {r.error})")
        return r.value


def portable(value: Any) -> Any:
    """A returned module becomes its state dict; tensors are detached CPU copies (picklable, comparable)."""
    try:
        import torch
    except ImportError:
        return value
    if isinstance(value, torch.nn.Module):
        value = value.state_dict()
    if isinstance(value, Mapping):
        return {
            str(k): (v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v)
            for k, v in value.items()
        }
    return value


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """One run a crash matrix asks of its target: rank ``r`` under ``plans[r]``, printing into ``outputs[r]``."""

    train_dir: Path
    """The run trains into (and resumes from) this directory."""
    plans: Sequence[Plan | None]
    """Each rank's recorder (where to watch, where to log)."""
    outputs: Sequence[Path]
    timeout: float
    grace: float
    kill: KillAt | None = None
    """The run's kill plan: the rank and file-event kill point where it crashes (None: no crash)."""

    def in_forks(
        self, fn: Callable[..., Any], args: Sequence[Any], envs: Sequence[Mapping[str, str]]
    ) -> RunOutcome:
        """``fn(train_dir, *args)`` in one fresh fork per rank, each with its ``envs`` entry (see :func:`run_ranks`)."""
        return run_ranks(
            fn,
            (self.train_dir, *args),
            plans=self.plans,
            envs=envs,
            logs=self.outputs,
            timeout=self.timeout,
            grace=self.grace,
            kill=self.kill,
        )


def forked_envs(ranks: int, env: Mapping[str, str]) -> list[dict[str, str]]:
    """``env`` for every rank, with torchrun's variables added when there is more than one."""
    return [{**env, **e} for e in rank_envs(ranks)] if ranks > 1 else [dict(env)]


def run_ranks(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    plans: Sequence[Plan | None],
    envs: Sequence[Mapping[str, str]],
    logs: Sequence[Path],
    timeout: float,
    grace: float | None = None,
    kill: KillAt | None = None,
) -> RunOutcome:
    """Run ``fn(*args)`` in ``len(plans)`` forked processes (one per rank) and wait for all of them.

    Each rank gets its own plan (None: no injector), environment additions and output log; ``kill`` is the
    sub-world's kill plan at the injector's file-event kill points. A rank still running after ``timeout``
    seconds is killed. With ``grace``, once a rank has ended without a result (killed by the plan, or died)
    the others get ``grace`` more seconds to run on before they are stopped. What a rank left running (a
    dataloader worker) ends with the run.
    """
    from pytest_sprite.subworld.host import run_plain_world
    from pytest_sprite.subworld.zygote import DirectForker

    start = monotonic()
    request = (fn, tuple(args), tuple(plans), tuple(dict(e) for e in envs), tuple(str(p) for p in logs))
    result = run_plain_world(
        _run_rank,
        request,
        {},
        size=len(plans),
        kill=kill,
        timeout=timeout,
        forker=DirectForker(),
        join=False,
        peer_grace=timeout if grace is None else grace,
    )
    for o in result.outcomes:  # each rank leads its own session: end what it left running
        for pid in o.emitted("pid"):
            _kill_group(pid)
    elapsed = min(timeout, monotonic() - start)
    outcomes = tuple(_outcome(o, elapsed) for o in result.outcomes)
    return RunOutcome(ranks=outcomes, wall_s=monotonic() - start)


def _run_rank(
    seat: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    plans: tuple[Plan | None, ...],
    envs: tuple[dict[str, str], ...],
    logs: tuple[str, ...],
) -> tuple[str, Any, str | None, str | None]:
    """One rank of a run (a sub-world rank that joined no world): what it returned, or what it raised."""
    from pytest_sprite.save_crashes import inject
    from pytest_sprite.subworld import emit

    rank = seat.rank
    os.setsid()
    emit("pid", os.getpid())
    redirect_output(Path(logs[rank]))
    # pytest's capture replaced sys.stdout/stderr with its own objects: print into the log instead
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    env = envs[rank]
    if "RANK" in env:  # a world of its own (rank_envs): that world's variables, no other launcher's
        become_rank(env)
    else:  # one process: the target's own additions on top of the test process's environment
        os.environ.update(env)
    if plans[rank] is not None:
        inject.install(plans[rank])
    payload: tuple[str, Any, str | None, str | None]
    try:
        value = fn(*args)
        inject.finish()
        payload = ("returned", portable(value), None, None)
    except BaseException as exc:  # everything the function raised is the run's outcome
        inject.finish()
        text = traceback.format_exc()
        sys.stderr.write(text)  # into the run's output log, for whoever reads why it failed
        sys.stderr.flush()
        payload = ("raised", None, f"{type(exc).__name__}: {exc}", text)
    try:
        pickle.dumps(payload)
    except Exception as exc:
        payload = ("raised", None, f"the result cannot be pickled: {exc}", None)
    return payload


def _outcome(o: Any, elapsed: float) -> RankOutcome:
    """A sub-world rank's outcome as the matrix reads it."""
    if o.status in ("timeout", "ended"):
        return RankOutcome(
            rank=o.rank, status="timeout", error=f"still running after {elapsed:.0f} s; killed"
        )
    if o.status == "killed":
        return crash_outcome(o)
    if o.status == "returned":
        kind, value, error, tb = o.value
        if kind == "returned":
            return RankOutcome(rank=o.rank, status="returned", value=value)
        return RankOutcome(rank=o.rank, status="raised", error=error, traceback=tb)
    if o.status == "raised":
        last = [line for line in o.error.strip().splitlines() if line.strip()][-1:] or [o.error]
        return RankOutcome(rank=o.rank, status="died", error=last[0])
    return RankOutcome(rank=o.rank, status="died", error=f"ended with {exit_text(o.exitcode, o.signum)}")


def crash_outcome(o: Any) -> RankOutcome:
    """A sub-world rank its kill plan killed (status ``killed``), as the matrix reads it: crashed at event i."""
    return RankOutcome(rank=o.rank, status="crashed", crashed_at=o.killed_at.index)


def rank_envs(ranks: int, *, port: int | None = None) -> list[dict[str, str]]:
    """torchrun's variables for ``ranks`` local processes with a fresh rendezvous port (one per run)."""
    from pytest_sprite.env.rank_variables import free_port, torchrun_variables

    port = free_port("127.0.0.1") if port is None else port
    return [
        torchrun_variables(
            rank=r,
            local_rank=r,
            world_size=ranks,
            local_world_size=ranks,
            node=0,
            master_addr="127.0.0.1",
            master_port=port,
        )
        for r in range(ranks)
    ]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
