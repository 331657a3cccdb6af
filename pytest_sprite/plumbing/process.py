"""Process plumbing shared by the processes the harness forks: warm imports, where output goes, how one ended.

Stdlib only at import: the local launcher (controller side) and the rank side both use it.

Pre-warming is the harness's job: before a process is forked from, it loads what every fork
would otherwise load again on first use, so forks start warm. Three depths: :func:`preimport_torch`
(an agent, before its test children), :func:`prewarm_training` (a crash matrix's test process, before its
runs) and :func:`prewarm_fit` (a zygote, before the sub-world ranks of a Lightning fit). No device is
touched and no process group is made: imports only.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import os
import select
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from .timing import monotonic, sleep

__all__ = [
    "LATE_IMPORTS",
    "become_subreaper",
    "collapse_heap_once",
    "computing_before_fork",
    "die_with_parent",
    "exit_descriptor",
    "exit_text",
    "install_stack_dumps",
    "name_process",
    "note_tests_ran_here",
    "one_thread_after_fork",
    "preimport_torch",
    "prewarm_fit",
    "prewarm_training",
    "redirect_output",
    "skip_static_destructors_at_exit",
    "tests_ran_here",
    "wait_for_exits",
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


def prewarm_training() -> None:
    """Import what torch loads on first use of an optimizer, ``torch.save`` and ``torch.load`` (seconds, cold).

    Runs in the test process before the first fork when torch is already imported there, so every forked run
    starts warm: measured here, the first ``torch.optim.SGD(...)`` of a process takes several seconds (it imports
    ``torch._dynamo``) and a fork that inherits it trains the planted protocol in 0.09 s.
    """
    import io

    if "torch" not in sys.modules:
        return
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(1)
    opt.step()
    buf = io.BytesIO()
    torch.save({"p": p.detach(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)


LATE_IMPORTS: tuple[str, ...] = (
    "pytest_sprite.lightning",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.utils.serialization",
    "torch.profiler",
    "torch.profiler._cupti_monitor",
    "fsspec.implementations.chained",
)
"""Modules a fit under XPUDDPStrategy or FSDP2Strategy imports on first use (found by diffing ``sys.modules``
before and after a fit in a fork, torch 2.13 and Lightning 2.6.6): DDP's communication hooks when the
strategy wraps the model, ``torch.distributed.checkpoint.state_dict`` and its fsspec writer at an FSDP2 save,
torch's serialization config at the first ``torch.save``. Measured on a 2-core machine, 0.7 s of a 2-rank DDP
fit of 1.4 s went to importing ``ddp_comm_hooks``. Private names may move between versions: a module that
is not there is skipped."""


def prewarm_fit() -> None:
    """Import :data:`LATE_IMPORTS`, skipping those this installation does not have."""
    for name in LATE_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


MADV_COLLAPSE = 25
"""Linux 6.1: back a range with huge pages now (``madvise(2)``)."""
_HUGE_PAGE = 2 << 20
_DECIDED = False

HUGE_PAGES_FROM_FORKS = 64
"""Children a process must be about to fork before collapsing its heap pays: collapsing takes 0.3-0.7 s on the
2-core test machine, and each fork and exit it makes cheaper saves 15-25 ms of CPU there, less wall time on two
busy cores. Sessions of 2-rank tests there, collapsed and not, side by side: 40 forks 0.13 s slower, 80 forks
0.2 s faster, 122 forks 0.6 s faster."""


def collapse_heap_once(*, forks: int) -> int:
    """Back this process's private anonymous memory with 2 MiB pages, decided once per line of forks.

    A fork copies one page-table entry per 4 KiB page its parent holds, and a child tears as many down
    when it exits: a process that imported torch and Lightning forked in 17.6-20 ms on the 2-core test
    machine, and in 3.6-4.7 ms once its heap was collapsed (one entry per 2 MiB). Called where the
    ranks are forked from, with how many test children that process and its forks are about to fork:
    the controller before it forks local agents (which then share its huge pages: collapsing in each
    agent would copy the heap once per agent), a launched agent before it forks its children. It
    collapses when ``forks`` reaches :data:`HUGE_PAGES_FROM_FORKS`; either way its forks inherit the
    decision and do not collapse again. Returns the bytes collapsed; 0 where Linux cannot (before 6.1,
    huge pages off), for fewer forks, or when ``SPRITE_HUGE_PAGES=0``.
    """
    global _DECIDED
    if _DECIDED:
        return 0
    _DECIDED = True
    if forks < HUGE_PAGES_FROM_FORKS or os.environ.get("SPRITE_HUGE_PAGES", "1") == "0":
        return 0
    libc = _libc()
    try:
        import ctypes

        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except (OSError, AttributeError):  # no C library or no madvise (not Linux), or no /proc
        return 0
    collapsed = 0
    for line in lines:
        fields = line.split()
        if fields[1] != "rw-p" or fields[4] != "0" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        start = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        end = end // _HUGE_PAGE * _HUGE_PAGE
        if end > start and madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += end - start
    return collapsed


_RAN_TESTS_HERE = False


def note_tests_ran_here() -> None:
    """Called before this process runs a test itself: from now on it may hold OpenMP's thread pool."""
    global _RAN_TESTS_HERE
    _RAN_TESTS_HERE = True


def tests_ran_here() -> bool:
    """True once :func:`note_tests_ran_here` was called: a fork of this process must keep to one thread."""
    return _RAN_TESTS_HERE


