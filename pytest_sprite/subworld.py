"""Sub-worlds: run a function in fresh processes, one per rank, with a fresh rendezvous, and kill them at will.

Inside a ranks test every rank calls :func:`run_subworld` together; each of the first ``ranks`` ranks gets a
new process forked from a pre-initialized copy of its test child (its *zygote*, forked before the test
touched a device or a process group), so a sub-world costs a fork, never an interpreter start. The new
processes form their own world (``RANK``/``WORLD_SIZE``/``MASTER_*`` exported, their own default process
group on a fresh store) and run ``fn(world, *args, **kwargs)``. Every rank of the test gets the same
:class:`SubworldResult`: per rank, the value returned (or the error raised), every value the function
emitted with :func:`emit` while it ran, and how the process ended.

A plain test (no ranks marker) is a world of its own: its process forks the sub-world's ranks directly.

Kill points make crashes part of the plan: code in the sub-world calls ``kill_point("step", 4)`` (or
``kill_point("file", detail=path)``), and a kill plan such as ``KillAt("step", at=4, ranks=[1])`` decides
which rank dies there. A rank that dies (planned, crashed or signalled) ends its sub-world: the other ranks
are killed too, and the result says, rank by rank, who died where and who was ended. The test that started
the sub-world carries on. Sub-worlds do not nest.

The checkpoint resume check (kill a fit after its checkpoint, resume it in new processes, reshard at half the
world) and the crash-consistency check (die inside the n-th file event of a save) are built on this.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import select
import signal
import socket
import struct
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol, runtime_checkable

from pytest_sprite._placement import place
from pytest_sprite._process import one_thread_after_fork
from pytest_sprite._ranges import fold_ranks
from pytest_sprite._timing import monotonic, sleep
from pytest_sprite.errors import SpriteError, SpriteUsageError

if TYPE_CHECKING:
    from pytest_sprite.world import World

__all__ = [
    "KillAt",
    "KillPlan",
    "KillPoint",
    "RankOutcome",
    "SubworldError",
    "SubworldResult",
    "emit",
    "in_subworld",
    "kill_point",
    "run_subworld",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a sub-world may run before its ranks' stacks are taken and they are killed."""

_STACK_SIGNAL = signal.SIGUSR1
_FRAME = struct.Struct(">Q")
_TAIL = 40
_PEER_KILL_GRACE = 10.0
"""Seconds a live rank gets to reach its own kill when the plan kills it where another rank was just killed."""


# -------------------------------------------------------------------------------------------------------
# kill plans


@dataclass(frozen=True, kw_only=True)
class KillPoint:
    """A point a sub-world rank reached: what a kill plan decides on."""

    rank: int
    """The rank in the sub-world."""
    event: str
    """What kind of point: ``"step"``, ``"file"``, or any name the code under test uses."""
    count: int
    """How many times this rank has reached ``event``, this time included (1-based)."""
    index: int | None
    """The index the code passed (``kill_point("step", 4)``), None when it passed none."""
    detail: str
    """Free text the code passed (a file name, a phase)."""

    def describe(self) -> str:
        """``step 4`` / ``file #3 (shard_0.distcp)``."""
        where = f"{self.event} {self.index}" if self.index is not None else f"{self.event} #{self.count}"
        return f"{where} ({self.detail})" if self.detail else where


@runtime_checkable
class KillPlan(Protocol):
    """Decides, at every kill point, whether this rank dies there. Must be picklable (module-level class)."""

    def should_kill(self, point: KillPoint) -> bool:
        """True to kill the rank at ``point``."""
        ...


@dataclass(frozen=True, kw_only=True)
class KillAt:
    """Kill at the ``at``-th point named ``event`` (its index when the code passes one), on ``ranks`` (all).

    ``KillAt(event="step", at=4)`` kills every rank at ``kill_point("step", 4)``;
    ``KillAt(event="file", at=3, ranks=(1,))`` kills rank 1 the third time it reaches ``kill_point("file")``.
    """

    event: str
    """Kill point name to match."""
    at: int
    """Index to match (the count of the event when the code passes no index)."""
    ranks: tuple[int, ...] | None = None
    """Sub-world ranks that die there; None for all."""
    signum: int = signal.SIGKILL
    """Signal the rank sends itself."""

    def __post_init__(self) -> None:
        if not isinstance(self.event, str) or not self.event:
            raise SpriteUsageError(f"KillAt(event={self.event!r}): give the kill point's name, e.g. 'step'")
        if not isinstance(self.at, int) or self.at < 0:
            raise SpriteUsageError(
                f"KillAt(at={self.at!r}): a non-negative int (an index or a 1-based count)"
            )

    def should_kill(self, point: KillPoint) -> bool:
        if point.event != self.event or (self.ranks is not None and point.rank not in self.ranks):
            return False
        return (point.index if point.index is not None else point.count) == self.at


