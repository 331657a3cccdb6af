"""Process plumbing shared by the processes the harness forks: warm imports and where output goes.

Stdlib only at import: the local launcher (controller side) and the rank side both use it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["preimport_torch", "redirect_output"]


def preimport_torch() -> None:
    """Import torch.distributed once, before forking, so every fork shares it copy-on-write and starts warm.

    No device is touched: this is the import only, as collection of a torch test module does.
    Without torch installed there is nothing to warm.
    """
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        pass


def redirect_output(path: Path, *, stdin_devnull: bool = False) -> None:
    """Send fd 1 and 2 (and so anything a C library prints) to ``path``, appended, for reading after a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if stdin_devnull:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
