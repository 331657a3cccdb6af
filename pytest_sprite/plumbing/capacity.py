"""How many local ranks this machine can hold: processes, file descriptors and memory, measured.

A local world is W forks of the controller, each of which forks a test child per ranks test. Asked for
more than the machine holds (``--ranks=100000``), the forks would go on until the process limit and fail
there, half started. :func:`local_world_shortfall` says so before the first fork, with the figures it
read: the process limit (``RLIMIT_NPROC``, ``kernel.pid_max`` and ``kernel.threads-max`` less the tasks
running now), the descriptors the controller has left (``RLIMIT_NOFILE`` less those open now; it holds a
socket per agent) and the memory available (``MemAvailable``) against what one forked process of this
controller holds alone once it has frozen and collected its heap as an agent does (a probe fork's private
memory).
"""

from __future__ import annotations

import gc
import os
import resource
from dataclasses import dataclass
from typing import Final

__all__ = ["PROCESSES_PER_RANK", "Capacity", "local_world_shortfall", "measure"]

PROCESSES_PER_RANK: Final = 3
"""A rank's agent, its test child and the spare child it forks for the next test."""
MEMORY_PROCESSES_PER_RANK: Final = 2
"""Processes of a rank whose private memory counts: the agent and its running test child."""
DESCRIPTORS_PER_RANK: Final = 1
"""The controller's socket to each agent."""
_SPARE_DESCRIPTORS: Final = 64
"""What the controller keeps for itself: its log, listener, pytest's captures, a test's own files."""
_PROBE_FROM: Final = 16
"""Worlds smaller than this fork no probe: a few ranks never exhaust memory by their fork alone."""


@dataclass(frozen=True)
class Capacity:
    """What this machine has left, as read now; None where the figure could not be read."""

    processes: int | None
    """Tasks this user may still start: the least of RLIMIT_NPROC, pid_max and threads-max less those running."""
    processes_from: str
    """Which limit :attr:`processes` comes from, in the words the refusal names."""
    descriptors: int | None
    """Descriptors this process may still open (RLIMIT_NOFILE's soft limit less those open)."""
    memory: int | None
    """Bytes available (MemAvailable)."""
    per_process: int | None
    """Bytes one fork of this process holds alone once it touched its heap (None: not probed)."""


def measure(*, probe: bool) -> Capacity:
    """Read the machine's limits now; ``probe``: also fork once to measure a fork's private memory."""
    processes, processes_from = _processes_left()
    return Capacity(
        processes=processes,
        processes_from=processes_from,
        descriptors=_descriptors_left(),
        memory=_meminfo("MemAvailable"),
        per_process=_probe_fork() if probe else None,
    )


def local_world_shortfall(world_size: int, capacity: Capacity | None = None) -> str | None:
    """Why a local world of ``world_size`` ranks does not fit this machine, with the figures; None when it does."""
    cap = capacity if capacity is not None else measure(probe=world_size >= _PROBE_FROM)
    need = world_size * PROCESSES_PER_RANK
    if cap.processes is not None and need > cap.processes:
        return (
            f"a local world of {world_size} ranks needs about {need} processes ({PROCESSES_PER_RANK} a rank: "
            f"agent, test child, spare) and this machine has {cap.processes} left ({cap.processes_from})"
        )
    fds = world_size * DESCRIPTORS_PER_RANK + _SPARE_DESCRIPTORS
    if cap.descriptors is not None and fds > cap.descriptors:
        return (
            f"a local world of {world_size} ranks needs about {fds} file descriptors in the controller (one "
            f"socket a rank) and it has {cap.descriptors} left (RLIMIT_NOFILE, `ulimit -n`)"
        )
    if cap.memory is not None and cap.per_process is not None:
        memory = world_size * MEMORY_PROCESSES_PER_RANK * cap.per_process
        if memory > cap.memory:
            return (
                f"a local world of {world_size} ranks needs about {_gib(memory)} of memory before any test "
                f"computes ({MEMORY_PROCESSES_PER_RANK} processes a rank at {_mib(cap.per_process)} each, "
                f"measured on a fork of this process) and {_gib(cap.memory)} is available (MemAvailable)"
            )
    return None


def _processes_left() -> tuple[int | None, str]:
    tasks = _tasks_now()
    candidates: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # root is not held to RLIMIT_NPROC
        mine = _user_tasks()
        if mine is not None:
            candidates.append(
                (soft - mine, f"RLIMIT_NPROC {soft}, `ulimit -u`, less {mine} tasks of this user")
            )
    for name in ("pid_max", "threads-max"):
        limit = _read_int(f"/proc/sys/kernel/{name}")
        if limit is not None and tasks is not None:
            candidates.append((limit - tasks, f"kernel.{name} {limit} less {tasks} tasks running"))
    if not candidates:
        return None, ""
    left, source = min(candidates)
    return max(left, 0), source


def _tasks_now() -> int | None:
    """Every task (thread) on the machine now: /proc/loadavg's fourth field is running/total."""
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            return int(fh.read().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None


def _user_tasks() -> int | None:
    """Tasks (threads) of this user now, which RLIMIT_NPROC counts."""
    uid, count = os.getuid(), 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def _descriptors_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _probe_fork() -> int | None:
    """Fork once; the child starts as an agent does, reports the memory it holds alone (Private_Clean +
    Private_Dirty of smaps_rollup, in bytes) and exits at once.

    The agents are forked after the controller froze its heap out of the cyclic collector (``gc.freeze``),
    so their collections leave the inherited heap shared; the probe freezes it too before its full
    collection. Without the freeze its collection touched every object torch and Lightning had made and
    counted that copy once per process: 115 MiB where an agent holds 3, which refused a 96-rank world that
    runs in a third of the memory the refusal named.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: nothing here may raise or return
        code = 0
        try:
            os.close(read_fd)
            gc.freeze()
            gc.collect()
            private = _private_bytes("/proc/self/smaps_rollup")
            os.write(write_fd, str(private if private is not None else -1).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as fh:
            text = fh.read().decode() or "-1"
    finally:
        os.waitpid(pid, 0)
    value = int(text)
    return value if value > 0 else None


def _private_bytes(path: str) -> int | None:
    total, seen = 0, False
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
                    seen = True
    except (OSError, ValueError):
        return None
    return total if seen else None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
