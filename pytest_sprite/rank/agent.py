"""Rank agent: one per rank for the whole session; forks a fresh child for every ranks test.

The agent never touches a device. It relays its child's frames to the controller unchanged, watches
the child's exit, and on the controller's ``abort`` takes the child's Python stacks (faulthandler on
STACK_SIGNAL) before killing it. Agent 0 keeps the next test's rendezvous socket listening and sends
its port with ``agent_ready`` and every ``child_exited``. Depends on nothing of the controller side.
"""

from __future__ import annotations

import gc
import os
import select
import shutil
import signal
import socket
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..glue.pytest_internals import fresh_session_state
from ..plumbing.coverage import agent_started
from ..plumbing.output import hide_library_frames, tail_of_file
from ..plumbing.process import collapse_heap_once
from ..plumbing.protocol import (
    CHILD_DONE,
    AgentReady,
    EndedBy,
    FrameReader,
    RunSpec,
    child_exited,
    encode_frame,
    frame_event,
    recv_frame,
    send_frame,
)
from ..plumbing.stacks import Stacks, keep_stack_dumps, read_stacks, take_stacks
from ..plumbing.timing import monotonic, sleep
from ..subworld import Pristine
from ..subworld.join import store_listener
from .child import forget_child_session, register_child_session, run_spare
from .leftovers import describe_leftovers, end_session_leftovers

__all__ = ["Agent", "connect_to_controller"]

_TAIL_LINES = 40
_SETTLE = 2.0
"""Seconds what a crashed or ended child's session still holds gets to end by itself before it is a leftover."""


@dataclass
class _Child:
    run_id: int
    pid: int
    rfd: int
    run_dir: Path
    reader: FrameReader = field(default_factory=FrameReader)
    eof: bool = False
    ended_by: EndedBy | None = None
    detail: str = ""
    status: int | None = None
    no_stack: str = ""
    """Why no stack could be taken at an abort (empty: taken, or not asked for)."""
    last: bool = False
    """The session's last ranks test: no spare is forked for a test after it."""
    relayed: socket.socket | None = None
    """Where the agent says it has passed a report on: the child waits for that before its next phase."""


@dataclass
class _Spare:
    """A forked child waiting for its test."""

    pid: int
    control: socket.socket
    rfd: int
    run_dir: Path


