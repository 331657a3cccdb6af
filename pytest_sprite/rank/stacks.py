"""A test child's Python stacks at a timeout: kept answerable in the child, taken by its agent (issue 27).

The child answers STACK_SIGNAL with faulthandler, which writes every thread's stack from its C signal
handler, even while the test waits inside a collective. Two things lost those stacks:

- Lightning's signal connector, at the end of every ``Trainer.fit``, puts back the handler that
  ``signal.getsignal`` reports for every signal: SIG_DFL for the ones faulthandler took at the C level.
  STACK_SIGNAL then killed the child instead of dumping, and a fatal signal dumped nothing.
  :func:`keep_stack_dumps` (installed by the agent, inherited by each child) installs faulthandler
  again whenever such a signal is reset.
- On a loaded machine (96 ranks on a few cores) a child may take seconds to run the handler; the
  agent killed it after 3 s. :func:`take_stacks` waits longer and, when no stack comes, says why, with
  the child's state from ``/proc``.

Depends on nothing of the controller side; stdlib only.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
from pathlib import Path
from typing import Any, Final

from ..plumbing.collectives import STACK_WAIT
from ..plumbing.protocol import STACK_SIGNAL
from ..plumbing.timing import monotonic, sleep

__all__ = ["keep_stack_dumps", "proc_state", "take_stacks"]

_FATAL: Final = frozenset({signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL})
_STATES: Final = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O",
    "T": "stopped",
    "t": "stopped by a debugger",
    "Z": "exited",
    "X": "exited",
}


_kept = False


def keep_stack_dumps() -> None:
    """From now on in this process and its forks, a reset of STACK_SIGNAL or a fatal signal re-installs faulthandler.

    Called by the agent before it forks any child, so every test child inherits it; the agent itself
    runs no test. Wraps ``faulthandler.register`` and ``faulthandler.enable`` to remember where the
    child told them to write, and ``signal.signal`` so that a reset to SIG_DFL (what a library that
    "restores" the handlers it read with ``signal.getsignal`` does) is followed by faulthandler again. A
    handler the test installs itself is kept; the agent then reports that no stack could be taken.
    """
    global _kept
    if _kept:
        return
    _kept = True
    register, enable, set_handler = faulthandler.register, faulthandler.enable, signal.signal
    registered: dict[int, dict[str, Any]] = {}
    enabled: dict[str, Any] = {}

    @functools.wraps(register)
    def _register(signum: int, *args: Any, **kwargs: Any) -> None:
        registered[signum] = {"args": args, "kwargs": kwargs}
        register(signum, *args, **kwargs)

    @functools.wraps(enable)
    def _enable(*args: Any, **kwargs: Any) -> None:
        enabled.update(args=args, kwargs=kwargs)
        enable(*args, **kwargs)

    @functools.wraps(set_handler)
    def _signal(signalnum: Any, handler: Any) -> Any:
        previous = set_handler(signalnum, handler)
        if handler == signal.SIG_DFL:
            if signalnum in registered:
                faulthandler.unregister(signalnum)  # register() skips sigaction while it believes it is set
                register(signalnum, *registered[signalnum]["args"], **registered[signalnum]["kwargs"])
            elif signalnum in _FATAL and enabled:
                faulthandler.disable()  # enable() is a no-op while it believes itself enabled
                enable(*enabled["args"], **enabled["kwargs"])
        return previous

    faulthandler.register = _register
    faulthandler.enable = _enable
    signal.signal = _signal


def _status_mask(pid: int, field: str) -> int:
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _bit(signum: int) -> int:
    return 1 << (signum - 1)


def _catches(pid: int, signum: int) -> bool | None:
    """Whether ``pid`` has a handler for ``signum`` (None where /proc cannot say)."""
    if not Path("/proc", str(pid), "status").exists():
        return None
    return bool(_status_mask(pid, "SigCgt") & _bit(signum))


def _pending(pid: int, signum: int) -> bool:
    return bool((_status_mask(pid, "ShdPnd") | _status_mask(pid, "SigPnd")) & _bit(signum))


def proc_state(pid: int) -> str:
    """What ``/proc`` says of ``pid``: its state, CPU time, kernel wait channel, whether the signal is pending."""
    try:
        data = (Path("/proc") / str(pid) / "stat").read_text(errors="replace")
    except OSError:
        return "it has exited"
    fields = data[data.rfind(")") + 2 :].split()
    state = fields[0] if fields else "?"
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    cpu = (int(fields[11]) + int(fields[12])) / ticks if len(fields) > 12 else 0.0
    try:
        wchan = (Path("/proc") / str(pid) / "wchan").read_text().strip()
    except OSError:
        wchan = ""
    parts = [f"state {state} ({_STATES.get(state, 'unknown')})", f"{cpu:.1f}s of CPU"]
    if wchan and wchan != "0":
        parts.append(f"kernel wait {wchan}")
    if _pending(pid, STACK_SIGNAL):
        parts.append(f"{signal.Signals(STACK_SIGNAL).name} still pending")
    return ", ".join(parts)


def take_stacks(pid: int, path: Path, *, wait: float = STACK_WAIT) -> str:
    """Have child ``pid`` dump its stacks into ``path`` and wait for the dump; "" once taken, else why not.

    Done when the signal has been delivered and the file has stopped growing for a fifth of a second.
    A child with no handler for STACK_SIGNAL is not sent it (the signal would kill it, and the dump
    would be lost anyway).
    """
    name = signal.Signals(STACK_SIGNAL).name
    if _catches(pid, STACK_SIGNAL) is False:
        return f"the test replaced the {name} handler that dumps its stack ({proc_state(pid)})"
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return "it had exited"
    last, stable_since, deadline = -1, monotonic(), monotonic() + wait
    while monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        if size != last:
            last, stable_since = size, monotonic()
        elif size > 0 and monotonic() - stable_since > 0.2 and not _pending(pid, STACK_SIGNAL):
            return ""
        sleep(0.05)
    if last > 0:
        return ""  # still writing (a deep stack on a starved core): what it wrote is kept
    return f"no answer to {name} within {wait:g}s ({proc_state(pid)})"
