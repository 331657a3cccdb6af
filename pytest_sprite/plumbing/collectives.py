"""What a rank's collectives say about a failure: the one it waits in, and a mismatch in short.

Pure functions over a rank's stack records (:class:`~pytest_sprite.plumbing.stacks.Stacks`, read once
where the dump was written) and torch's collective fingerprint error, so a timeout report can name the
collective each rank waits in and where each rank is (:func:`whereabouts`, for the roll call), and a
``--collective-check`` failure shows each rank's op, shapes, dtypes and sequence number on one line. Stdlib only; both sides import it.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .stacks import Frame, Stacks

__all__ = [
    "TRANSPORT_ERROR",
    "Where",
    "called_in",
    "called_name",
    "is_library",
    "mismatch_summary",
    "waiting_collective",
    "whereabouts",
]

TRANSPORT_ERROR: Final = re.compile(
    r"Connection (?:closed|reset) by peer|DistNetworkError|Broken pipe|ECONNRESET|EPIPE|"
    r"Socket Timeout|Connection refused|gloo.*(?:connectFullMesh|read|write|recv|send)",
    re.IGNORECASE,
)
"""What a rank's error says when its transport broke under it (gloo, the TCPStore), not its own fault."""

_FINGERPRINT: Final = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+), "
    r"OpType=(?P<op>\w+)(?:, TensorShape=\[(?P<shape>[^\]]*)\])?(?:, TensorDtypes=(?P<dtypes>[\w, ]*?)(?:, TensorDeviceTypes|\)))?"
)


def waiting_collective(stacks: Stacks) -> str | None:
    """``"all_reduce (called at test_x.py:12)"`` when a thread of ``stacks`` waits in torch.distributed.

    Each thread's frames are most recent first; the innermost public function of ``torch/distributed/``
    in a thread is the collective, the first frame outside it the caller. None when no thread is inside
    torch.distributed.
    """
    for thread in stacks.with_frames():
        frames = thread.frames
        found = _collective_in(frames)
        if found is None:
            continue
        collective, i = found
        caller = next((f for f in frames[i + 1 :] if "/torch/distributed/" not in f.file), None)
        if caller is None:
            return collective
        return f"{collective} (called at {caller.file.rsplit('/', 1)[-1]}:{caller.line})"
    return None


def mismatch_summary(message: str) -> str | None:
    """One line per rank from torch's "Detected mismatch between collectives" error, None for another error."""
    if "Detected mismatch between collectives" not in message:
        return None
    lines: dict[int, str] = {}
    for found in _FINGERPRINT.finditer(message):
        rank = int(found["rank"])
        shape = f" shape [{found['shape']}]" if found["shape"] is not None else ""
        dtypes = f" {found['dtypes']}" if found["dtypes"] else ""
        lines.setdefault(rank, f"rank {rank}: {found['op']} #{found['seq']}{shape}{dtypes}")
    return "\n".join(lines[r] for r in sorted(lines)) or None


_LIBRARY: Final = re.compile(
    r"/(?:site-packages|dist-packages)/|/lib/python\d[\d.]*/|^<frozen |/torch/|/_pytest/|/pluggy/"
)


def is_library(path: str) -> bool:
    """True for a frame of the standard library, an installed package, torch, pytest or the harness itself.

    The sprite's own code under test (``pytest_sprite/lightning``) counts as the user's.
    """
    if "/pytest_sprite/" in path:
        return "/pytest_sprite/lightning/" not in path
    return bool(_LIBRARY.search(path))


_CALL: Final = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


def called_in(source: str) -> str | None:
    """The first function a line of source calls (``time.sleep`` for ``time.sleep(60)``), None when none."""
    found = _CALL.search(source)
    return found[1] if found else None


def called_name(path: str, line: int) -> str | None:
    """The first function line ``line`` of file ``path`` calls, None when it calls none or is unreadable."""
    return called_in(linecache.getline(path, line))


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where one rank was when its stack was taken: its innermost frame of user code, and the collective it waits in."""

    collective: str | None
    """The torch.distributed function a thread waits in, None when none does."""
    path: str
    line: int | None
    """None where faulthandler could not tell."""
    callee: str | None
    """What the user frame calls (from its source line, else the next frame's function)."""

    @property
    def at(self) -> str:
        return f"{self.path.rsplit('/', 1)[-1]}:{'???' if self.line is None else self.line}"

    def text(self) -> str:
        """``waiting in all_reduce (test.py:9)`` or ``elsewhere, in time.sleep (test.py:11)``."""
        if self.collective is not None:
            return f"waiting in {self.collective} ({self.at})"
        if self.callee is not None:
            return f"elsewhere, in {self.callee} ({self.at})"
        return f"elsewhere ({self.at})"


def _collective_in(thread: Sequence[Frame]) -> tuple[str, int] | None:
    """The innermost public torch.distributed function of ``thread`` and its index, None if none."""
    for i, frame in enumerate(thread):
        if (
            "/torch/distributed/" in frame.file
            and not frame.function.startswith("_")
            and frame.function != "wrapper"
        ):
            return frame.function, i
    return None


def _user_frame(thread: Sequence[Frame], start: int) -> int | None:
    """Index of the first frame of user code at or after ``start`` (outward), None when there is none."""
    return next((i for i in range(start, len(thread)) if not is_library(thread[i].file)), None)


def whereabouts(stacks: Stacks) -> Where | None:
    """Where the rank whose stacks are ``stacks`` was, None when no thread shows a frame.

    The thread waiting in a collective speaks for the rank; else the main thread (the one whose
    outermost frame is a module's), else the first with user code.
    """
    threads = [t.frames for t in stacks.with_frames()]
    if not threads:
        return None
    for thread in threads:
        found = _collective_in(thread)
        if found is not None:
            collective, i = found
            user = _user_frame(thread, i + 1)
            if user is None:
                user = next((j for j in range(i + 1, len(thread)) if "/torch/" not in thread[j].file), i)
            frame = thread[user]
            return Where(collective=collective, path=frame.file, line=frame.line, callee=collective)
    with_user = [t for t in threads if _user_frame(t, 0) is not None]
    main = [t for t in with_user if t[-1].function == "<module>"]
    thread = (main or with_user or threads)[0]
    user = _user_frame(thread, 0)
    if user is None:
        user = 0
    frame = thread[user]
    callee = (called_name(frame.file, frame.line) if frame.line is not None else None) or (
        thread[user - 1].function if user > 0 else None
    )
    return Where(collective=None, path=frame.file, line=frame.line, callee=callee)
