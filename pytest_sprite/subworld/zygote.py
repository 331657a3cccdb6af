"""Forking sub-world ranks: directly from a plain test's process, or through the test child's zygote.

A zygote is a process that never touched a device or a process group; forking a sub-world's
rank from it gives a process as fresh as a test child. Each rank agent forks one *pristine* zygote the
first time one of its test children asks for one (:class:`Pristine`); the first ``run_subworld`` of a test
child asks it for that test's own zygote (:meth:`Zygote.connect`), which serves the test's sub-worlds,
leads a session of its own (so what its ranks leave running is found and named with the test's leftovers)
and ends with the test child. A test that never starts a sub-world pays nothing for them, nor does a
session.

Between the two sits one *warm* process per test rank, forked by the pristine zygote the first time that
test rank asks: it forks that test rank's zygotes, and each zygote tells it what it forked. Where the function
can rehearse (its ``subworld_rehearse(seat, *args, **kwargs)`` attribute, a resume role's fit on a dry world
of the same rank and size), the warm process rehearses it once, between requests, so the next tests' ranks
start with torch's per-process caches filled (``subworld/dry_world.py``).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Protocol

from pytest_sprite.plumbing.process import (
    computing_before_fork,
    die_with_parent,
    exit_descriptor,
    name_process,
    one_thread_after_fork,
)
from pytest_sprite.plumbing.protocol import (
    forked,
    read_zygote_news,
    recv_fork_request,
    send_fork_request,
    zygote_news,
)
from pytest_sprite.plumbing.timing import monotonic

from .rank_body import rank_main

__all__ = [
    "DirectForker",
    "Forker",
    "Pristine",
    "Zygote",
    "current_zygote",
    "set_pristine",
    "settle_zygote_ranks",
    "zygote_pid",
]


class Forker(Protocol):
    """Starts sub-world ranks and says which of them ended."""

    reaps: bool
    """True: another process reaps the ranks and reports each exit whenever it happens (a zygote), so a
    host may take a rank that returned and closed its channel as done without waiting for its exit."""

    def spawn(self, request: tuple[Any, ...], channel: socket.socket, host_fds: Sequence[int] = ()) -> int:
        """Start a rank running ``request`` (spec, fn, args, kwargs) that talks on ``channel``; its pid.

        ``host_fds``: descriptors of the host (the store's listening socket) a rank forked from it closes.
        """
        ...

    def poll(self) -> dict[int, int]:
        """The ranks that ended since the last call: pid -> wait status."""
        ...

    def waitable(self) -> list[int]:
        """Descriptors that become readable when a rank may have ended: the host waits on them with the
        ranks' channels, so an exit wakes it at once (none: it polls)."""
        ...


class DirectForker:
    """Forks ranks from this process: a plain test's world of its own."""

    reaps = False  # its ranks are this process's children: it waits for every exit, leaving no zombie

    def __init__(self) -> None:
        self.exits: dict[int, int | None] = {}
        """Each running rank's pid -> its exit descriptor (None: polled)."""

    def spawn(self, request: tuple[Any, ...], channel: socket.socket, host_fds: Sequence[int] = ()) -> int:
        """Fork the rank from this process: it has ``request`` already, so nothing is pickled."""
        if not self.exits:
            _prepare(request)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for fd in (*host_fds, *(fd for fd in self.exits.values() if fd is not None)):
                    os.close(fd)
                one_thread_after_fork()
                rank_main(request, channel)
            finally:
                os._exit(70)
        self.exits[pid] = exit_descriptor(pid)
        return pid

    def poll(self) -> dict[int, int]:
        done = {}
        for pid, fd in list(self.exits.items()):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                got, status = pid, 0
            if got:
                done[pid] = status
                del self.exits[pid]
                if fd is not None:
                    os.close(fd)
        return done

    def waitable(self) -> list[int]:
        return [fd for fd in self.exits.values() if fd is not None]


class Zygote:
    """A test child's zygote: a process free of devices and process groups that forks its sub-world ranks.

    Asked for by the test child's first sub-world (:meth:`connect`); it ends when the test child closes
    its socket (by ending), and ends the ranks it still runs.
    """

    reaps = True

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        """The ranks it forked whose exit it has not reported yet."""
        self._buf = bytearray()

    @classmethod
    def connect(cls, pristine: socket.socket, rank: int) -> Zygote:
        """This test's own zygote, for test rank ``rank``, forked through the agent's pristine zygote by that
        rank's warm process; it ends when this process does."""
        mine, theirs = socket.socketpair()
        send_fork_request(pristine, str(rank).encode(), theirs)
        theirs.close()
        zygote = cls(0, mine)
        for kind, pid, _ in zygote._read(block=True):  # its first news is its own pid
            if kind == "pid":
                zygote.pid = pid
        return zygote

    def spawn(self, request: tuple[Any, ...], channel: socket.socket, host_fds: Sequence[int] = ()) -> int:
        """Ask the zygote to fork the rank; the zygote holds none of the host's descriptors."""
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        send_fork_request(self.sock, payload, channel)
        while True:
            for kind, pid, status in self._read(block=True):
                if kind == "pid":
                    self._live.add(pid)
                    return pid
                self._exits[pid] = status

    def poll(self) -> dict[int, int]:
        for kind, pid, status in self._read(block=False):
            if kind == "exit":
                self._exits[pid] = status
        done, self._exits = self._exits, {}
        return done

    def waitable(self) -> list[int]:
        """The zygote's socket: it reports each exit as it happens."""
        return [self.sock.fileno()]

    def settle(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until every rank it forked has ended: a host took the ranks
        that returned as done before their exits (the test's leftover search must not find one exiting)."""
        deadline = monotonic() + timeout
        while self._live:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - monotonic()))
            if not ready:
                return
            for kind, pid, status in self._read(block=False):
                if kind == "exit":
                    self._exits[pid] = status

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
            out += read_zygote_news(self._buf)
            self._live.difference_update(pid for kind, pid, _ in out if kind == "exit")
            if out:
                return out

    def close(self) -> None:
        """End the zygote (and any rank it still runs)."""
        self.sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class Pristine:
    """A rank agent's pristine zygote, forked the first time one of its test children starts a sub-world.

    Test children ask on :attr:`client` (:meth:`Zygote.connect`), which every child inherits from the agent.
    Until the first request the zygote is only a socket pair: the agent watches :meth:`waiting` and calls
    :meth:`start` when a request is there, so a session whose tests start no sub-world forks no zygote (two
    forks, their exits and ~30 ms of CPU a session on the 2-core test machine). Forked later
    than at the agent's start, it is still a copy of a process that never touched a device or a process
    group, computed nothing and runs no thread: the agent does none of those.
    """

    def __init__(self) -> None:
        self.client, self._serve = socket.socketpair()
        self.pid: int | None = None

    def waiting(self) -> socket.socket | None:
        """The socket on which the first request arrives while no zygote runs; None once one does."""
        return self._serve if self.pid is None else None

    def start(self, *, close_fds: Sequence[int], forget: Callable[[], None]) -> None:
        """Fork the pristine zygote now; it answers the request waiting on the socket and every later one.

        ``close_fds``: the agent's descriptors it must not hold (its connection to the controller, its test
        children's pipes). ``forget`` runs in the zygote first: drop what the agent holds for its test
        children, so no sub-world rank holds it.
        """
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                self.client.close()
                for fd in close_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                forget()
                _pristine_main(self._serve)
            finally:
                os._exit(70)
        self._serve.close()
        self.pid = pid

    def close_in_child(self) -> None:
        """In a test child of the agent: hold only the asking end."""
        if self.pid is None:
            self._serve.close()

    def close(self) -> None:
        """The agent is done: the zygote, once every test child has closed its end too, ends."""
        self.client.close()
        if self.pid is None:
            self._serve.close()


def _pristine_main(sock: socket.socket) -> NoReturn:
    """Pass each request (a test zygote for test rank r) to rank r's warm process, forking it the first time;
    never returns. Ends when the agent and every test child closed the socket."""
    die_with_parent()
    name_process("pristine")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warm: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([sock], [], [], 1.0)
        _reap_any()
        if not ready:
            continue
        request = recv_fork_request(sock)
        if request is None:  # the agent and every test child closed it
            os._exit(0)  # the warm processes and their zygotes die with it
        payload, channel = request
        rank = int(payload)  # Zygote.connect sends the test rank
        if rank not in warm:
            warm[rank] = _fork_warm(rank, close=[sock, *warm.values()])
        send_fork_request(warm[rank], b"", channel)
        channel.close()


def _fork_warm(rank: int, close: Sequence[socket.socket]) -> socket.socket:
    """Fork test rank ``rank``'s warm process; the socket that asks it for test zygotes."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            for other in (*close, mine):
                other.close()
            _warm_main(theirs, rank)
        finally:
            os._exit(70)
    theirs.close()
    return mine


def _warm_main(sock: socket.socket, rank: int) -> NoReturn:
    """Fork one test zygote per request, each a session leader serving the socket it was sent; between
    requests, rehearse what the zygotes report they forked (:func:`_rehearsal`), a step at a time. Never returns.

    Nothing is rehearsed before the rank's second test with a sub-world: a session that runs one (a project's
    single resume check, most of pytest-sprite's own test sessions) would pay a rehearsal no test inherits.
    """
    die_with_parent()
    name_process("warm")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hints: list[socket.socket] = []
    rehearsals: list[Iterator[None]] = []
    zygotes = 0
    while True:
        ready, _, _ = select.select([sock, *hints], [], [], 0 if rehearsals else 1.0)
        _reap_any()
        if sock in ready:  # a test waits for its zygote: before any rehearsal
            request = recv_fork_request(sock)
            if request is None:
                os._exit(0)
            hints.append(_fork_zygote(request[1], close=[sock, *hints]))
            zygotes += 1
            continue
        for hint in ready:
            try:
                payload = hint.recv(_HINT_BYTES)
            except OSError:
                payload = b""
            if not payload:  # the zygote ended
                hints.remove(hint)
                hint.close()
            elif zygotes > 1:
                rehearsals.append(_rehearsal(payload, rank))
        if not ready and rehearsals and next(rehearsals[0], _DONE) is _DONE:  # one step, nothing waiting
            rehearsals.pop(0)


_DONE = object()


_HINT_BYTES = 4 << 20
"""The largest hint a zygote sends its warm process (the socket's send buffer is set to it where allowed)."""


def _fork_zygote(channel: socket.socket, close: Sequence[socket.socket]) -> socket.socket:
    """Fork a test zygote serving ``channel``; the socket on which it reports what it forked."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            for other in (*close, mine):
                other.close()
            os.setsid()  # what its ranks leave running stays in this session, found by the test child
            channel.sendall(forked(os.getpid()))
            try:
                theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _HINT_BYTES)
            except OSError:
                pass
            theirs.setblocking(False)
            _zygote_main(channel, theirs)
        finally:
            os._exit(70)
    channel.close()
    theirs.close()
    return mine


def _rehearsal(payload: bytes, rank: int) -> Iterator[None]:
    """In test rank ``rank``'s warm process: rehearse the sub-world rank a zygote forked, where it is this
    test rank's own seat (a rehearsal is sound only as the same rank of a world of the same size) and its
    function can. Not under ``--sprite-mutate`` (its own group backend) or for a rank that joins no world.
    Runs in steps: a ``subworld_rehearse`` that returns an iterator is advanced one item a step, so the
    warm process serves a test waiting for its zygote between them. A failed rehearsal costs only the
    time: its error is the real rank's to report."""
    try:
        spec, fn, args, kwargs = pickle.loads(payload)
        rehearse = getattr(fn, "subworld_rehearse", None)
        if (
            not callable(rehearse)
            or spec.seat.rank != rank
            or not spec.join
            or spec.group_backend is not None
        ):
            return
        steps = rehearse(spec.seat, *args, **kwargs)
        while isinstance(steps, Iterator) and next(steps, _DONE) is not _DONE:
            yield
    except Exception:
        return


def _reap_any() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _zygote_main(sock: socket.socket, hint: socket.socket | None = None) -> NoReturn:
    """Serve fork requests until the test child closes the socket; report every rank's exit status.

    ``hint``: where each new request is passed on after its rank is forked (the test rank's warm process),
    never waiting: a request the warm process has no room for is not rehearsed. The zygote does not rehearse
    itself: its first sub-world would wait for it, and a test's few later ones do not win it back (the main
    job was 6% slower so).
    """
    die_with_parent()
    name_process("zygote")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    running: dict[int, int | None] = {}  # each rank's pid -> its exit descriptor (None: polled)
    hinted: set[bytes] = set()
    while True:
        exits = [fd for fd in running.values() if fd is not None]
        polled = len(exits) < len(running)
        ready, _, _ = select.select([sock.fileno(), *exits], [], [], 0.02 if polled else 1.0)
        for pid, fd in list(running.items()):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                del running[pid]
                if fd is not None:
                    os.close(fd)
                sock.sendall(zygote_news(pid, status))
        if sock.fileno() not in ready:
            continue
        request = recv_fork_request(sock)
        if request is None:
            for pid in running:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _end_own_session()
            os._exit(0)
        payload, channel = request
        _prepare(payload)
        pid = os.fork()
        if pid == 0:
            sock.close()
            if hint is not None:
                hint.close()
            for fd in running.values():
                if fd is not None:
                    os.close(fd)
            rank_main(payload, channel)
        channel.close()
        running[pid] = exit_descriptor(pid)
        sock.sendall(forked(pid))
        if hint is not None and payload not in hinted:
            hinted.add(payload)
            try:
                hint.send(payload)
            except OSError:  # no room, too large, or the warm process ended
                pass


def _end_own_session() -> None:
    """A test's zygote, its test child gone: kill what its sub-worlds' ranks left in its session.

    A test child that ended normally already ended and named them; one that crashed could not.
    """
    me = os.getpid()
    if os.getsid(0) != me or not os.path.isdir("/proc"):
        return
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.getsid(int(name)) == me:
                os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass


def _prepare(request: bytes | tuple[Any, ...]) -> None:
    """Load, once in the process that forks the ranks, what every rank of the sub-world needs.

    Unpickling imports the function's modules; its ``subworld_prepare(*args, **kwargs)`` attribute, when
    it has one, can load more (a model on the CPU). Both stay loaded for every later fork. Must not touch
    a device or a process group. Errors are left for the rank to report.
    """
    try:
        _spec, fn, args, kwargs = pickle.loads(request) if isinstance(request, bytes) else request
        prepare = getattr(fn, "subworld_prepare", None)
        if callable(prepare):
            with computing_before_fork():
                prepare(*args, **kwargs)
    except Exception:
        pass


_ZYGOTE: Zygote | None = None
_PRISTINE: socket.socket | None = None


def current_zygote(rank: int) -> Zygote | None:
    """This test child's zygote (it is test rank ``rank``), asked for on first use; None outside a test child
    (a plain test)."""
    global _ZYGOTE
    if _ZYGOTE is None and _PRISTINE is not None:
        _ZYGOTE = Zygote.connect(_PRISTINE, rank)
    return _ZYGOTE


def settle_zygote_ranks(timeout: float = 5.0) -> None:
    """In a test child: wait until the ranks of its sub-worlds have all ended (:meth:`Zygote.settle`)."""
    if _ZYGOTE is not None:
        _ZYGOTE.settle(timeout)


def zygote_pid() -> int | None:
    """The pid of this test child's zygote, None while it has none (no sub-world started yet)."""
    return _ZYGOTE.pid if _ZYGOTE is not None else None


def set_pristine(sock: socket.socket | None) -> None:
    """Called by the test child: where its zygote comes from, the first time a sub-world needs it."""
    global _PRISTINE
    _PRISTINE = sock
