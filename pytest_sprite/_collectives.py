"""What a rank's collectives say about a failure: the one it waits in, and a mismatch in short (issue 9).

Pure text functions over a faulthandler dump and torch's collective fingerprint error, so a timeout
report can name the collective each rank waits in, and a ``--collective-check`` failure shows each
rank's op, shapes, dtypes and sequence number on one line. Stdlib only; both sides import it.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["mismatch_summary", "waiting_collective"]

_FRAME: Final = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
_FINGERPRINT: Final = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+), "
    r"OpType=(?P<op>\w+)(?:, TensorShape=\[(?P<shape>[^\]]*)\])?(?:, TensorDtypes=(?P<dtypes>[\w, ]*?)(?:, TensorDeviceTypes|\)))?"
)


def waiting_collective(stacks: str) -> str | None:
    """``"all_reduce (called at test_x.py:12)"`` when a thread of ``stacks`` waits in torch.distributed.

    ``stacks`` is a faulthandler dump (most recent call first); the innermost public function of
    ``torch/distributed/`` in a thread is the collective, the first frame outside it the caller.
    None when no thread is inside torch.distributed.
    """
    collective: str | None = None
    for line in stacks.splitlines():
        if "(most recent call first)" in line:
            collective = None
            continue
        frame = _FRAME.match(line)
        if frame is None:
            continue
        in_torch_distributed = "/torch/distributed/" in frame["path"]
        if collective is None:
            if in_torch_distributed and not frame["func"].startswith("_") and frame["func"] != "wrapper":
                collective = frame["func"]
            continue
        if not in_torch_distributed:
            return f"{collective} (called at {frame['path'].rsplit('/', 1)[-1]}:{frame['line']})"
    return collective


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