# -------------------------------------------------------------------------------------------------------
# results


Status = Literal["returned", "raised", "killed", "crashed", "ended", "timeout"]


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one rank of a sub-world ended, and everything it sent back."""

    rank: int
    """The rank in the sub-world."""
    status: Status
    """``returned``; ``raised`` (an exception, in ``error``); ``killed`` at its kill point; ``crashed``
    (died by a signal or exit code nobody planned); ``ended`` by the harness because another rank died;
    ``timeout``."""
    value: Any = None
    """What the function returned (``returned`` only)."""
    error: str = ""
    """The traceback (``raised``), or why the rank was ended."""
    events: tuple[tuple[str, Any], ...] = ()
    """Every ``emit(name, value)`` of the rank, in order, up to its end."""
    killed_at: KillPoint | None = None
    """Where a planned kill struck."""
    signum: int | None = None
    """Signal that ended the process, if any."""
    exitcode: int | None = None
    """Exit status, if it exited."""
    output: str = ""
    """Tail of what the rank printed (and its stacks on a timeout)."""

    @property
    def ok(self) -> bool:
        """True when the function returned."""
        return self.status == "returned"

    def emitted(self, name: str) -> list[Any]:
        """The values emitted under ``name``, in order."""
        return [v for n, v in self.events if n == name]

    def describe(self) -> str:
        """One line: ``killed at step 4 (signal 9)``, ``raised ValueError: ...``."""
        if self.status == "returned":
            return "returned"
        if self.status == "killed" and self.killed_at is not None:
            return f"killed at {self.killed_at.describe()}" + (
                f" (signal {self.signum})" if self.signum else ""
            )
        if self.status == "raised":
            last = self.error.strip().splitlines()[-1] if self.error.strip() else "an exception"
            return f"raised {last}"
        if self.status == "crashed":
            how = f"signal {self.signum}" if self.signum is not None else f"exit code {self.exitcode}"
            return f"crashed ({how})"
        return f"{self.status}: {self.error}" if self.error else self.status


class SubworldError(SpriteError, RuntimeError):
    """A sub-world's function did not return on every rank; ``result`` says what happened rank by rank."""

    def __init__(self, message: str, result: SubworldResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True, kw_only=True)
class SubworldResult:
    """Every rank's outcome, the same on every rank of the test that ran the sub-world."""

    name: str
    """What ran (the function's qualified name)."""
    outcomes: tuple[RankOutcome, ...]
    """One per sub-world rank, in rank order."""
    wall_s: float = 0.0
    """Seconds from the call to the last rank's end."""
    start_s: float = 0.0
    """Seconds from the call until every rank's process ran with the function loaded (the start-up cost)."""

    @property
    def size(self) -> int:
        """Ranks in the sub-world."""
        return len(self.outcomes)

    @property
    def ok(self) -> bool:
        """True when every rank returned."""
        return all(o.ok for o in self.outcomes)

    def values(self) -> list[Any]:
        """What every rank returned, in rank order; raises :class:`SubworldError` unless all returned."""
        if not self.ok:
            raise SubworldError(self.report(), self)
        return [o.value for o in self.outcomes]

    def killed(self) -> list[int]:
        """Ranks that died at their planned kill point."""
        return [o.rank for o in self.outcomes if o.status == "killed"]

    def report(self) -> str:
        """What happened, folded by rank: ``sub-world fit (4 ranks): ranks 0-3 killed at step 4``."""
        groups: dict[str, list[int]] = {}
        for o in self.outcomes:
            groups.setdefault(o.describe(), []).append(o.rank)
        lines = [f"sub-world {self.name} ({self.size} rank{'s' if self.size != 1 else ''}):"]
        lines += [f"  {fold_ranks(ranks)}: {what}" for what, ranks in groups.items()]
        for o in self.outcomes:
            if o.status in ("raised", "crashed", "timeout") and (o.error or o.output):
                lines.append(f"--- rank {o.rank} ---")
                if o.error:
                    lines.append(o.error.rstrip())
                if o.output.strip():
                    lines.append(o.output.rstrip())
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------
# inside a sub-world rank


