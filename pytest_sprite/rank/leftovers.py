"""Processes a test child left running: find them by session, end them, and say which they were.

Every test child leads its own session (``os.setsid`` when it starts), and everything it starts
inherits that session id, even a process that moves to a process group of its own or whose parent
exits. When the test ends, what is still in the session was left behind by the test: it is sent
SIGTERM, then SIGKILL after a short grace, and named (rank, pid, command) in the test's report.
A child that leaves the session (``start_new_session=True``, ``os.setsid``) is still a child
of the test child, a subreaper, and is found as such (:func:`escaped_sessions`) and named so; a daemon
that double-forks into a new session and whose middle process exits is reparented to the subreaper too.

Stdlib only: processes are read from ``/proc`` (Linux: the clusters and CI this plugin serves);
where there is none, nothing is found. Depends on nothing of the controller side.
"""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from ..plumbing.process import become_subreaper
from ..plumbing.ranges import fold_ranks
from ..plumbing.timing import monotonic, sleep

__all__ = [
    "DEFAULT_GRACE",
    "Leftover",
    "describe_leftovers",
    "end_session_leftovers",
    "escaped_sessions",
    "lead_own_session",
    "session_processes",
    "started_nothing",
]

DEFAULT_GRACE: Final = 2.0
"""Seconds a leftover process gets to exit after SIGTERM before it is killed."""

_PROC: Final = Path("/proc")
_PF_EXITING: Final = 0x4
"""The kernel's flag (``/proc/PID/stat`` field 9) of a process inside exit()."""
_COMMAND_CHARS: Final = 200
_CMDLINE_TRIES: Final = 5


@dataclass(frozen=True, kw_only=True)
class Leftover:
    """A process a test left running, and how it was ended."""

    pid: int
    command: str
    """Its command line, shell-quoted and shortened (``[name]`` when it has none)."""
    ended_by: Literal["SIGTERM", "SIGKILL"]
    """SIGTERM: it exited within the grace after SIGTERM; SIGKILL: it had to be killed."""

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "command": self.command, "ended_by": self.ended_by}


def lead_own_session() -> None:
    """Make this process the leader of a new session (and process group); called by each test child.

    A forked child is never a group leader, so ``setsid`` cannot fail for it; where it does (a
    process that already leads a group), the session it has is kept. It also becomes a *subreaper*
    (Linux 3.4): what it starts and what those start, once orphaned, stay its children, so
    :func:`started_nothing` can tell from its own children that nothing it started is left.
    """
    try:
        os.setsid()
    except OSError:
        pass
    become_subreaper()


