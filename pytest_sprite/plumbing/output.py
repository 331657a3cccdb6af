"""What the harness shows of a rank's output: the tail of a log file, without the harness's own frames.

A rank's stack at a timeout should show the test and the library it waits in, not the fifty
frames of pluggy, pytest's runner and the rank agent below it; a rank's traceback should end at the
test's line that called the collective, not print the source and docstring of ``all_reduce``
(:func:`hide_library_frames`). Stdlib only: both sides use it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .stacks import is_harness, parse_frame

__all__ = ["hide_library_frames", "strip_harness_frames", "tail_of_file"]


def strip_harness_frames(text: str) -> str:
    """``text`` without the faulthandler frame lines of pytest, pluggy or the sprite harness (a crash's dump
    in a rank's output), each line read by the one frame reader of :mod:`pytest_sprite.plumbing.stacks`."""
    return "\n".join(line for line in text.splitlines() if not _harness_line(line))


def _harness_line(line: str) -> bool:
    frame = parse_frame(line)
    return frame is not None and is_harness(frame)


def tail_of_file(
    path: Path, lines: int = 40, *, strip_harness: bool = False, window: int = 256 * 1024
) -> str:
    """The last ``lines`` lines of a text file (read from its last ``window`` bytes), empty if it does not exist.

    ``strip_harness`` drops the harness's frames from faulthandler dumps before counting lines.
    """
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - window))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    if strip_harness:
        text = strip_harness_frames(text)
    return "\n".join(text.splitlines()[-lines:])


def _hidden_module(name: str) -> bool:
    """torch.distributed's modules and the harness's, but not the sprite's code under test (``lightning``)."""
    if name == "torch.distributed" or name.startswith("torch.distributed."):
        return True
    if name == "pytest_sprite" or name.startswith("pytest_sprite."):
        return not name.startswith("pytest_sprite.lightning")
    return False


def hide_library_frames(config: Any) -> None:
    """Hide torch.distributed's and the harness's frames from this process's tracebacks, as pytest hides its own.

    Sets ``__tracebackhide__`` in the globals of every such module loaded so far, which pytest honours
    for each frame running in them: a rank's failure then ends at the test's call of the collective,
    and that line is also where its short summary points. Called in a test child just
    before a report is made, so modules the test imported are covered; the child ends with the test,
    so nothing else sees the mark. ``--tb=long`` and ``--full-trace`` keep every frame.
    """
    if config.getoption("tbstyle", "auto") == "long" or config.getoption("fulltrace", False):
        return
    for name, module in list(sys.modules.items()):
        if module is not None and _hidden_module(name):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict):
                namespace.setdefault("__tracebackhide__", True)
