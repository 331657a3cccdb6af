"""Inside a sub-world rank: the process body, and what the code under test calls there (``emit``, ``kill_point``)."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from pytest_sprite.plumbing import phases
from pytest_sprite.plumbing.coverage import rank_started, save_rank_data
from pytest_sprite.plumbing.mutants import current_run
from pytest_sprite.plumbing.process import die_with_parent, install_stack_dumps, name_process, redirect_output
from pytest_sprite.plumbing.protocol import encode_object
from pytest_sprite.plumbing.stacks import STACK_SIGNAL, keep_stack_dumps
from pytest_sprite.plumbing.timing import monotonic, perf_counter, sleep

from .join import Seat, join_world, tcp_store
from .messages import Emitted, Killed, Profiled, Raised, RankMessage, Ready, Recorded, Returned
from .plan import KillPlan, KillPoint

__all__ = ["RankSpec", "emit", "in_subworld", "kill_point", "rank_main"]


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """The request a sub-world rank is forked with: its seat in the sub-world and how it runs."""

    name: str
    seat: Seat
    plan: KillPlan | None
    run_dir: str
    """Where the rank's output (``rank<r>.log``) and stacks (``rank<r>.stacks``) go."""
    join: bool = True
    """False: the rank joins no world (no variables, device, store or group): the function gets the rank's
    :class:`~pytest_sprite.subworld.join.Seat` instead of a World and sets itself up, as a crash matrix's
    runs do."""
    coverage_context: str | None = None
    """The coverage context of the process that started the sub-world, the rank's lines counted under it
    (``plumbing/coverage.py``); None when it switched to none."""
    group_backend: Callable[[str], str] | None = None
    """Under ``--sprite-mutate``: the device's backend -> the default group's, which records and plants the
    starting test's mutant (:class:`~pytest_sprite.plumbing.mutants.MutationRun`); None: the device's own."""
    profile: bool = False
    """Under ``--sprite-profile``: count this rank's time by phase and send it back (``plumbing/phases.py``)."""


@dataclass(kw_only=True)
class _Context:
    rank: int
    plan: KillPlan | None
    channel: socket.socket
    counts: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=perf_counter)
    """When the rank began to run its seat (after its start-up: that is the host's ``fork`` phase)."""


_CONTEXT: _Context | None = None


def in_subworld() -> bool:
    """True inside a sub-world rank."""
    return _CONTEXT is not None


def _send(sock: socket.socket, message: RankMessage) -> None:
    sock.sendall(encode_object(message))


def emit(name: str, value: Any) -> None:
    """Send ``value`` under ``name`` to the test that started this sub-world, now (it survives a kill).

    Outside a sub-world it does nothing, so instrumented code runs anywhere. ``value`` must be picklable;
    tensors should be on the CPU.
    """
    ctx = _CONTEXT
    if ctx is None:
        return
    _send(ctx.channel, Emitted(name, value))


def kill_point(
    event: str,
    index: int | None = None,
    *,
    detail: str = "",
    before_kill: Callable[[], object] | None = None,
) -> None:
    """A point where the sub-world's kill plan may kill this rank: ``kill_point("step", 4)``.

    Counts every call per event name; the plan sees the count, the index and the detail. ``before_kill``
    runs only when the plan kills the rank here, right before it dies (the crash injector cuts the file it
    was writing). Outside a sub-world, or without a plan, it does nothing.
    """
    ctx = _CONTEXT
    if ctx is None:
        return
    ctx.counts[event] = count = ctx.counts.get(event, 0) + 1
    if ctx.plan is None:
        return
    point = KillPoint(rank=ctx.rank, event=event, count=count, index=index, detail=detail)
    if ctx.plan.should_kill(point):
        signum = getattr(ctx.plan, "signum", signal.SIGKILL)
        if before_kill is not None:
            try:
                before_kill()
            except Exception as exc:  # what dying here does must not keep the rank alive
                sys.stderr.write(f"kill_point: before_kill failed ({type(exc).__name__}: {exc})\n")
        save_rank_data()  # a planned kill: what the rank ran up to here still counts
        _send(ctx.channel, Killed(point, int(signum)))
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signum)
        sleep(5.0)  # a catchable signal that was caught: die anyway
        os._exit(128 + int(signum))


def rank_main(request: bytes | tuple[Any, ...], channel: socket.socket) -> NoReturn:
    """Body of a sub-world rank (a fresh fork): join the sub-world, run the function, report, exit.

    ``request`` is ``(spec, fn, args, kwargs)``, pickled when it crossed a process (from a zygote).
    """
    global _CONTEXT
    code = 0
    try:
        die_with_parent()
        name_process("subworld")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        spec, fn, args, kwargs = pickle.loads(request) if isinstance(request, bytes) else request
        rank_started(f"subworld-rank{spec.seat.rank}", context=spec.coverage_context)
        _send(channel, Ready())  # start-up ends here: the process runs and has the function loaded
        rank, run_dir = spec.seat.rank, Path(spec.run_dir)
        redirect_output(run_dir / f"rank{rank}.log")
        keep_stack_dumps()  # as a ranks test's children: a library's handler reset must not lose the stack
        install_stack_dumps(run_dir / f"rank{rank}.log", run_dir / f"rank{rank}.stacks", STACK_SIGNAL)
        _CONTEXT = _Context(rank=rank, plan=spec.plan, channel=channel)
        phases.enable(spec.profile)
        with phases.phase("join"):
            world, store = _join(spec.seat, spec.group_backend) if spec.join else (spec.seat, None)
        try:
            value = fn(world, *args, **kwargs)
        except BaseException:
            save_rank_data()  # before the test hears of the end: os._exit skips coverage's save
            _send_record(channel)
            _send(channel, Raised(traceback.format_exc()))
            code = 1
        else:
            save_rank_data()
            _send_record(channel)
            _send(channel, Returned(value))
        if store is not None:
            _leave(store, spec.seat.world_size)
        channel.close()  # done: a host whose zygote reaps this rank stops waiting here, not at the exit
    except BaseException:
        try:
            _send(channel, Raised(traceback.format_exc()))
        except OSError:
            pass
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send_record(channel: socket.socket) -> None:
    """Under ``--sprite-mutate``: what this rank recorded; under ``--sprite-profile``: its time by phase; for
    the test that started it."""
    run = current_run()
    if run is not None:
        _send(channel, Recorded(tuple(run.ops)))
    if phases.enabled() and _CONTEXT is not None:
        _send(channel, Profiled(phases.take_lifetime(_CONTEXT.started, "sub-world other")))


def _collect(name: str, rank: int, tensor: Any) -> None:
    """``world.collect`` in a sub-world: the tensor goes to the test as an emitted value."""
    emit(f"collected:{name}", tensor.detach().cpu().clone())


def _join(seat: Seat, group_backend: Callable[[str], str] | None) -> tuple[Any, Any]:
    """This rank's World and the sub-world's store (hosted by the process that started the sub-world)."""
    seat.export_env()

    def connect(timeout: timedelta) -> Any:
        return tcp_store(seat.master_addr, seat.master_port, is_master=False, timeout=timeout)

    return join_world(seat, connect=connect, sink=_collect, group_prefix="pg", group_backend=group_backend)


def _leave(store: Any, world_size: int) -> None:
    """Wait (bounded) until every rank has returned, so no peer loses a connection it still uses."""
    deadline = monotonic() + 60.0
    try:
        count = store.add("sprite/done", 1)
        while count < world_size and monotonic() < deadline:
            sleep(0.005)
            count = store.add("sprite/done", 0)
    except Exception:  # a dead peer can break the store; this rank's result is already sent
        pass
