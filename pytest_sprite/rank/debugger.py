"""The debugger on a rank: ``--pdb``, ``--trace`` and ``breakpoint()`` in a test child, in the user's terminal.

A rank's pdb reads and writes frames on a connection of its own to the controller's debug relay
(``launch/debug_relay.py``), which lends it the user's terminal, one rank at a time, with the test's timeout
suspended. The prompt names the rank: ``(Pdb rank 1)``. Without a terminal (the RunSpec's ``debugger`` says
why) nothing opens: ``breakpoint()`` returns at once with one warning, and a failure is reported as usual.

Installed once in the agent (:func:`install_debugger`), inherited by every child it forks; a child only
binds its seat (:func:`bind_debugger`). Nothing runs unless a debugger is asked for.
"""

from __future__ import annotations

import functools
import pdb
import socket
import sys
import warnings
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Final, Literal

import pytest

from ..errors import DebuggerUnavailableWarning
from ..plumbing.dependency_internals import replace_distributed_pdb
from ..plumbing.protocol import DebugHello, RunSpec, recv_frame, send_frame

__all__ = ["RankPdb", "bind_debugger", "install_debugger", "set_trace"]

DEBUGGER_PLUGIN: Final = "sprite-rank-debugger"
_CONNECT_TIMEOUT: Final = 30.0
"""Seconds a rank's debugger waits to reach the controller's relay (not its turn at the terminal: that is unbounded)."""

Kind = Literal["post_mortem", "trace"]


class _Seat:
    """This child's test and rank, and where its debugger reaches the terminal (set by :func:`bind_debugger`)."""

    spec: RunSpec | None = None
    warned = False


def bind_debugger(spec: RunSpec) -> None:
    """In a test child, before its test: the seat its debugger names and the relay it connects to.

    ``torch.distributed.breakpoint()`` stops in the same debugger: torch's own reads the child's /dev/null.
    """
    _Seat.spec = spec
    replace_distributed_pdb(_distributed_pdb)


def _distributed_pdb() -> RankPdb:
    return RankPdb("trace")


def _refusal() -> str:
    """Why no debugger opens in this process ("" when one does)."""
    spec = _Seat.spec
    if spec is None:
        return "this process is not a test child (a sub-world rank, say)"
    address = spec["debugger"]
    return "" if address["port"] else address["refusal"]


class _RelayStream:
    """pdb's stdin and stdout: frames on the connection to the relay, made when pdb first stops.

    Whole lines go out as they are flushed; what follows the last one is the prompt, sent with the read.
    """

    def __init__(self, kind: Kind) -> None:
        self.kind: Kind = kind
        self.sock: socket.socket | None = None
        self.pending = ""

    def open(self) -> bool:
        """Connect and wait for this rank's turn at the terminal; False when declined or unreachable."""
        spec = _Seat.spec
        if spec is None or not spec["debugger"]["port"]:
            return False
        address = spec["debugger"]
        hello = DebugHello(
            key=address["key"],
            run_id=spec["run_id"],
            rank=spec["rank"],
            nodeid=spec["nodeid"],
            kind=self.kind,
        )
        try:
            sock = socket.create_connection((address["host"], address["port"]), timeout=_CONNECT_TIMEOUT)
            sock.settimeout(None)
            send_frame(sock, "debug_hello", hello)
            reply = recv_frame(sock)
        except OSError:
            return False
        if reply is None or reply[0] != "debug_go":
            sock.close()
            return False
        self.sock = sock
        return True

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        cut = self.pending.rfind("\n") + 1
        if cut and self.sock is not None:
            send_frame(self.sock, "debug_output", {"text": self.pending[:cut]})
            self.pending = self.pending[cut:]

    def readline(self) -> str:
        """The user's next line; "" (end of input) once the relay is gone."""
        if self.sock is None:
            return ""
        self.flush()
        prompt, self.pending = self.pending, ""
        try:
            send_frame(self.sock, "debug_read", {"prompt": prompt})
            frame = recv_frame(self.sock)
        except OSError:
            frame = None
        if frame is None or frame[0] != "debug_input":
            return ""
        line: str = frame[1]["line"]
        return line

    def close(self, *, quit: bool) -> None:
        """Leave the terminal: the rest of the output, then ``debug_end``."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        try:
            if self.pending:
                send_frame(sock, "debug_output", {"text": self.pending})
            send_frame(sock, "debug_end", {"quit": quit})
        except OSError:
            pass
        finally:
            self.pending = ""
            sock.close()


class RankPdb(pdb.Pdb):
    """pdb on a rank: its terminal is the relay's, its prompt names the rank.

    ``c`` leaves the terminal (a later stop asks for it again); ``q`` leaves it and lets the test end as it
    would have, and the session stops after it, as ``q`` stops a pytest session.
    """

    def __init__(self, kind: Kind, header: str = "") -> None:
        self.stream = _RelayStream(kind)
        super().__init__(stdin=self.stream, stdout=self.stream, nosigint=True)  # type: ignore[arg-type]
        rank = _Seat.spec["rank"] if _Seat.spec is not None else "?"
        self.prompt = f"(Pdb rank {rank}) "
        self.header = header

    def interaction(self, frame: FrameType | None, traceback: Any) -> None:
        if self.stream.sock is None:
            if not self.stream.open():
                if self.stream.kind == "trace":
                    _say_unavailable(_refusal() or "the controller's debug relay could not be reached")
                    self.set_continue()
                return
            if self.header:
                self.stream.write(self.header)
        super().interaction(frame, traceback)

    def set_continue(self) -> None:
        super().set_continue()
        self.stream.close(quit=False)

    def do_quit(self, arg: str) -> bool:
        """q(uit): leave the debugger; the test ends as it would have, then the session stops."""
        self.stream.close(quit=True)
        self.clear_all_breaks()
        self.set_continue()
        return True

    do_q = do_exit = do_EOF = do_quit


def set_trace(*, header: str | None = None) -> None:
    """``breakpoint()``, ``pdb.set_trace()`` and ``pytest.set_trace()`` in a test child: stop in the caller,
    in the user's terminal."""
    refusal = _refusal()
    if refusal:
        _say_unavailable(refusal)
        return
    RankPdb("trace", header=f"{header}\n" if header else "").set_trace(sys._getframe().f_back)


