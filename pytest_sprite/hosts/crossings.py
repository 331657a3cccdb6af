"""What crossed hosts: every TCP connection between two hosts of the run, by the processes at each end.

A thread reads each host's TCP table (``/proc/<host's process 1>/net/tcp`` and ``tcp6``: no process is
started) a few times a second. A connection between two hosts' addresses is named by its two processes
(the one whose port is listening is the server), each by its role: the pytest controller, a rank agent, a
test or sub-world rank (a child of an agent), hydra's ``mpiexec`` and proxy, the launcher-exec and the
hosts' daemon. Sampling misses a connection that lives less than a sample; the rest are counted once each.
An end whose process is not known yet (a connection the server has not accepted has no socket, a process
inside its exec has no command line) is looked for again at each sample while the connection lasts; one
never found is printed as ``?``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .machine import Host

__all__ = ["Crossings"]

_ESTABLISHED, _LISTEN = "01", "0A"


def _address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (or its IPv6 form) as ("127.0.0.1", 8080); a v4-mapped IPv6 address as IPv4."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        return socket.inet_ntoa(raw[::-1]), int(port, 16)
    words = struct.unpack("<4I", raw)
    v6 = struct.pack(">4I", *words)
    if v6[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntoa(v6[12:]), int(port, 16)
    return socket.inet_ntop(socket.AF_INET6, v6), int(port, 16)


def _role(pid: int) -> str | None:
    """What ``pid`` is in the run; None while it cannot tell (a process inside its exec has no command line yet)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent_argv = Path(f"/proc/{parent}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return "a process that has ended"
    program = os.path.basename(argv[0].decode(errors="replace"))
    if program.startswith("mpiexec"):
        return "mpiexec"
    if program == "hydra_pmi_proxy":
        return "hydra proxy"
    text = b" ".join(argv)
    if b"_hostd.py" in text:
        return "hosts daemon (ssh)"
    if b"_rsh.py" in text:
        return "launcher-exec (ssh)"
    if b"--sprite-agent" in text:
        return "test/sub-world rank" if b"--sprite-agent" in parent_argv else "rank agent"
    if b"pytest" in text:
        return "pytest controller"
    return program or None


@dataclass
class Crossings:
    """Samples the hosts' TCP tables until :meth:`stop`; :meth:`lines` says what crossed."""

    hosts: Sequence[Host]
    interval: float = 0.3
    seen: dict[tuple[str, int, str, int], tuple[str | None, str | None]] = field(default_factory=dict)
    """(client address, port, server address, server port) -> (client role, server role)."""
    listening: set[tuple[str, int]] = field(default_factory=set)
    """(host, port) of every listening socket seen."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sprite-hosts-crossings", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.sample()  # the last state, while the hosts still exist

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):
                self.sample()

    def sample(self) -> None:
        by_address = {h.address: h for h in self.hosts}
        tables = {h.name: self._table(h) for h in self.hosts if not h.lost}
        listening = {
            (name, local[1])
            for name, rows in tables.items()
            for local, _, state, _ in rows
            if state == _LISTEN
        }
        for host in self.hosts:
            new: list[tuple[tuple[str, int, str, int], int, bool]] = []
            for local, remote, state, inode in tables.get(host.name, []):
                other = by_address.get(remote[0])
                if state != _ESTABLISHED or local[0] != host.address or other is None or other is host:
                    continue
                server_here = (host.name, local[1]) in listening
                key = (remote[0], remote[1], *local) if server_here else (*local, *remote)
                if self.seen.get(key, (None, None))[1 if server_here else 0] is None:
                    new.append((key, inode, server_here))
            if not new:
                continue
            owners = self._owners(host)
            for key, inode, server_here in new:
                client, server = self.seen.get(key, (None, None))
                # Not found: a connection not yet accepted has no socket (its inode reads 0), or its holder
                # was not listed in time, or is inside its exec. Left unknown: the next sample asks again.
                mine = _role(owners[inode]) if inode in owners else None
                self.seen[key] = (client, mine) if server_here else (mine, server)

    @staticmethod
    def _table(host: Host) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
        rows = []
        for name in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{host.pid}/net/{name}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                rows.append((_address(fields[1]), _address(fields[2]), fields[3], int(fields[9])))
        return rows

    @staticmethod
    def _owners(host: Host) -> dict[int, int]:
        """Socket inode -> pid, for the processes of ``host`` (of several holders, the oldest)."""
        try:
            netns = os.readlink(f"/proc/{host.pid}/ns/net")
        except OSError:
            return {}
        owners: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry.name}/ns/net") != netns:
                    continue
                fds = os.listdir(f"/proc/{entry.name}/fd")
            except OSError:
                continue
            for fd in fds:
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry.name}/fd/{fd}")
                    if target.startswith("socket:["):  # an inherited socket: its first owner made it
                        inode, pid = int(target[8:-1]), int(entry.name)
                        owners[inode] = min(pid, owners.get(inode, pid))
        return owners

    def lines(self) -> list[str]:
        """One line per (client host and role, server host and role): how many connections crossed."""
        name = {h.address: h.name for h in self.hosts}
        counts = Counter(
            (name[c_addr], roles[0] or "?", name[s_addr], roles[1] or "?")
            for (c_addr, _, s_addr, _), roles in self.seen.items()
        )
        return [
            f"{client_host} {client} -> {server_host} {server}: {n} connection{'s' if n > 1 else ''}"
            for (client_host, client, server_host, server), n in sorted(counts.items())
        ]