@dataclass(kw_only=True)
class _Context:
    rank: int
    plan: KillPlan | None
    channel: socket.socket
    counts: dict[str, int] = field(default_factory=dict)


_CONTEXT: _Context | None = None


def in_subworld() -> bool:
    """True inside a sub-world rank."""
    return _CONTEXT is not None


def _send(sock: socket.socket, message: tuple[Any, ...]) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_FRAME.pack(len(body)) + body)


def emit(name: str, value: Any) -> None:
    """Send ``value`` under ``name`` to the test that started this sub-world, now (it survives a kill).

    Outside a sub-world it does nothing, so instrumented code runs anywhere. ``value`` must be picklable;
    tensors should be on the CPU.
    """
    ctx = _CONTEXT
    if ctx is None:
        return
    _send(ctx.channel, ("event", name, value))


def kill_point(event: str, index: int | None = None, *, detail: str = "") -> None:
    """A point where the sub-world's kill plan may kill this rank: ``kill_point("step", 4)``.

    Counts every call per event name; the plan sees the count, the index and the detail. Outside a
    sub-world, or without a plan, it does nothing.
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
        _send(ctx.channel, ("killed", point, signum))
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signum)
        sleep(5.0)  # a catchable signal that was caught: die anyway
        os._exit(128 + int(signum))


# -------------------------------------------------------------------------------------------------------
# the request a rank is forked with


@dataclass(frozen=True, kw_only=True)
class _RankSpec:
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node: int
    device_index: int
    """The device this rank computes on: that of the test rank it runs on (its local rank in a plain test)."""
    local_devices: tuple[int, ...]
    """The device indices of the sub-world's ranks on this node, in local-rank order (``World.local_devices``)."""
    store_host: str
    store_port: int
    device: str
    timeout: float
    plan: KillPlan | None
    run_dir: str


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _export_env(spec: _RankSpec) -> None:
    from pytest_sprite._rankenv import become_rank, torchrun_variables

    become_rank(
        torchrun_variables(
            rank=spec.rank,
            local_rank=spec.local_rank,
            world_size=spec.world_size,
            local_world_size=spec.local_size,
            node=spec.node,
            master_addr=spec.store_host,
            master_port=spec.store_port,
        )
    )