def _say_unavailable(refusal: str) -> None:
    """One warning per child: the controller folds it over ranks into pytest's warnings summary."""
    if _Seat.warned:
        return
    _Seat.warned = True
    rank = _Seat.spec["rank"] if _Seat.spec is not None else "?"
    try:
        warnings.warn(
            DebuggerUnavailableWarning(
                f"rank {rank}: breakpoint() returned at once, no debugger opens: {refusal}"
            ),
            stacklevel=3,
        )
    except Warning:  # -W error: the rank still goes on
        pass


def _post_mortem(excinfo: pytest.ExceptionInfo[BaseException], report: pytest.TestReport) -> None:
    """``--pdb``: the failing rank's frame, with its traceback shown first."""
    header = f"{report.longreprtext}\n" if report.longrepr is not None else ""
    debugger = RankPdb("post_mortem", header=header)
    debugger.reset()
    traceback: TracebackType | None = excinfo.tb
    try:
        debugger.interaction(None, traceback)
    finally:
        debugger.stream.close(quit=False)


class _PostMortem:
    """``--pdb`` in a test child: pdb in the failing rank's frame (the relay opens it for a test's first one)."""

    @pytest.hookimpl(trylast=True)
    def pytest_exception_interact(self, node: Any, call: pytest.CallInfo[Any], report: Any) -> None:
        if _Seat.spec is not None and call.excinfo is not None and not _refusal():
            _post_mortem(call.excinfo, report)


class _Trace:
    """``--trace`` in a test child: stop at the test function's first line."""

    @pytest.hookimpl(wrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Any:
        if _Seat.spec is not None and not _refusal():
            pyfuncitem.obj = _traced(pyfuncitem.obj)
        return (yield)


def _traced(test: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(test)
    def traced(*args: Any, **kwargs: Any) -> Any:
        return RankPdb("trace").runcall(functools.partial(test, *args, **kwargs))

    return traced


def install_debugger(config: pytest.Config) -> None:
    """In the agent, once: ``breakpoint()`` and ``pdb.set_trace()`` reach the relay; ``--pdb`` and ``--trace``
    hooks when asked for (pytest's own were unregistered: they would read the child's /dev/null)."""
    setattr(pdb, "set_trace", set_trace)  # noqa: B010 (what breakpoint() calls unless PYTHONBREAKPOINT says)
    setattr(pytest, "set_trace", set_trace)  # noqa: B010 (pytest's own would read the child's /dev/null)
    manager = config.pluginmanager
    if config.getoption("usepdb", False) and not manager.has_plugin(DEBUGGER_PLUGIN):
        manager.register(_PostMortem(), DEBUGGER_PLUGIN)
    if config.getoption("trace", False) and not manager.has_plugin(f"{DEBUGGER_PLUGIN}-trace"):
        manager.register(_Trace(), f"{DEBUGGER_PLUGIN}-trace")