@contextmanager
def computing_before_fork() -> Iterator[None]:
    """Compute on one CPU thread inside, in a process that forks ranks afterwards (restored on the way out).

    GNU OpenMP (torch's CPU wheels) does not survive a fork: once a process has run a parallel region on
    more than one thread, a child forked from it that runs one on more than one thread waits forever for
    threads that were not copied (a 1-rank role's first matmul, under Lightning's thread count, hung so).
    A region on one thread starts no pool, so what the controller's ``pytest_sprite_before_fork`` and a
    sub-world zygote's preparation compute leaves their forks free to choose their own thread counts.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


@functools.cache
def _libc() -> Any:
    """The C library, for the Linux calls Python's os module lacks (prctl, madvise); None where unavailable.

    Loaded once per process tree: each ``CDLL`` makes a new function-pointer class, which cost every test
    child two of them (a few hundred microseconds) when each call loaded its own.
    """
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> bool:
    libc = _libc()
    try:
        return libc is not None and libc.prctl(option, arg, 0, 0, 0) == 0
    except AttributeError:  # no prctl: not Linux
        return False


def name_process(role: str) -> None:
    """Show this process as ``sprite-<role>`` in ``ps -o comm``, ``top`` and ``/proc/PID/comm``.

    Every process of a session runs the same ``python -m pytest`` command line; the name tells a rank's
    agent, its test child, its zygotes and a sub-world's ranks apart when reading ``top`` at 96 ranks, and
    lets a memory sampler sum them by role (an agent's spare child waits for the next test as
    ``sprite-spare``). Linux keeps 15 bytes of it; elsewhere nothing changes.
    """
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(f"sprite-{role}"[:15])
    except OSError:
        pass


def die_with_parent() -> bool:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG); False where prctl is missing."""
    return _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def become_subreaper() -> bool:
    """Keep what this process starts, once orphaned, as its own children (PR_SET_CHILD_SUBREAPER, Linux 3.4)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


_FAST_EXIT_SET = False


def skip_static_destructors_at_exit() -> bool:
    """End this process, once Python has finalized, without running the C++ static destructors loaded so far.

    At exit, after Python's own finalization, the C library runs the destructors every loaded C++ library
    registered: torch's deregister each operator kernel from its dispatcher, 0.15-0.2 s of the 0.3-0.4 s a
    session's process took to exit on the 2-core test machine after it had said everything. Registered
    here, ``_exit`` runs before them (the C library calls exit handlers last registered first) with the
    exit status ``exit`` was given. Python's finalization still runs whole (atexit handlers, ``sys.stdout``
    and ``sys.stderr`` flushed, modules torn down); C stdio buffers are flushed by a Python atexit handler.
    Call it late, once the libraries are loaded (those loaded later still run their destructors). Once per
    process; False where the C library has no ``on_exit`` (not glibc) or ``SPRITE_FAST_EXIT=0``.
    """
    global _FAST_EXIT_SET
    if _FAST_EXIT_SET or os.environ.get("SPRITE_FAST_EXIT", "1") == "0":
        return False
    libc = _libc()
    try:
        import atexit
        import ctypes

        on_exit, fflush = libc.on_exit, libc.fflush
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fflush.argtypes = [ctypes.c_void_p]
        # _exit(int) called as an on_exit handler (int status, void *arg): the status is its argument.
        exit_now = ctypes.cast(libc._exit, ctypes.c_void_p).value
    except AttributeError:  # no C library, or one without on_exit
        return False
    if on_exit(exit_now, None) != 0:
        return False
    atexit.register(fflush, None)
    _FAST_EXIT_SET = True
    return True


def exit_descriptor(pid: int) -> int | None:
    """A descriptor of child ``pid`` that becomes readable when it ends (a pidfd, Linux 5.3), for a loop
    that waits on its sockets to wake at the exit too, not at its next poll; None where there is none (the
    loop polls then). The caller closes it once the child is reaped."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def wait_for_exits(pids: Sequence[int], timeout: float) -> bool:
    """Wait until every one of this process's children ``pids`` has ended (not reaped); False at the timeout.

    Woken by the exit itself (a pidfd per child, Linux 5.3) rather than by polling: a session's end waits
    for its agents, which end a few milliseconds after they are told to, and a poll every few milliseconds
    overshot that by up to its own period. Elsewhere it polls every 10 ms.
    """
    deadline = monotonic() + timeout
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:  # reaped already
                continue
            except (AttributeError, OSError):  # no pidfds here: poll instead
                return _poll_for_exits(pids, deadline)
        poller = select.poll()  # not select(): a busy controller's descriptors may number beyond 1024
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while fds:
            ready = poller.poll(max(0.0, deadline - monotonic()) * 1000)
            if not ready:
                return False
            for fd, _ in ready:
                poller.unregister(fd)
                fds.remove(fd)
                os.close(fd)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _poll_for_exits(pids: Sequence[int], deadline: float) -> bool:
    """:func:`wait_for_exits` without pidfds: ask every 10 ms, leaving each status for the caller's waitpid."""
    while True:
        live = []
        for pid in pids:
            try:  # ended, not reaped: left for the caller's waitpid
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    live.append(pid)
            except ChildProcessError:
                continue
        if not live:
            return True
        if monotonic() >= deadline:
            return False
        sleep(0.01)


def wait_status(status: int) -> tuple[int | None, int | None]:
    """``(exit code, signal)`` of a wait status from ``os.waitpid``: one of them is None."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else None), None


def exit_text(exitcode: int | None, signum: int | None) -> str:
    """How a process ended, in the words every report of the harness uses: ``signal 9`` or ``exit code 3``."""
    return f"signal {signum}" if signum is not None else f"exit code {exitcode}"
