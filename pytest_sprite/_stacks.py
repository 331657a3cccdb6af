"""Readable stacks: drop the harness's own frames from faulthandler dumps.

A rank's stack at a timeout should show the test and the library it waits in, not the fifty
frames of pluggy, pytest's runner and the rank agent below it.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["strip_harness_frames", "tail_lines"]

_HARNESS: Final = re.compile(
    r'^\s*File "(?:[^"]*/(?:pluggy|_pytest)/[^"]*|[^"]*/pytest_sprite/(?:rank|launch)/[^"]*|'
    r'<frozen runpy>|[^"]*/pytest/__main__\.py)", line \d+'
)


def strip_harness_frames(text: str) -> str:
    """``text`` without faulthandler frame lines that belong to pytest, pluggy or the sprite harness."""
    return "\n".join(line for line in text.splitlines() if not _HARNESS.match(line))


def tail_lines(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])