def _rank_main(payload: bytes, channel: socket.socket) -> NoReturn:
    """Body of a sub-world rank (a fresh fork): join the sub-world, run the function, report, exit."""
    global _CONTEXT
    code = 0
    try:
        _die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        spec, fn, args, kwargs = pickle.loads(payload)
        _send(channel, ("ready",))  # start-up ends here: the process runs and has the function loaded
        run_dir = Path(spec.run_dir)
        out = os.open(run_dir / f"rank{spec.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        import faulthandler

        faulthandler.enable(file=sys.stderr, all_threads=True)
        stacks = open(run_dir / f"rank{spec.rank}.stacks", "w")
        faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
        _CONTEXT = _Context(rank=spec.rank, plan=spec.plan, channel=channel)
        world, store = _join(spec)
        try:
            value = fn(world, *args, **kwargs)
        except BaseException:
            _send(channel, ("raise", traceback.format_exc()))
            code = 1
        else:
            _send(channel, ("return", value))
        _leave(store, spec)
    except BaseException:
        try:
            _send(channel, ("raise", traceback.format_exc()))
        except OSError:
            pass
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _join(spec: _RankSpec) -> tuple[World, Any]:
    """Device, store and default process group of this sub-world rank; the World the function receives."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pytest_sprite import world as world_module
    from pytest_sprite._device import select_device
    from pytest_sprite.world import World

    _export_env(spec)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_size))
    device, backend = select_device(spec.device, spec.device_index, spec.local_size)
    if dist.is_initialized():  # inherited through fork only in a broken setup; never reuse a group
        raise RuntimeError("a sub-world rank started with a process group already initialized")
    timeout = timedelta(seconds=spec.timeout + 60)
    store = _tcp_store(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
    prefix_store: Any = getattr(dist, "PrefixStore")  # noqa: B009 (torch exports it without a stub)
    dist.init_process_group(
        backend=backend,
        store=prefix_store("pg", store),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
    )

    def sink(name: str, rank: int, tensor: torch.Tensor) -> None:
        emit(f"collected:{name}", tensor.detach().cpu().clone())

    world = World(
        rank=spec.rank,
        size=spec.world_size,
        local_rank=spec.local_rank,
        local_size=spec.local_size,
        local_devices=spec.local_devices,
        node=spec.node,
        device=device,
        backend=backend,
        _sink=sink,
    )
    world_module._set_current(world)
    return world, store


def _tcp_store(host: str, port: int, *, is_master: bool, timeout: Any = None) -> Any:
    """A TCPStore (torch exports the class without a type stub)."""
    from datetime import timedelta

    import torch.distributed as dist

    tcp_store: Any = getattr(dist, "TCPStore")  # noqa: B009
    return tcp_store(
        host, port, is_master=is_master, timeout=timeout or timedelta(seconds=300), wait_for_workers=False
    )


def _leave(store: Any, spec: _RankSpec) -> None:
    """Wait (bounded) until every rank has returned, so no peer loses a connection it still uses."""
    deadline = monotonic() + 60.0
    try:
        count = store.add("sprite/done", 1)
        while count < spec.world_size and monotonic() < deadline:
            sleep(0.005)
            count = store.add("sprite/done", 0)
    except Exception:  # a dead peer can break the store; this rank's result is already sent
        pass


# -------------------------------------------------------------------------------------------------------
# forking ranks: directly (a plain test), or through the test child's zygote (a ranks test)


class _Forker(Protocol):
    def spawn(self, payload: bytes, channel: socket.socket) -> int: ...

    def poll(self) -> dict[int, int]: ...


class _DirectForker:
    """Forks ranks from this process: a plain test's world of its own."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def spawn(self, payload: bytes, channel: socket.socket) -> int:
        if not self.pids:
            _prepare(payload)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                one_thread_after_fork()
                _rank_main(payload, channel)
            finally:
                os._exit(70)
        self.pids.append(pid)
        return pid

    def poll(self) -> dict[int, int]:
        done = {}
        for pid in list(self.pids):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                got, status = pid, 0
            if got:
                done[pid] = status
                self.pids.remove(pid)
        return done


class Zygote:
    """A copy of a test child forked before it touched a device: it forks that rank's sub-world processes.

    Started by the test child (``Zygote.start()``) while it is still free of devices and process groups;
    forking from it later gives a process as fresh as the test child was. It dies with the test child.
    """

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self._exits: dict[int, int] = {}
        self._buf = bytearray()

    @classmethod
    def start(cls, close_fds: Sequence[int] = ()) -> Zygote:
        """Fork the zygote now; call before the process initializes a device.

        ``close_fds`` are the caller's descriptors the zygote must not hold (its pipe to the agent), so
        that they close when the caller ends.
        """
        parent, child = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                parent.close()
                for fd in close_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                _zygote_main(child)
            finally:
                os._exit(70)
        child.close()
        return cls(pid, parent)

    def spawn(self, payload: bytes, channel: socket.socket) -> int:
        socket.send_fds(self.sock, [_FRAME.pack(len(payload))], [channel.fileno()])
        self.sock.sendall(payload)
        while True:
            for kind, pid, status in self._read(block=True):
                if kind == "pid":
                    return pid
                self._exits[pid] = status

    def poll(self) -> dict[int, int]:
        for kind, pid, status in self._read(block=False):
            if kind == "exit":
                self._exits[pid] = status
        done, self._exits = self._exits, {}
        return done

    def _read(self, *, block: bool) -> list[tuple[str, int, int]]:
        out: list[tuple[str, int, int]] = []
        while True:
            ready, _, _ = select.select([self.sock], [], [], None if block and not out else 0)
            if not ready:
                return out
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("the sub-world zygote of this rank died")
            self._buf += data
            while len(self._buf) >= 17:
                kind, pid, status = struct.unpack(">cQQ", bytes(self._buf[:17]))
                del self._buf[:17]
                out.append(("pid" if kind == b"p" else "exit", pid, status))
            if out:
                return out

    def close(self) -> None:
        """End the zygote (and any rank it still runs)."""
        self.sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _zygote_main(sock: socket.socket) -> NoReturn:
    """Serve fork requests until the test child closes the socket; report every rank's exit status."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    running: list[int] = []
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02)
        for pid in list(running):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                running.remove(pid)
                sock.sendall(struct.pack(">cQQ", b"e", pid, status))
        if not ready:
            continue
        header, fds, _, _ = socket.recv_fds(sock, _FRAME.size, 1)
        if not header:
            for pid in running:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        (length,) = _FRAME.unpack(header)
        payload = _recv_exact(sock, length)
        channel = socket.socket(fileno=fds[0])
        _prepare(payload)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _rank_main(payload, channel)
        channel.close()
        running.append(pid)
        sock.sendall(struct.pack(">cQQ", b"p", pid, 0))


def _prepare(payload: bytes) -> None:
    """Load, once in the process that forks the ranks, what every rank of the sub-world needs.

    Unpickling imports the function's modules; its ``subworld_prepare(*args, **kwargs)`` attribute, when
    it has one, can load more (a model on the CPU). Both stay loaded for every later fork. Must not touch
    a device or a process group. Errors are left for the rank to report.
    """
    try:
        _spec, fn, args, kwargs = pickle.loads(payload)
        prepare = getattr(fn, "subworld_prepare", None)
        if callable(prepare):
            prepare(*args, **kwargs)
    except Exception:
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed mid-message")
        buf += chunk
    return bytes(buf)


_ZYGOTE: Zygote | None = None
_PLAIN_FORKER: Callable[[], _Forker] | None = None
"""Replaces the plain test's fork, for ``bench/resume.py`` only (it times new interpreters against forks)."""


def zygote_pid() -> int | None:
    """The pid of this test child's zygote, None when it has none (a plain test, or outside a child)."""
    return _ZYGOTE.pid if _ZYGOTE is not None else None


def _set_zygote(zygote: Zygote | None) -> None:
    """Called by the test child: the zygote it forked before initializing its device."""
    global _ZYGOTE
    _ZYGOTE = zygote


# -------------------------------------------------------------------------------------------------------
# the host side: start, watch and collect


@dataclass(kw_only=True)
class _Hosted:
    rank: int
    pid: int
    channel: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    events: list[tuple[str, Any]] = field(default_factory=list)
    returned: bool = False
    value: Any = None
    error: str = ""
    killed_at: KillPoint | None = None
    status: int | None = None
    eof: bool = False
    ready_at: float | None = None
    ended: str = ""
    timed_out: bool = False


def _read_channel(h: _Hosted) -> None:
    while True:
        try:
            data = h.channel.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            h.eof = True
            return
        h.buf += data
        while len(h.buf) >= _FRAME.size:
            (length,) = _FRAME.unpack_from(h.buf)
            if len(h.buf) < _FRAME.size + length:
                break
            message = pickle.loads(bytes(h.buf[_FRAME.size : _FRAME.size + length]))
            del h.buf[: _FRAME.size + length]
            kind = message[0]
            if kind == "ready":
                h.ready_at = monotonic()
            elif kind == "event":
                h.events.append((message[1], message[2]))
            elif kind == "return":
                h.returned, h.value = True, message[1]
            elif kind == "raise":
                h.error = message[1]
            elif kind == "killed":
                h.killed_at = message[1]


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-_TAIL:])


