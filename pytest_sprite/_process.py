"""Process plumbing shared by the processes the harness forks: warm imports, where output goes, how one ended.

Stdlib only at import: the local launcher (controller side) and the rank side both use it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import IO, Any

__all__ = [
    "die_with_parent",
    "install_stack_dumps",
    "one_thread_after_fork",
    "preimport_torch",
    "redirect_output",
    "wait_status",
]


def preimport_torch() -> None:
    """Import torch.distributed once, before forking, so every fork shares it copy-on-write and starts warm.

    No device is touched: this is the import only, as collection of a torch test module does.
    Without torch installed there is nothing to warm.
    """
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        pass


def one_thread_after_fork() -> None:
    """In a child forked from a process that may have computed: run torch's CPU ops on one thread.

    GNU OpenMP (torch's CPU wheels) does not survive a fork: once the parent has run a parallel region,
    the child's first one waits forever for threads that were not copied. A plain test's forks come from
    the pytest process, which earlier tests may have used; one intra-op thread never enters OpenMP.
    ``OMP_NUM_THREADS=1`` tells the code that would choose a thread count that it is chosen.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


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


_KEEP: list[IO[Any]] = []
"""Files faulthandler writes into: kept open for the life of the process."""


def install_stack_dumps(output: Path, stacks: Path, signum: int) -> None:
    """A crash's traceback goes to ``output`` (appended); ``signum`` dumps every thread's stack to ``stacks``."""
    out = open(output, "a")
    faulthandler.enable(file=out, all_threads=True)
    dumps = open(stacks, "w")
    faulthandler.register(signum, file=dumps, all_threads=True, chain=False)
    _KEEP.extend([out, dumps])


def die_with_parent() -> bool:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG); False where prctl is missing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def wait_status(status: int) -> tuple[int | None, int | None]:
    """``(exit code, signal)`` of a wait status from ``os.waitpid``: one of them is None."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else None), None
