"""The memory of a session's process tree: summed proportional set size, and at its peak, what each role holds.

A local world is a tree of processes: the pytest controller, one agent per rank, each agent's test child,
its zygotes and the sub-world ranks they fork. pytest-sprite names each process by its role
(``sprite-agent``, ``sprite-test``, ``sprite-spare``, ``sprite-pristine``, ``sprite-warm``, ``sprite-zygote``,
``sprite-subworld``; the
controller keeps ``python``), so a sample is summed by name. PSS splits a page shared by N processes into N
parts, so the sum over the tree is what the world costs the machine; ``Pss_Anon`` is memory a process wrote
(Python objects, tensors, buffers, including pages it still shares with its forked relatives), ``Pss_File``
its share of mapped files (libtorch and the other shared libraries, read once for every process).
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

FIELDS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def rollup_kb(pid: int) -> dict[str, int]:
    """The process's ``smaps_rollup`` figures of :data:`FIELDS` in kB; zeros when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return dict.fromkeys(FIELDS, 0)
    found = dict(re.findall(r"^(\w+):\s+(\d+) kB", text, re.MULTILINE))
    return {f: int(found.get(f, 0)) for f in FIELDS}


def _role(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class Watch(threading.Thread):
    """Samples the session's process tree every ``interval`` s: the peak of its summed PSS and its roles then."""

    def __init__(self, root: int, interval: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_kb = 0
        self.peak_roles: dict[str, dict[str, int]] = {}
        """At the peak: for each process name, how many there were and their summed :data:`FIELDS` (kB)."""
        self.seen: dict[int, str] = {}
        """Every process of the tree seen, with its start time (to end what outlives the session)."""
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        children: dict[int, list[int]] = {}
        starts: dict[int, str] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
                starts[int(entry.name)] = stat[1]
        tree, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            tree.add(pid)
            todo += children.get(pid, [])
        self.seen.update({p: starts[p] for p in tree if p in starts})
        roles: dict[str, dict[str, int]] = {}
        for pid in tree:
            figures = rollup_kb(pid)
            row = roles.setdefault(_role(pid), dict.fromkeys(("processes", *FIELDS), 0))
            row["processes"] += 1
            for f in FIELDS:
                row[f] += figures[f]
        total = sum(r["Pss"] for r in roles.values())
        if total > self.peak_kb:
            self.peak_kb, self.peak_roles = total, roles

    def end_leftovers(self) -> int:
        """SIGKILL the processes of the tree still running (the same start time: not a reused pid)."""
        ended = 0
        for pid, start in self.seen.items():
            stat = _stat(pid)
            if stat is not None and stat[1] == start and pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
                ended += 1
        return ended


def roles_record(roles: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """The peak's roles for a cell's JSON record, in MB, largest first."""
    mb = 1024
    ordered = sorted(roles.items(), key=lambda kv: -kv[1]["Pss"])
    return {
        name: {"processes": r["processes"], **{f.lower() + "_mb": round(r[f] / mb, 1) for f in FIELDS}}
        for name, r in ordered
    }
