"""One run of a target in fresh processes: forks of the calling process, each leading its own process group.

A run is a fork, not a new interpreter, so it costs a fork and not an ``import torch``. The child installs
its :class:`~pytest_sprite.chaos.inject.Plan`, calls the function, sends back what it returned (pickled, over
a pipe) or the exception it raised (as text), and ends with ``os._exit``: no atexit handler, no pytest
teardown, no flushing of anything the parent owns. Its stdout and stderr go to a log file the matrix keeps
for the table's error column. Several ranks are several such children with the launcher variables set;
a rank that dies at its crash point leaves the others running on, as a killed process would.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pytest_sprite._process import exit_text, one_thread_after_fork, redirect_output, wait_status
from pytest_sprite._rankenv import become_rank
from pytest_sprite._timing import monotonic
from pytest_sprite.chaos.inject import CRASH_EXIT_CODE, Plan

__all__ = ["RankOutcome", "RunOutcome", "portable", "rank_envs", "run_forked"]

Status = Literal["returned", "raised", "crashed", "died", "timeout"]


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one process of a run ended."""

    rank: int
    status: Status
    """``returned`` (value is set), ``raised`` (error is set), ``crashed`` at its planned point, ``died`` (any
    other exit or signal), ``timeout`` (killed by the run's deadline)."""
    value: Any = None
    error: str | None = None
    """The exception (``Type: message``) or how the process ended."""
    traceback: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """Every rank of one run, and the run's wall time."""

    ranks: tuple[RankOutcome, ...]
    wall_s: float

    @property
    def crashed(self) -> bool:
        """True when some rank died at its planned crash point."""
        return any(r.status == "crashed" for r in self.ranks)

    @property
    def ok(self) -> bool:
        """True when every rank returned."""
        return all(r.status == "returned" for r in self.ranks)

    def first_error(self) -> str | None:
        """The first failure, lowest rank first, with the rank named when there are several."""
        for r in self.ranks:
            if r.status not in ("returned", "crashed"):
                prefix = f"rank {r.rank}: " if len(self.ranks) > 1 else ""
                return prefix + (r.error or r.status)
        return None

    def value(self, rank: int = 0) -> Any:
        """What ``rank`` returned (raises when it did not return)."""
        r = self.ranks[rank]
        if r.status != "returned":
            raise RuntimeError(f"rank {rank} did not return ({r.status}: {r.error})")
        return r.value


def _child(
    fn: Callable[..., Any],
    args: Sequence[Any],
    plan: Plan | None,
    env: Mapping[str, str],
    log_path: Path,
    write_fd: int,
) -> None:
    """Body of a forked run process; never returns."""
    code = 1
    try:
        os.setsid()
        redirect_output(log_path)
        # pytest's capture replaced sys.stdout/stderr with its own objects: print into the log instead
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        one_thread_after_fork()
        if "RANK" in env:  # a world of its own (rank_envs): that world's variables, no other launcher's
            become_rank(env)
        else:  # one process: the target's own additions on top of the test process's environment
            os.environ.update(env)
        from pytest_sprite.chaos import inject

        if plan is not None:
            inject.install(plan)
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
            data = pickle.dumps(payload)
        except Exception as exc:
            data = pickle.dumps(("raised", None, f"the result cannot be pickled: {exc}", None))
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


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


def run_forked(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    plans: Sequence[Plan | None],
    envs: Sequence[Mapping[str, str]],
    logs: Sequence[Path],
    timeout: float,
    grace: float | None = None,
) -> RunOutcome:
    """Run ``fn(*args)`` in ``len(plans)`` forked processes (one per rank) and wait for all of them.

    Each rank gets its own plan (None: no injector), environment additions and output log. A rank still
    running after ``timeout`` seconds is killed with its whole process group. With ``grace``, once a rank
    has ended without a result (it died, at its crash point or otherwise) the others get ``grace`` more
    seconds to run on before they are stopped: a killed rank's peers run on for a while, then are stopped.
    """
    start = monotonic()
    children: list[tuple[int, int]] = []
    for rank, (plan, env, log) in enumerate(zip(plans, envs, logs, strict=True)):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(fn, args, plan, env, log, write_fd)
        os.close(write_fd)
        children.append((pid, read_fd))
        del rank
    deadline = start + timeout
    buffers: dict[int, bytearray] = {fd: bytearray() for _, fd in children}
    open_fds = {fd for _, fd in children}
    while open_fds:
        remaining = deadline - monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(remaining, 1.0))
        for fd in ready:
            chunk = os.read(fd, 1 << 20)
            if chunk:
                buffers[fd].extend(chunk)
            else:
                open_fds.discard(fd)
                if not buffers[fd] and grace is not None:  # no result: this rank died
                    deadline = min(deadline, monotonic() + grace)
    timed_out = bool(open_fds)
    timeout = min(timeout, monotonic() - start)
    outcomes: list[RankOutcome] = []
    for rank, (pid, fd) in enumerate(children):
        if timed_out:
            _kill_group(pid)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
        outcomes.append(_outcome(rank, status, bytes(buffers[fd]), fd in open_fds, timeout))
    for pid, _ in children:  # what a rank left running (a dataloader worker, a stuck peer) ends with the run
        _kill_group(pid)
    return RunOutcome(ranks=tuple(outcomes), wall_s=monotonic() - start)


def rank_envs(ranks: int, *, port: int | None = None) -> list[dict[str, str]]:
    """torchrun's variables for ``ranks`` local processes with a fresh rendezvous port (one per run)."""
    from pytest_sprite._rankenv import free_port, torchrun_variables

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


def _outcome(rank: int, status: int, data: bytes, timed_out: bool, timeout: float) -> RankOutcome:
    if timed_out:
        return RankOutcome(rank=rank, status="timeout", error=f"still running after {timeout:.0f} s; killed")
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == CRASH_EXIT_CODE:
        return RankOutcome(rank=rank, status="crashed")
    if data:
        try:
            kind, value, error, tb = pickle.loads(data)
        except Exception as exc:
            return RankOutcome(rank=rank, status="died", error=f"unreadable result ({exc})")
        if kind == "returned":
            return RankOutcome(rank=rank, status="returned", value=value)
        return RankOutcome(rank=rank, status="raised", error=error, traceback=tb)
    return RankOutcome(rank=rank, status="died", error=f"ended with {exit_text(*wait_status(status))}")