def started_nothing() -> bool:
    """True when this process (a subreaper) has no child process at all, so none can be left running.

    Reads ``/proc/self/task/<tid>/children`` of each thread: a few reads, where scanning the session
    reads every process of the machine (a millisecond per test with a hundred of them).
    False whenever it cannot tell (no such files: the full search runs).
    """
    try:
        for tid in os.listdir("/proc/self/task"):
            fd = os.open(f"/proc/self/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
            try:  # three system calls a thread, where a buffered file object takes seven
                if os.read(fd, 64).strip():
                    return False
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


def escaped_sessions(*, exclude: Collection[int] = ()) -> list[int]:
    """Sessions of this process's children that left its session: a child started with
    ``start_new_session=True`` or that called ``os.setsid``. This process is a subreaper, so such a child,
    and an orphan of it, is still its child, though the search by session misses it. ``exclude``: sessions
    that are not the test's to end (the sub-world zygote's)."""
    own = os.getsid(0)
    found: list[int] = []
    try:
        children = [
            int(pid)
            for tid in os.listdir("/proc/self/task")
            for pid in Path(f"/proc/self/task/{tid}/children").read_text().split()
        ]
    except (OSError, ValueError):
        return found
    for pid in children:
        sid = _session_of(pid)
        if sid is not None and sid != own and sid not in exclude and sid not in found and _alive(pid):
            found.append(sid)
    return found


ESCAPED_NOTE: Final = "in a session of its own (start_new_session=True or os.setsid), found as a child"


def _read_stat(pid: int) -> tuple[str, int, int, str] | None:
    """(state, parent pid, session id, name) of ``pid`` from /proc, None if it is gone."""
    try:
        data = (_PROC / str(pid) / "stat").read_bytes().decode("utf-8", "replace")
    except OSError:
        return None
    # The name is in parentheses and may itself hold spaces or parentheses: split after the last one.
    open_paren, close_paren = data.find("("), data.rfind(")")
    fields = data[close_paren + 2 :].split()
    if len(fields) < 4:
        return None
    return fields[0], int(fields[1]), int(fields[3]), data[open_paren + 1 : close_paren]


def _dying(pid: int) -> bool:
    """``pid`` is already ending: inside exit(), or killed (SIGKILL pending) and not yet there.

    Such a process did not outlive the test: it dies with it. The sub-world zygote is one, killed when
    its test child ends (PR_SET_PDEATHSIG); caught here while it exited, with its command line already
    gone, it was named ``[python]``, a leftover of a test that started no process.
    """
    try:
        data = (_PROC / str(pid) / "stat").read_bytes().decode("utf-8", "replace")
        fields = data[data.rfind(")") + 2 :].split()
        if len(fields) > 6 and int(fields[6]) & _PF_EXITING:
            return True
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (
                1 << (signal.SIGKILL - 1)
            ):
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _session_of(pid: int) -> int | None:
    """The session id of ``pid``, None if it is gone (Linux answers for any process)."""
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _command(pid: int, name: str) -> str:
    """``pid``'s command line, or ``[name]`` when it has none.

    A process caught inside ``execve`` already has its new name but no arguments yet (the kernel sets
    them last): an empty command line is read again a few times before the name stands in for it.
    """
    raw = b""
    for attempt in range(_CMDLINE_TRIES):
        if attempt:
            sleep(0.01)
        try:
            raw = (_PROC / str(pid) / "cmdline").read_bytes()
        except OSError:
            break
        if raw:
            break
    words = [w.decode("utf-8", "replace") for w in raw.split(b"\0") if w]
    text = shlex.join(words) if words else f"[{name}]"
    return text if len(text) <= _COMMAND_CHARS else text[: _COMMAND_CHARS - 3] + "..."


def _proc_session_processes(sid: int, exclude: Collection[int]) -> dict[int, str]:
    found: dict[int, str] = {}
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in exclude or _session_of(pid) != sid:  # one syscall, not a file read, per process
            continue
        stat = _read_stat(pid)
        if stat is None or stat[2] != sid or stat[0] in ("Z", "X"):  # zombies have already exited
            continue
        if _dying(pid):
            continue
        found[pid] = _command(pid, stat[3])
    return found


def session_processes(sid: int, *, exclude: Collection[int] = ()) -> dict[int, str]:
    """Live processes of session ``sid`` (zombies excluded), pid -> command, ``exclude`` left out."""
    if not _PROC.is_dir():  # not Linux: nothing to read, nothing found (documented)
        return {}
    return _proc_session_processes(sid, exclude)


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited; reaps it when it is this process's own child."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not ours: its parent (or init) reaps it
        pass
    if _PROC.is_dir():
        stat = _read_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _signal_all(pids: Collection[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pids: set[int], until: float, alive: Callable[[int], bool]) -> set[int]:
    """Poll until every pid has exited or ``until``; return those still running."""
    left = {pid for pid in pids if alive(pid)}
    while left and monotonic() < until:
        sleep(0.02)
        left = {pid for pid in left if alive(pid)}
    return left


def end_session_leftovers(
    sid: int,
    *,
    exclude: Collection[int] = (),
    grace: float = DEFAULT_GRACE,
    rounds: int = 3,
    settle: float = 0.0,
) -> list[Leftover]:
    """End every live process of session ``sid`` but ``exclude``: SIGTERM, then SIGKILL after ``grace``.

    Repeats the search (up to ``rounds`` times) for processes started while the first ones were
    being ended, such as a shell's next command. Returns them in pid order, each with how it ended.
    ``settle``: seconds the processes first found get to exit by themselves, unreported: what ends
    with the session's leader (the sub-world zygote, when its test child died) was not left running.
    """
    ended: dict[int, Leftover] = {}
    skip = set(exclude)
    for round_ in range(rounds):
        found = session_processes(sid, exclude=skip | set(ended))
        if found and round_ == 0 and settle > 0:
            staying = _wait_gone(set(found), monotonic() + settle, _alive)
            skip |= set(found) - staying
            found = {pid: command for pid, command in found.items() if pid in staying}
        if not found:
            break
        _signal_all(found, signal.SIGTERM)
        killed = _wait_gone(set(found), monotonic() + grace, _alive)
        _signal_all(killed, signal.SIGKILL)
        _wait_gone(killed, monotonic() + 2.0, _alive)
        for pid, command in found.items():
            ended[pid] = Leftover(
                pid=pid, command=command, ended_by="SIGKILL" if pid in killed else "SIGTERM"
            )
    return [ended[pid] for pid in sorted(ended)]


def describe_leftovers(rank: int, leftovers: Collection[Leftover]) -> str:
    """One warning text: which rank left how many processes running, each with its pid and command."""
    who = fold_ranks([rank])
    count = len(leftovers)
    lines = [
        f"{who} left {count} process{'es' if count != 1 else ''} running after the test; "
        f"pytest-sprite ended {'them' if count != 1 else 'it'} (stop what a test starts, e.g. "
        "proc.terminate(); proc.wait() in a finally or a fixture's teardown):"
    ]
    for item in leftovers:
        lines.append(f"  pid {item.pid}: {item.command} (ended by {item.ended_by})")
    return "\n".join(lines)
