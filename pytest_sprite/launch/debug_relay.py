"""The controller's side of the debugger on a rank: the user's terminal, lent to one rank's pdb at a time.

A test child's pdb connects here when it stops (``rank/debugger.py``): ``--pdb`` on a failure, ``--trace``, or
``breakpoint()``. The controller's loop sees the connection (:meth:`DebugRelay.waiting`) and lends the
terminal (:meth:`DebugRelay.serve`): pytest's capture suspended, the rank's output copied out, each line the
user types copied in, until the rank continues or quits; then the next rank that waits, in the order they
came. Meanwhile the loop is held and the other ranks stay where they are; the seconds held are not counted
against any test's timeout (the controller's :meth:`lend_terminal`). ``--pdb`` opens on a test's first
failing rank only. Without a terminal nothing listens, and :attr:`DebugRelay.refusal` says why.
"""

from __future__ import annotations

import functools
import secrets
import select
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Final

import pytest

from ..glue.pytest_internals import stdin_is_terminal, uncaptured_terminal
from ..plumbing.protocol import FIRST_FRAME_MAX, DebuggerAddress, DebugHello, recv_frame, send_frame
from ..plumbing.timing import monotonic

__all__ = ["DebugRelay", "Lent", "debugger_refusal"]

_HELLO_TIMEOUT: Final = 10.0
"""Seconds a connection has to show the session's key before it is dropped."""
_LEND_AFTER: Final = 3.0
"""Seconds the rank at the terminal may run (after ``n``, say) before a rank that waits gets the terminal: the
running rank may be waiting in a collective for it."""


def debugger_refusal(config: pytest.Config) -> str:
    """Why no debugger can open on a rank in this session, or "" when the user's terminal can host one."""
    if hasattr(config, "workerinput"):
        return "a pytest-xdist worker has no terminal (-n0 runs the tests in the terminal's process)"
    if config.pluginmanager.get_plugin("terminalreporter") is None:
        return "pytest's terminal is off (-p no:terminal)"
    if not stdin_is_terminal(config):
        return "stdin is not a terminal"
    return ""


@dataclass
class Lent:
    """What lending the terminal took: the seconds the loop was held, the tests whose debugger quit."""

    seconds: float = 0.0
    quit: set[int] = field(default_factory=set)
    """Run ids of tests whose rank's debugger was quit: the session stops after them, as pytest's ``q`` stops it."""


@dataclass
class _Request:
    sock: socket.socket
    hello: DebugHello