def _outcome(h: _Hosted, run_dir: Path) -> RankOutcome:
    status = h.status if h.status is not None else 0
    signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    exitcode = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    output = _tail(run_dir / f"rank{h.rank}.log")
    common: dict[str, Any] = {
        "rank": h.rank,
        "events": tuple(h.events),
        "signum": signum,
        "exitcode": exitcode,
    }
    if h.returned:
        return RankOutcome(status="returned", value=h.value, **common)
    if h.killed_at is not None:
        return RankOutcome(status="killed", killed_at=h.killed_at, **common)
    if h.timed_out:
        stacks = _tail(run_dir / f"rank{h.rank}.stacks")
        return RankOutcome(status="timeout", error=h.ended, output=f"{output}\n{stacks}".strip(), **common)
    if h.error:
        return RankOutcome(status="raised", error=h.error, output=output, **common)
    if h.ended:
        return RankOutcome(status="ended", error=h.ended, **common)
    return RankOutcome(status="crashed", output=output, **common)


def _attribute(outcomes: Sequence[RankOutcome]) -> tuple[RankOutcome, ...]:
    """Peers of a rank that died fail in their next collective: they were ended by that death, not by a bug.

    Their traceback stays in ``output``; the dead rank comes first in the story.
    """
    import dataclasses

    dead = [o for o in outcomes if o.status in ("killed", "crashed")]
    if not dead:
        return tuple(outcomes)
    why = "; ".join(
        f"rank {o.rank} was killed at {o.killed_at.describe()}"
        if o.killed_at is not None
        else f"rank {o.rank} died before returning"
        for o in dead
    )
    return tuple(
        dataclasses.replace(o, status="ended", error=why, output=f"{o.error}\n{o.output}".strip())
        if o.status == "raised"
        else o
        for o in outcomes
    )


