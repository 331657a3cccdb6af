"""What the harness shows of a rank's output: the tail of a log file, without the harness's own frames.

A rank's stack at a timeout should show the test and the library it waits in, not the fifty
frames of pluggy, pytest's runner and the rank agent below it. Stdlib only: both sides use it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Final

__all__ = ["strip_harness_frames", "tail_of_file"]


def _harness_dirs() -> list[str]:
    """Where the harness's own packages (rank side, controller side) are installed; found, not imported."""
    dirs = []
    for name in ("pytest_sprite.rank", "pytest_sprite.launch"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            dirs += [os.path.realpath(d) for d in spec.submodule_search_locations]
            dirs += [d for d in spec.submodule_search_locations if d not in dirs]
    return dirs


_HARNESS: Final = re.compile(
    r'^\s*File "(?:[^"]*/(?:pluggy|_pytest)/[^"]*|'
    + "|".join(re.escape(d) + r"/[^\"]*" for d in _harness_dirs())
    + r'|<frozen runpy>|[^"]*/pytest/__main__\.py)", line \d+'
)


def strip_harness_frames(text: str) -> str:
    """``text`` without faulthandler frame lines that belong to pytest, pluggy or the sprite harness."""
    return "\n".join(line for line in text.splitlines() if not _HARNESS.match(line))


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