class DebugRelay:
    """Listens (only when the user's terminal can host a debugger) for the ranks' debuggers, and serves them."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._key = secrets.token_hex(16)
        self._listener: socket.socket | None = None
        self._host = ""
        self._said = False
        self._post_mortems: set[int] = set()
        """Run ids whose ``--pdb`` debugger has opened: a test's later failing ranks are reported as usual."""

    @functools.cached_property
    def refusal(self) -> str:
        """Why no debugger opens on a rank in this session ("" when one can): decided once, after configure."""
        return debugger_refusal(self.config)

    def say_refusal(self) -> None:
        """One line, once: ``--pdb`` / ``--trace`` were asked for and cannot open on a rank, and why."""
        option = self.config.option
        asked = [name for name, on in (("--pdb", option.usepdb), ("--trace", option.trace)) if on]
        if not asked or not self.refusal or self._said:
            return
        self._said = True
        line = (
            f"pytest-sprite: {' and '.join(asked)} cannot open a debugger on a rank: {self.refusal}; "
            "the ranks tests run and report as usual"
        )
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            sys.stderr.write(line + "\n")
        else:
            reporter.ensure_newline()
            reporter.write_line(line)

    def address(self, where: tuple[str, str]) -> DebuggerAddress:
        """What a test's RunSpec carries: where to connect (``where``: bind address, advertised host), or why not."""
        if self.refusal:
            return DebuggerAddress(host="", port=0, key="", refusal=self.refusal)
        if self._listener is None:
            bind, self._host = where
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((bind, 0))
            listener.listen(64)
            self._listener = listener
        port: int = self._listener.getsockname()[1]
        return DebuggerAddress(host=self._host, port=port, key=self._key, refusal="")

    def waiting(self) -> bool:
        """Whether a rank's debugger waits for the terminal (a poll; no listener, no cost)."""
        if self._listener is None:
            return False
        readable, _, _ = select.select([self._listener], [], [], 0)
        return bool(readable)

    def serve(self) -> Lent:
        """Lend the terminal to each rank that waits, one at a time in the order they came, until none waits."""
        lent = Lent()
        started = monotonic()
        while self.waiting():
            self._serve_next(lent)
        lent.seconds = monotonic() - started
        return lent

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # -- one rank ----------------------------------------------------------------------------

    def _accept(self) -> _Request | None:
        assert self._listener is not None
        sock, _ = self._listener.accept()
        try:
            sock.settimeout(_HELLO_TIMEOUT)
            frame = recv_frame(sock, FIRST_FRAME_MAX)
            sock.settimeout(None)
        except (OSError, ValueError):
            frame = None
        if frame is None or frame[0] != "debug_hello" or frame[1].get("key") != self._key:
            sock.close()
            return None
        hello: Any = frame[1]
        return _Request(sock=sock, hello=hello)

    def _serve_next(self, lent: Lent) -> None:
        """The rank that waits longest: its debugger until it continues or quits."""
        request = self._accept()
        if request is not None and self._serve(request, lent):
            lent.quit.add(request.hello["run_id"])

    def _serve(self, request: _Request, lent: Lent) -> bool:
        """One rank's debugger until it continues or quits (True); a test's second ``--pdb`` is declined."""
        hello, sock = request.hello, request.sock
        with sock:
            if hello["kind"] == "post_mortem":
                if hello["run_id"] in self._post_mortems:
                    send_frame(sock, "debug_decline", {})
                    return False
                self._post_mortems.add(hello["run_id"])
            what = "post-mortem" if hello["kind"] == "post_mortem" else "set_trace"
            reporter: Any = self.config.pluginmanager.get_plugin("terminalreporter")
            with uncaptured_terminal(self.config):
                reporter.ensure_newline()
                reporter.write_sep(">", f"PDB {what} on rank {hello['rank']} of {hello['nodeid']}")
                reporter.flush()
                send_frame(sock, "debug_go", {})
                quit = self._relay(sock, hello["rank"], lent)
                reporter.ensure_newline()
                reporter.write_sep(">", f"PDB {'quit' if quit else 'continue'} (rank {hello['rank']})")
                reporter.flush()
            return quit

    def _relay(self, sock: socket.socket, rank: int, lent: Lent) -> bool:
        """Copy the rank's output out and the user's lines in; True when the user quit."""
        while True:
            try:
                frame = self._next_frame(sock, rank, lent)
            except OSError:
                frame = None
            if frame is None:  # the rank ended (or was ended) with its debugger open
                return False
            event, payload = frame
            if event == "debug_output":
                sys.stdout.write(payload["text"])
                sys.stdout.flush()
            elif event == "debug_read":
                send_frame(sock, "debug_input", {"line": _ask(payload["prompt"])})
            elif event == "debug_end":
                return bool(payload["quit"])
            else:
                raise ValueError(f"unexpected frame from a rank's debugger: {event!r}")

    def _next_frame(self, sock: socket.socket, rank: int, lent: Lent) -> tuple[str, dict[str, Any]] | None:
        """The rank's next frame. While it runs (a step over a collective, say), a rank that waits for the
        terminal longer than :data:`_LEND_AFTER` is served meanwhile: the running rank may need it to go on."""
        since = monotonic()
        while True:
            watched: list[Any] = [sock] if self._listener is None else [sock, self._listener]
            readable, _, _ = select.select(watched, [], [], 0.5)
            if sock in readable:
                return recv_frame(sock)
            if self._listener in readable and monotonic() - since >= _LEND_AFTER:
                reporter: Any = self.config.pluginmanager.get_plugin("terminalreporter")
                reporter.ensure_newline()
                reporter.write_line(f"(rank {rank} runs on; another rank waits for the debugger)")
                self._serve_next(lent)
                reporter.write_line(f"(back to rank {rank}, which was running)")
                since = monotonic()


def _ask(prompt: str) -> str:
    """The user's next line (line editing and history where ``readline`` is available); "" at end of input."""
    try:
        import readline  # noqa: F401 (input() edits lines with it once imported)
    except ImportError:  # pragma: no cover - a Python built without it
        pass
    while True:
        try:
            return input(prompt) + "\n"
        except EOFError:
            sys.stdout.write("\n")
            return ""
        except KeyboardInterrupt:
            sys.stdout.write("\n--KeyboardInterrupt--\n")