def _check_fn(fn: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    if not callable(fn):
        raise SpriteUsageError(f"run_subworld needs a function, got {type(fn).__name__}")
    try:
        pickle.dumps((fn, args, dict(kwargs)))
    except Exception as exc:
        raise SpriteUsageError(
            f"run_subworld({getattr(fn, '__qualname__', fn)!r}, ...): the function and its arguments must be "
            f"picklable, since every rank gets them in a fresh process ({type(exc).__name__}: {exc}); use a "
            "module-level function (not a lambda or a nested function) and plain, CPU-side arguments"
        ) from exc


def run_subworld(
    fn: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    ranks: int | None = None,
    kill: KillPlan | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> SubworldResult:
    """Run ``fn(world, *args, **kwargs)`` in a sub-world of ``ranks`` fresh processes; every rank's outcome.

    In a ranks test, call it on every rank of the test (like a collective); ranks ``0..ranks-1`` of the test
    each start one rank of the sub-world (default: as many as the test has; fewer is allowed, more is not).
    In a plain test the sub-world is a world of its own of ``ranks`` processes (default 1).
    ``kill`` (e.g. ``KillAt(event="step", at=4)``) kills ranks at their ``kill_point`` calls. The result
    is the same on every rank; ``result.values()`` raises unless every rank returned.
    """
    from pytest_sprite.world import current_world

    if _CONTEXT is not None:
        raise SpriteUsageError(
            "run_subworld cannot be nested: this process is already a rank of a sub-world. Start every "
            "sub-world from the test itself, one after another"
        )
    kwargs = dict(kwargs or {})
    args = tuple(args)
    _check_fn(fn, args, kwargs)
    if kill is not None and not isinstance(kill, KillPlan):
        raise SpriteUsageError(
            f"kill= must be a kill plan with should_kill(point) (e.g. KillAt(event='step', at=4)), got {kill!r}"
        )
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise SpriteUsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
    world = current_world()
    if world is not None and world.distributed:
        return _run_in_ranks_test(world, fn, args, kwargs, ranks, kill, float(timeout))
    return _run_in_plain_test(fn, args, kwargs, ranks, kill, float(timeout))


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn))))


def _check_ranks(ranks: object, most: int | None) -> int:
    if ranks is None:
        return most or 1
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise SpriteUsageError(f"run_subworld(ranks={ranks!r}): a positive int")
    if most is not None and ranks > most:
        raise SpriteUsageError(
            f"run_subworld(ranks={ranks}): a sub-world has the same or fewer ranks than the test that starts "
            f"it, which has {most}; mark the test @pytest.mark.ranks({ranks}) or ask for fewer"
        )
    return ranks


