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
- A dump is faulthandler's text; :func:`read_stacks` reads it once, next to the process that wrote it, into
  :class:`Stacks` of :class:`ThreadStack` of :class:`Frame` records (file, line, function). The records
  cross the protocol and reach the reports as they are; every reader of stacks (the collective a rank
  waits in, where it was, the harness's own frames, the text the user reads) works on them, and
  faulthandler's text is never parsed again downstream.

Stdlib only; both sides import it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import importlib.util
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeAlias, TypedDict

from .timing import monotonic, sleep

__all__ = [
    "NO_STACK",
    "STACK_SIGNAL",
    "STACK_WAIT",
    "Frame",
    "FramePayload",
    "Stacks",
    "StacksKey",
    "StacksPayload",
    "ThreadPayload",
    "ThreadStack",
    "is_harness",
    "keep_stack_dumps",
    "no_stack_text",
    "parse_frame",
    "parse_stacks",
    "proc_state",
    "read_stacks",
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


class FramePayload(TypedDict):
    """One frame of a rank's stack (:class:`Frame` on the wire)."""

    file: str
    line: int | None
    function: str


class ThreadPayload(TypedDict):
    """One thread of a rank's stack: its title's label and address, its frames, faulthandler's other lines."""

    label: str
    ident: str
    frames: list[FramePayload]
    notes: list[str]


class StacksPayload(TypedDict):
    """A rank's stacks as records, read once by its agent (:class:`Stacks` on the wire, in ``child_exited``)."""

    threads: list[ThreadPayload]
    missing: str | None
    """Why none could be taken when they were asked for."""


@dataclass(frozen=True)
class Frame:
    """One frame of a stack, as faulthandler wrote it: its file, line and function."""

    file: str
    line: int | None
    """None where faulthandler could not tell (it writes ``???``)."""
    function: str

    def text(self) -> str:
        """The frame's line in faulthandler's words: ``  File "t.py", line 9 in test_x``."""
        file = self.file if self.file == _UNKNOWN else f'"{self.file}"'
        line = _UNKNOWN if self.line is None else str(self.line)
        return f"  File {file}, line {line} in {self.function}"

    def to_dict(self) -> FramePayload:
        return FramePayload(file=self.file, line=self.line, function=self.function)


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a dump: its title (``Current thread 0x...``) and its frames, most recent first."""

    label: str
    """``Current thread``, ``Thread`` or ``Stack``; empty when the dump gave the frames no title."""
    ident: str = ""
    """The thread's address (``0x00007f...``): it differs between processes, so ranks compare without it."""
    frames: tuple[Frame, ...] = ()
    notes: tuple[str, ...] = ()
    """faulthandler's other lines after the frames: ``<no Python frame>``, ``...`` for a stack cut at 100 frames."""

    @property
    def title(self) -> str:
        """The thread's first line as faulthandler wrote it, empty when it had none."""
        if not self.label:
            return ""
        return f"{self.label} {self.ident} {_TITLE_END}" if self.ident else f"{self.label} {_TITLE_END}"

    def text(self) -> str:
        lines = [self.title] if self.title else []
        return "\n".join(lines + [f.text() for f in self.frames] + [f"  {n}" for n in self.notes])

    def to_dict(self) -> ThreadPayload:
        return ThreadPayload(
            label=self.label,
            ident=self.ident,
            frames=[f.to_dict() for f in self.frames],
            notes=list(self.notes),
        )


@dataclass(frozen=True)
class Stacks:
    """A process's stacks, read once where its dump was written; or why none could be taken.

    What crosses from the agent to the controller (``child_exited``), is kept with a rank's end, read by
    the roll call and the collective readers, shown in the terminal (:meth:`text`) and written to the JSON
    report (:meth:`to_dict`). Empty (no threads, nothing missing) when none was asked for.
    """

    threads: tuple[ThreadStack, ...] = ()
    missing: str | None = None
    """Why no stack could be taken when one was asked for (``no answer to SIGUSR1 within 15s``)."""

    @property
    def present(self) -> bool:
        """A stack was taken, or asked for and its absence explained: there is something to show."""
        return bool(self.threads) or self.missing is not None

    def with_frames(self) -> list[ThreadStack]:
        """The threads that show at least one frame."""
        return [t for t in self.threads if t.frames]

    def text(self) -> str:
        """What the user reads: faulthandler's text of every thread, or ``sprite: no stack: why``, or ""."""
        if self.missing is not None:
            return no_stack_text(self.missing)
        return "\n\n".join(t.text() for t in self.threads)

    def key(self) -> StacksKey:
        """What two ranks' stacks are compared by: every thread without its address."""
        return tuple((t.label, t.frames, t.notes) for t in self.threads)

    def without_harness(self) -> Stacks:
        """These stacks without the frames of pytest, pluggy and the sprite harness (see :func:`is_harness`)."""
        return dataclasses.replace(
            self,
            threads=tuple(
                dataclasses.replace(t, frames=tuple(f for f in t.frames if not is_harness(f)))
                for t in self.threads
            ),
        )

    def last_lines(self, lines: int) -> Stacks:
        """These stacks cut to about the last ``lines`` lines of their text (whole threads, the last one cut)."""
        kept: list[ThreadStack] = []
        room = lines
        for thread in reversed(self.threads):
            if room <= 0:
                break
            size = (1 if thread.label else 0) + len(thread.frames) + len(thread.notes)
            if size > room:
                thread = dataclasses.replace(thread, frames=thread.frames[: max(0, room - 1)], notes=())
            kept.insert(0, thread)
            room -= size + 1
        return dataclasses.replace(self, threads=tuple(kept))

    def to_dict(self) -> StacksPayload:
        return StacksPayload(threads=[t.to_dict() for t in self.threads], missing=self.missing)

    @classmethod
    def from_dict(cls, data: StacksPayload) -> Stacks:
        return cls(
            threads=tuple(
                ThreadStack(
                    label=t["label"],
                    ident=t["ident"],
                    frames=tuple(Frame(f["file"], f["line"], f["function"]) for f in t["frames"]),
                    notes=tuple(t["notes"]),
                )
                for t in data["threads"]
            ),
            missing=data["missing"],
        )


StacksKey: TypeAlias = tuple[tuple[str, tuple[Frame, ...], tuple[str, ...]], ...]
"""Stacks as compared between ranks (:meth:`Stacks.key`)."""

_UNKNOWN: Final = "???"
_TITLE_END: Final = "(most recent call first):"
_FRAME: Final = re.compile(
    r'^\s*File (?:"(?P<file>[^"]*)"|\?\?\?), line (?P<line>\d+|\?\?\?) in (?P<function>.+?)\s*$'
)


def parse_frame(line: str) -> Frame | None:
    """The frame a faulthandler line names, None for any other line (the one reader of its frame lines)."""
    found = _FRAME.match(line)
    if found is None:
        return None
    number = found["line"]
    return Frame(
        found["file"] if found["file"] is not None else _UNKNOWN,
        None if number == _UNKNOWN else int(number),
        found["function"],
    )


def _title(line: str) -> tuple[str, str]:
    """A thread title's label and address: ``("Current thread", "0x00007f...")``, ``("Stack", "")``."""
    head = line.strip()[: -len(_TITLE_END)].strip()
    label, _, ident = head.rpartition(" ")
    return (label, ident) if label and ident.startswith("0x") else (head, "")


def parse_stacks(text: str) -> Stacks:
    """A faulthandler dump's threads, each with its frames, most recent first (blank lines dropped)."""
    threads: list[tuple[str, str, list[Frame], list[str]]] = []
    for line in text.splitlines():
        if line.rstrip().endswith(_TITLE_END):
            threads.append((*_title(line), [], []))
            continue
        frame = parse_frame(line)
        if frame is None and not line.strip():
            continue
        if not threads:
            threads.append(("", "", [], []))
        if frame is not None:
            threads[-1][2].append(frame)
        else:
            threads[-1][3].append(line.strip())
    return Stacks(
        threads=tuple(
            ThreadStack(label=label, ident=ident, frames=tuple(frames), notes=tuple(notes))
            for label, ident, frames, notes in threads
        )
    )


def read_stacks(path: Path, *, window: int = 4 * 1024 * 1024) -> Stacks:
    """The stacks a process dumped into ``path`` (its last ``window`` bytes), read once, next to the process."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - window))
            return parse_stacks(fh.read().decode("utf-8", errors="replace"))
    except OSError:
        return Stacks()


def _harness_dirs() -> tuple[str, ...]:
    """Where the harness's own packages (rank side, controller side) are installed; found, not imported."""
    dirs: list[str] = []
    for name in ("pytest_sprite.rank", "pytest_sprite.launch"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            for d in [
                *map(os.path.realpath, spec.submodule_search_locations),
                *spec.submodule_search_locations,
            ]:
                if d not in dirs:
                    dirs.append(d)
    return tuple(d + "/" for d in dirs)


_HARNESS_DIRS: Final = _harness_dirs()


def is_harness(frame: Frame) -> bool:
    """True for a frame of pytest, pluggy, runpy or the sprite harness (its rank and launch packages)."""
    file = frame.file
    return (
        "/pluggy/" in file
        or "/_pytest/" in file
        or file == "<frozen runpy>"
        or file.endswith("/pytest/__main__.py")
        or file.startswith(_HARNESS_DIRS)
    )


def no_stack_text(reason: str) -> str:
    """The stacks field of a rank whose stack could not be taken, saying why."""
    return f"{NO_STACK}{reason}"