class _ChildTracebacks:
    """Hooks that run in the test children this agent forks (registered here, inherited by each fork)."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        # Only a raised exception has frames to hide: marking every loaded module costs a passing test
        # milliseconds of copy-on-write faults (it writes to each module's globals) for nothing.
        if call.excinfo is not None:
            hide_library_frames(item.config)
        return (yield)


def prepare_children(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """What every test child inherits from its agent: stacks it can always dump, tracebacks without our frames,
    no fixture state of the controller's, no measured lines but its own (under coverage).

    The agent runs no test itself, so none of it touches the agent; done here once, no child
    pays for it.
    """
    keep_stack_dumps()
    fresh_session_state(items)
    agent_started()  # each rank then writes only the lines it ran
    if not config.pluginmanager.has_plugin("sprite-child-tracebacks"):
        config.pluginmanager.register(_ChildTracebacks(), "sprite-child-tracebacks")


def connect_to_controller(host: str, port: int, timeout: float = 60.0) -> socket.socket:
    """Connect to the controller, retrying while it is not yet listening."""
    deadline = monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10.0)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if monotonic() > deadline:
                raise
            sleep(0.2)


@dataclass(kw_only=True, eq=False, repr=False)
class Agent:
    """Serves the controller's commands for one rank until ``shutdown`` or the controller goes away."""

    config: pytest.Config
    items: Mapping[str, pytest.Item]
    rank: int
    sock: socket.socket
    rendezvous_bind: str = ""
    """Address agent 0 binds the rendezvous socket to: loopback for forked agents, all interfaces otherwise."""
    child: _Child | None = field(default=None, init=False)
    reserved: socket.socket | None = field(default=None, init=False)
    exiting: list[int] = field(default_factory=list, init=False)
    spare: _Spare | None = field(default=None, init=False)
    pristine: Pristine | None = field(default=None, init=False)
    """The agent's pristine sub-world zygote (``subworld.zygote``), from which a test's own is forked:
    forked the first time a test child asks for one."""
    _spares: int = field(default=0, init=False)
    """Children that reported done and are still tearing down; reaped without blocking."""
    workdir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"sprite-rank{self.rank}-"))

    def say_ready(
        self,
        *,
        token: str,
        local_rank: int,
        world_size: int,
        node: int | None = None,
        collect_errors: Mapping[str, str] | None = None,
    ) -> None:
        """Tell the controller who this agent is and where the launcher placed it (its first frame), and a
        launched agent's collection errors, which the controller compares with its own."""
        hello = AgentReady(
            token=token,
            rank=self.rank,
            local_rank=local_rank,
            world_size=world_size,
            node=node,
            host=socket.gethostname(),
            pid=os.getpid(),
            next_port=self._reserve_port(),
        )
        if collect_errors:
            hello["collect_errors"] = dict(collect_errors)
        send_frame(self.sock, "agent_ready", hello)

    # -- main loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        """Run commands until told to stop; always reaps the child and removes the work dir."""
        prepare_children(self.config, list(self.items.values()))
        # A launched agent's own heap (a forked one inherits the controller's decision): a child per ranks test.
        collapse_heap_once(forks=sum(1 for item in self.items.values() if item.get_closest_marker("ranks")))
        # Before any test child: where they ask for a sub-world zygote (forked at the first request).
        self.pristine = Pristine()
        register_child_session(self.config)
        try:
            self._fork_spare()  # the first test's child prepares while the other agents start
            while self._loop_once():
                pass
        finally:
            if self.child is not None:
                self._kill_child()
            if self.reserved is not None:
                self.reserved.close()
            if self.spare is not None:
                self._discard_spare(self.spare)
                self.spare = None
            self._reap_exiting(block=True)
            if self.pristine is not None:
                self.pristine.close()
                self.pristine = None
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _loop_once(self) -> bool:
        watched: list[Any] = [self.sock]
        if self.child is not None and not self.child.eof:
            watched.append(self.child.rfd)
        asking = self.pristine.waiting() if self.pristine is not None else None
        if asking is not None:
            watched.append(asking)
        readable, _, _ = select.select(watched, [], [], 0.1)
        if asking is not None and asking in readable:
            self._start_pristine()
        if self.child is not None and self.child.rfd in readable:
            eof = self._relay_child_output()
            if eof and self.child is not None:  # closed by exiting: reap it now, not at the next tick
                self.child.eof = True
                self._reap(block=True)
        if self.sock in readable:
            frame = recv_frame(self.sock)
            if frame is None:  # the controller went away: nothing left to serve
                return False
            command, payload = frame
            if not self._handle(command, payload):
                return False
        if self.child is not None:
            self._reap(block=False)
        if self.exiting:
            self._reap_exiting()
        return True

    def _handle(self, command: str, payload: dict[str, Any]) -> bool:
        handler = getattr(self, f"cmd_{command}", None)
        if handler is None:
            raise ValueError(f"unknown command from controller: {command!r}")
        return handler(payload) is not False

    # -- commands ------------------------------------------------------------------------------

    def _reserve_port(self) -> int | None:
        """Keep a rendezvous socket listening on this host for the next test whose rank 0 runs here.

        The socket is already listening when the other ranks connect, so no client is refused and
        none waits out TCPStore's reconnect backoff; the port is the test's own. Reserved ahead, so
        a test starts without asking for it. Every agent holds one: with packing any agent may run
        a test's rank 0.
        """
        if self.reserved is None:
            self.reserved = store_listener(self.rendezvous_bind)
        port: int = self.reserved.getsockname()[1]
        return port

    def cmd_run(self, spec: RunSpec) -> None:
        """Hand ``spec['nodeid']`` to a fresh child that runs it as rank ``spec['rank']`` of ``spec['world_size']``."""
        run_id, nodeid = spec["run_id"], spec["nodeid"]
        if self.child is not None:  # the controller waits for child_exited; a busy agent is a bug
            raise RuntimeError(f"rank {self.rank} got a new test while still running run {self.child.run_id}")
        item = self.items.get(nodeid)
        if item is None:
            send_frame(
                self.sock,
                "agent_error",
                {
                    "run_id": run_id,
                    "rank": self.rank,
                    "message": f"rank agent {self.rank} did not collect {nodeid!r} "
                    "(its collection differs from the controller's)",
                },
            )
            return
        spare = self._take_spare()
        listener = None
        if spec["rank"] == 0:  # only the test's rank 0 hosts its store; other ranks keep the reservation
            listener, self.reserved = self.reserved, None
        fds = [listener.fileno()] if listener is not None else []
        try:
            socket.send_fds(spare.control, [encode_frame("run", spec)], fds)
        except OSError:
            spare.control.close()  # a spare that died: the child's end shows it
            raise
        finally:
            if listener is not None:
                listener.close()  # the child holds its own copy
        self.child = _Child(
            run_id=run_id,
            pid=spare.pid,
            rfd=spare.rfd,
            run_dir=spare.run_dir,
            last=spec["last"],
            relayed=spare.control,
        )

    def _start_pristine(self) -> None:
        """A test child asked for its first sub-world: fork the pristine zygote that serves them."""
        assert self.pristine is not None
        own = [self.sock.fileno()]
        if self.reserved is not None:
            own.append(self.reserved.fileno())
        if self.child is not None:
            own.append(self.child.rfd)
        if self.spare is not None:
            own += [self.spare.control.fileno(), self.spare.rfd]
        config = self.config
        self.pristine.start(close_fds=own, forget=lambda: forget_child_session(config))

    # -- spare children ----------------------------------------------------------------------

    def _fork_spare(self) -> None:
        """Fork the next test's child now, while the agent waits or its current test runs.

        The spare waits for its test on a socket. Forking a process that holds torch and preparing
        its output files and sub-world zygote costs a tenth of a second (more when many ranks share
        few cores) that would otherwise sit between two tests.
        """
        self._spares += 1
        run_dir = self.workdir / f"child{self._spares}"
        run_dir.mkdir()
        parent_end, child_end = socket.socketpair()
        rfd, wfd = os.pipe()
        # Move every object the agent holds out of the collector's reach: a collection in the child
        # would otherwise write to (and so copy) every page of the inherited heap.
        gc.freeze()
        agent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the spare child
            try:
                parent_end.close()
                os.close(rfd)
                self.sock.close()
                if self.reserved is not None:
                    self.reserved.close()
                if self.child is not None:
                    os.close(self.child.rfd)
                if self.pristine is not None:
                    self.pristine.close_in_child()
                run_spare(
                    control=child_end,
                    items=self.items,
                    write_fd=wfd,
                    run_dir=run_dir,
                    agent_pid=agent_pid,
                    pristine=self.pristine.client if self.pristine is not None else None,
                )
            finally:
                os._exit(70)
        child_end.close()
        os.close(wfd)
        os.set_blocking(rfd, False)
        self.spare = _Spare(pid=pid, control=parent_end, rfd=rfd, run_dir=run_dir)

    def _take_spare(self) -> _Spare:
        """The waiting spare child, or a fresh one if there is none or it died."""
        spare = self.spare
        self.spare = None
        if spare is not None and os.waitpid(spare.pid, os.WNOHANG)[0] != 0:
            self._discard_spare(spare, reaped=True)
            spare = None
        if spare is None:
            self._fork_spare()
            spare, self.spare = self.spare, None
        assert spare is not None
        return spare

    def _discard_spare(self, spare: _Spare, *, reaped: bool = False) -> None:
        spare.control.close()  # an unused spare reads EOF and exits
        os.close(spare.rfd)
        if not reaped:
            self.exiting.append(spare.pid)
        shutil.rmtree(spare.run_dir, ignore_errors=True)

    def cmd_abort(self, abort: dict[str, Any]) -> None:
        """Phase one: take the child's stacks and say so. Phase two (``kill``): kill it (see ``Abort``)."""
        child = self.child
        ours = child is not None and child.run_id == abort["run_id"]
        if not abort["kill"]:
            if child is not None and ours and child.ended_by is None:
                child.ended_by, child.detail = abort["reason"], abort["detail"]
                child.no_stack = take_stacks(child.pid, child.run_dir / "stacks.txt")
            send_frame(self.sock, "stacks_taken", {"run_id": abort["run_id"]})
            return
        if child is None or not ours:
            return
        if child.ended_by is None:
            child.ended_by, child.detail = abort["reason"], abort["detail"]
        self._kill_child(wait=False)

    def cmd_shutdown(self, _: dict[str, Any]) -> bool:
        """End the loop."""
        return False

    # -- child handling -------------------------------------------------------------------------

    def _relay_child_output(self) -> bool:
        """Forward complete frames from the child's pipe; True once the pipe reached EOF."""
        child = self.child
        assert child is not None
        while True:
            try:
                data = os.read(child.rfd, 1 << 16)
            except BlockingIOError:
                return False
            except OSError:
                return True
            if not data:
                return True
            for frame in child.reader.feed(data):
                event = frame_event(frame)
                if event == CHILD_DONE:
                    self._release_finished_child()
                    return True
                self.sock.sendall(frame)
                if event == "report":
                    _say_relayed(child)
                if event == "report" and self.spare is None and not child.last:
                    # The test is set up: the next test's child prepares while this one runs, not
                    # between the two tests, and not while this one starts.
                    self._fork_spare()

    def _release_finished_child(self) -> None:
        """The child said it is done and is exiting with status 0: report that now, reap it later.

        Tearing down a process that holds torch takes milliseconds the next test need not wait for. A child
        the harness was ending finished first (its collective broke when a peer was killed): the stacks
        taken before the kill, and why it was being ended, are still its end's (lost at 48 ranks).
        """
        child = self.child
        assert child is not None
        if child.ended_by is None:
            self._child_ended(child, exitcode=0)
        else:
            stacks = self._stacks(child).to_dict()
            self._child_ended(child, exitcode=0, ended_by=child.ended_by, detail=child.detail, stacks=stacks)

    def _reap_exiting(self, *, block: bool = False) -> None:
        for pid in list(self.exiting):
            try:
                done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.exiting.remove(pid)

    def _reap(self, *, block: bool) -> None:
        child = self.child
        assert child is not None
        pid, status = os.waitpid(child.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        child.status = status
        self._relay_child_output()
        if self.child is child:  # not if its last frames said it was done: already reported
            self._finish_child()

    def _kill_child(self, wait: bool = True) -> None:
        child = self.child
        if child is None:
            return
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if wait:
            try:
                os.waitpid(child.pid, 0)
            except ChildProcessError:
                pass
            end_session_leftovers(child.pid, grace=0.5)
            os.close(child.rfd)
            _close_relayed(child)
            self.child = None

    def _finish_child(self) -> None:
        child = self.child
        assert child is not None and child.status is not None
        status = child.status
        exitcode = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        tails = []
        for name, label in (
            ("output.log", "uncaptured output"),
            ("capture-out.log", "stdout"),
            ("capture-err.log", "stderr"),
        ):
            text = tail_of_file(child.run_dir / name, _TAIL_LINES, strip_harness=True)
            if text.strip():
                tails.append(f"[{label}]\n{text}")
        stacks = self._stacks(child)
        # A child that crashed or was ended could not end what it started; its session still holds it.
        # Its sub-world zygote is there too, ending with it: seen at 96 ranks as a leftover [pytest].
        ended = end_session_leftovers(child.pid, settle=_SETTLE)
        self._child_ended(
            child,
            exitcode=exitcode,
            signal=None if child.ended_by else signum,
            ended_by=child.ended_by,
            detail=child.detail,
            output_tail="\n".join(tails),
            stacks=stacks.to_dict(),
            leftovers=describe_leftovers(self.rank, ended) if ended else "",
        )

    def _stacks(self, child: _Child) -> Stacks:
        """The stacks the abort took, read once here (harness frames left out); or why none when it was ended."""
        stacks = read_stacks(child.run_dir / "stacks.txt").without_harness()
        if child.ended_by is not None and not stacks.threads:
            stacks = Stacks(missing=child.no_stack or "the dump was empty")
        return stacks

    def _child_ended(self, child: _Child, **end: Any) -> None:
        """Report the end of ``child`` (with the next rendezvous port), clean up, and have a spare ready."""
        send_frame(
            self.sock,
            "child_exited",
            child_exited(run_id=child.run_id, rank=self.rank, next_port=self._reserve_port(), **end),
        )
        os.close(child.rfd)
        _close_relayed(child)
        shutil.rmtree(child.run_dir, ignore_errors=True)
        if child.status is None:  # reported done and still exiting: reap it later
            self.exiting.append(child.pid)
        self.child = None
        if self.spare is None and not child.last:
            self._fork_spare()


def _say_relayed(child: _Child) -> None:
    """Tell the child its report is on its way to the controller.

    The child waits for this before its next phase: a test body that kills this agent (or has it killed)
    would otherwise take the unrelayed setup report with it, and the controller would place the loss in
    setup, not in the call where it happened.
    """
    if child.relayed is not None:
        try:
            child.relayed.send(b"\x01")
        except OSError:  # the child is gone: its end is reported by its exit
            pass


def _close_relayed(child: _Child) -> None:
    if child.relayed is not None:
        child.relayed.close()
        child.relayed = None
