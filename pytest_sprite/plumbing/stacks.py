"""A rank's Python stacks: kept answerable, taken at a timeout, and read as typed records.

The one place the harness deals with stacks, for ranks tests and sub-worlds alike:

- A process answers STACK_SIGNAL with faulthandler, which writes every thread's stack from its C signal
  handler, even while the test waits inside a collective. Lightning's signal connector, at the end of
  every ``Trainer.fit``, puts back the handler that ``signal.getsignal`` reports for every signal: SIG_DFL
  for the ones faulthandler took at the C level, so STACK_SIGNAL then killed the process instead of
  dumping, and a fatal signal dumped nothing. :func:`keep_stack_dumps`, called before a process installs
  its dumps and inherited by its forks, installs faulthandler again whenever such a signal is reset.
- On a loaded machine (96 ranks on a few cores) a process may take seconds to run the handler:
  :func:`take_stacks_of` signals every process first, waits for all of them together, and for one that
  gives no stack says why, with its state from ``/proc``.
- A dump is faulthandler's text; :func:`parse_threads` reads it once into :class:`Frame` records (file,
  line, function), which every reader of stacks (the collective a rank waits in, where it was) uses.

Stdlib only; both sides import it.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .timing import monotonic, sleep

__all__ = [
    "NO_STACK",
    "STACK_SIGNAL",
    "STACK_WAIT",
    "Frame",
    "keep_stack_dumps",
    "missing_stack",
    "no_stack_text",
    "normalize_stacks",
    "parse_threads",
    "proc_state",
    "take_stacks",
    "take_stacks_of",
]

STACK_SIGNAL: Final = signal.SIGUSR1
"""Agent -> child: dump every thread's stack (faulthandler) to ``stacks.txt``; sent before an abort kills it."""
STACK_WAIT: Final = 15.0
"""Seconds an agent waits for its child to answer the stack signal before it kills it without a stack."""

NO_STACK: Final = "sprite: no stack: "
"""What an ended rank's stacks hold, followed by the reason, when none could be taken."""

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


def take_stacks_of(targets: Sequence[tuple[int, Path]], *, wait: float = STACK_WAIT) -> dict[int, str]:
    """Have each process ``pid`` dump its stacks into its ``path``; pid -> "" once taken, else why not.

    Every process is signalled before any is waited for, so ``wait`` bounds the whole collection. A
    dump is done when the signal has been delivered and the file has stopped growing for a fifth of a
    second. A process with no handler for STACK_SIGNAL is not sent it (the signal would kill it, and the
    dump would be lost anyway).
    """
    name = signal.Signals(STACK_SIGNAL).name
    why: dict[int, str] = {}
    pending: dict[int, Path] = {}
    for pid, path in targets:
        if _catches(pid, STACK_SIGNAL) is False:
            why[pid] = f"the test replaced the {name} handler that dumps its stack ({proc_state(pid)})"
            continue
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            why[pid] = "it had exited"
            continue
        pending[pid] = path
    sizes = {pid: (-1, monotonic()) for pid in pending}
    deadline = monotonic() + wait
    while pending and monotonic() < deadline:
        for pid, path in list(pending.items()):
            size = path.stat().st_size if path.exists() else 0
            last, stable_since = sizes[pid]
            if size != last:
                sizes[pid] = (size, monotonic())
            elif size > 0 and monotonic() - stable_since > 0.2 and not _pending(pid, STACK_SIGNAL):
                why[pid] = ""
                del pending[pid]
        sleep(0.05)
    for pid in pending:  # still writing (a deep stack on a starved core): what it wrote is kept
        why[pid] = "" if sizes[pid][0] > 0 else f"no answer to {name} within {wait:g}s ({proc_state(pid)})"
    return why


def take_stacks(pid: int, path: Path, *, wait: float = STACK_WAIT) -> str:
    """One process's stacks (see :func:`take_stacks_of`): "" once taken into ``path``, else why not."""
    return take_stacks_of([(pid, path)], wait=wait)[pid]


@dataclass(frozen=True)
class Frame:
    """One frame of a stack: its file, line and function."""

    path: str
    line: int
    func: str


_FRAME: Final = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')


def parse_threads(stacks: str) -> list[list[Frame]]:
    """The threads of a faulthandler dump, each a list of frames, most recent first; threads without frames left out."""
    threads: list[list[Frame]] = []
    current: list[Frame] | None = None
    for text in stacks.splitlines():
        if "(most recent call first)" in text:
            current = []
            threads.append(current)
            continue
        frame = _FRAME.match(text)
        if frame is None:
            continue
        if current is None:
            current = []
            threads.append(current)
        current.append(Frame(frame["path"], int(frame["line"]), frame["func"]))
    return [t for t in threads if t]


_ADDRESS: Final = re.compile(r"0x[0-9a-fA-F]+")


def normalize_stacks(stacks: str) -> str:
    """``stacks`` as compared between ranks: thread addresses and blank lines dropped."""
    return "\n".join(_ADDRESS.sub("0x...", line.rstrip()) for line in stacks.splitlines() if line.strip())


def no_stack_text(reason: str) -> str:
    """The stacks field of a rank whose stack could not be taken, saying why."""
    return f"{NO_STACK}{reason}"


def missing_stack(stacks: str) -> str | None:
    """Why a rank has no stack (see :func:`no_stack_text`), None when it has one or was not asked."""
    return stacks[len(NO_STACK) :].strip() if stacks.startswith(NO_STACK) else None