def _refuse_initialized_device() -> None:
    """A plain test forks from its own process, which must not hold an initialized CUDA or XPU context."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        initialized = getattr(module, "is_initialized", None)
        if initialized is not None and initialized():
            raise SpriteUsageError(
                f"run_subworld in a test without the ranks marker forks this process, which has already "
                f"initialized {kind}, and a forked {kind} context does not work; mark the test "
                "@pytest.mark.ranks(n) (its sub-worlds fork from a copy made before any device was touched)"
            )


def _run_in_plain_test(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ranks: int | None,
    kill: KillPlan | None,
    timeout: float,
) -> SubworldResult:

    size = _check_ranks(ranks, None)
    forker = _PLAIN_FORKER() if _PLAIN_FORKER is not None else None
    if forker is None:
        _refuse_initialized_device()
    start = monotonic()
    store = _tcp_store("127.0.0.1", 0, is_master=True)
    specs = [
        dict(
            rank=r,
            world_size=size,
            local_rank=r,
            local_size=size,
            node=0,
            device_index=r,
            local_devices=tuple(range(size)),
            store_host="127.0.0.1",
        )
        for r in range(size)
    ]
    hosted, forker, run_dir = _start(
        forker or _DirectForker(), fn, args, kwargs, specs, store.port, kill, timeout, "auto"
    )
    _watch(hosted, forker, store, size, timeout, start, kill)
    outcomes = [_outcome(h, run_dir) for h in hosted]
    _cleanup(run_dir)
    return SubworldResult(
        name=_name(fn),
        outcomes=_attribute(outcomes),
        wall_s=monotonic() - start,
        start_s=_ready(hosted, start),
    )


def _run_in_ranks_test(
    world: World,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ranks: int | None,
    kill: KillPlan | None,
    timeout: float,
) -> SubworldResult:

    size = _check_ranks(ranks, world.size)
    if _ZYGOTE is None:
        raise SpriteUsageError(
            "run_subworld in a ranks test needs the harness's pre-initialized fork of this rank, which this "
            "test child does not have; it runs only inside tests that pytest-sprite started"
        )
    start = monotonic()
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store: Any = None
    if world.rank == 0:
        store = _tcp_store(host, 0, is_master=True)
        port = world.broadcast_object(int(store.port))
    else:
        port = world.broadcast_object(0)
        store = _tcp_store(host, port, is_master=False)
    layout = world.gather_object((world.node, world.local_devices[world.local_rank]))
    mine = [dict(_subworld_place(layout, size, world.rank), store_host=host)] if world.rank < size else []
    hosted, forker, run_dir = _start(_ZYGOTE, fn, args, kwargs, mine, port, kill, timeout, world.device.type)
    _watch(hosted, forker, store, size, timeout, start, kill)
    outcomes = [_outcome(h, run_dir) for h in hosted]
    _cleanup(run_dir)
    gathered = world.gather_object((outcomes, _ready(hosted, start)))
    world.barrier()
    if world.rank == 0:
        store = None  # the store's server ends here, after every rank is done with it
    all_outcomes = sorted((o for part, _ in gathered for o in part), key=lambda o: o.rank)
    return SubworldResult(
        name=_name(fn),
        outcomes=_attribute(all_outcomes),
        wall_s=world.broadcast_object(monotonic() - start),
        start_s=max(s for _, s in gathered[:size]) if size else 0.0,
    )


def _subworld_place(layout: Sequence[tuple[int, int]], size: int, rank: int) -> dict[str, Any]:
    """Where sub-world rank ``rank`` of ``size`` sits, from each test rank's (node, device index) in ``layout``.

    Sub-world rank r runs on test rank r and computes on that rank's device (the rule that places a test's
    ranks on agents): a packed test sits on any agents' devices (4 and 5, say), so the sub-world's own local
    rank (0, 1) would pick a neighbour's.
    """
    return dict(rank=rank, world_size=size, **dataclasses.asdict(place(layout[:size])[rank]))


def _start(
    forker: _Forker,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    specs: list[dict[str, Any]],
    port: int,
    kill: KillPlan | None,
    timeout: float,
    device: str,
) -> tuple[list[_Hosted], _Forker, Path]:
    run_dir = Path(tempfile.mkdtemp(prefix="sprite-subworld-"))
    hosted = []
    for fields_ in specs:
        spec = _RankSpec(
            name=_name(fn),
            store_port=port,
            device=device,
            timeout=timeout,
            plan=kill,
            run_dir=str(run_dir),
            **fields_,
        )
        mine, theirs = socket.socketpair()
        payload = pickle.dumps((spec, fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        pid = forker.spawn(payload, theirs)
        theirs.close()
        mine.setblocking(False)
        hosted.append(_Hosted(rank=spec.rank, pid=pid, channel=mine))
    return hosted, forker, run_dir


def _ready(hosted: list[_Hosted], start: float) -> float:
    """Seconds from ``start`` until the last hosted rank was running with its function loaded."""
    times = [h.ready_at for h in hosted if h.ready_at is not None]
    return max(times) - start if times else 0.0


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _watch(
    hosted: list[_Hosted],
    forker: _Forker,
    store: Any,
    size: int,
    timeout: float,
    start: float,
    kill: KillPlan | None,
) -> None:
    """Read every hosted rank until it ends; end them all when any dies or the time is up.

    A rank that the kill plan also kills where another rank was killed (``KillAt("step", 4)`` on every
    rank) first gets up to ``_PEER_KILL_GRACE`` seconds to reach that point: a rank still finishing the
    step before it would otherwise be ended, not killed there, and the plan's kill would not be what ran.
    """
    deadline = start + timeout
    last_poll = 0.0
    first_death: float | None = None
    while any(h.status is None for h in hosted) or any(not h.eof for h in hosted):
        socks = [h.channel for h in hosted if not h.eof]
        if socks:
            select.select(socks, [], [], 0.02)
        else:
            sleep(0.02)
        for h in hosted:
            if not h.eof:
                _read_channel(h)
        for pid, status in forker.poll().items():
            for h in hosted:
                if h.pid == pid:
                    h.status = status
                    if not h.eof:
                        _read_channel(h)
                    if not h.returned and not h.ended:
                        why = (
                            f"rank {h.rank} was killed at {h.killed_at.describe()}"
                            if h.killed_at is not None
                            else f"rank {h.rank} died before returning"
                        )
                        store.set(f"sprite/ended/{h.rank}", why)
                        if h.killed_at is not None:
                            point = h.killed_at
                            store.set(
                                f"sprite/killed/{h.rank}", json.dumps([point.event, point.count, point.index])
                            )
                        store.add("sprite/ended", 1)
        now = monotonic()
        if now - last_poll > 0.05:
            last_poll = now
            if store.add("sprite/ended", 0) > 0:
                first_death = now if first_death is None else first_death
                spared = (
                    _due_to_be_killed(hosted, store, size, kill)
                    if now - first_death < _PEER_KILL_GRACE
                    else ()
                )
                _end_live(hosted, store, size, spared=spared)
        if now > deadline:
            for h in hosted:
                if h.status is None:
                    h.timed_out = True
                    h.ended = f"did not finish within the sub-world's timeout of {timeout:g} s"
                    _kill(h.pid, _STACK_SIGNAL)
            sleep(1.0)
            for h in hosted:
                if h.status is None:
                    _kill(h.pid, signal.SIGKILL)
            deadline = float("inf")
    for h in hosted:
        h.channel.close()


def _due_to_be_killed(hosted: list[_Hosted], store: Any, size: int, kill: KillPlan | None) -> tuple[int, ...]:
    """The live hosted ranks that ``kill`` kills at a point where another rank of the sub-world was killed."""
    if kill is None:
        return ()
    points = []
    for r in range(size):
        if store.check([f"sprite/killed/{r}"]):
            event, count, index = json.loads(store.get(f"sprite/killed/{r}"))
            points.append((event, count, index))
    return tuple(
        h.rank
        for h in hosted
        if h.status is None
        and not h.returned
        and any(
            kill.should_kill(KillPoint(rank=h.rank, event=event, count=count, index=index, detail=""))
            for event, count, index in points
        )
    )


def _end_live(hosted: list[_Hosted], store: Any, size: int, *, spared: tuple[int, ...] = ()) -> None:
    for h in hosted:
        if h.rank in spared:
            continue
        if h.status is None and not h.ended and not h.returned:
            whose = [
                store.get(f"sprite/ended/{r}").decode()
                for r in range(size)
                if store.check([f"sprite/ended/{r}"])
            ]
            h.ended = "; ".join(whose) or "another rank of the sub-world died"
            _kill(h.pid, signal.SIGKILL)
        elif h.status is None and h.returned:
            _kill(h.pid, signal.SIGKILL)  # it returned and waits for the dead rank at its exit


def _cleanup(run_dir: Path) -> None:
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
