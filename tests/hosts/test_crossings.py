"""What crossed hosts, from TCP tables given to it: which process is at each end of a connection.

No hosts are made: the two hosts' TCP tables and socket owners are stand-ins; the processes named are real
(this pytest process and children whose command lines /proc reads), as ``_role`` reads them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_sprite.hosts.crossings import Crossings

pytestmark = pytest.mark.cpu

LISTEN, ESTABLISHED = "0A", "01"
CLIENT, SERVER = "host1 pytest controller", "host2 hosts daemon (ssh)"


@dataclass
class FakeHost:
    name: str
    address: str
    pid: int = 0
    lost: bool = False


@dataclass
class OneConnection:
    """This process on host1 connected to port 5000 on host2, whose end is ``server_inode`` held by
    ``server_pid`` (inode 0: not accepted yet). ``listed`` records each host whose processes were listed."""

    server_pid: int
    server_inode: int = 222
    host1: FakeHost = field(default_factory=lambda: FakeHost("host1", "10.9.0.1"))
    host2: FakeHost = field(default_factory=lambda: FakeHost("host2", "10.9.0.2"))
    listed: list[str] = field(default_factory=list)

    def table(self, host: FakeHost) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
        client, server = (self.host1.address, 40000), (self.host2.address, 5000)
        if host is self.host1:
            return [(client, server, ESTABLISHED, 111)]
        return [(server, ("0.0.0.0", 0), LISTEN, 200), (server, client, ESTABLISHED, self.server_inode)]

    def owners(self, host: FakeHost) -> dict[int, int]:
        self.listed.append(host.name)
        if host is self.host1:
            return {111: os.getpid()}
        return {self.server_inode: self.server_pid} if self.server_inode else {}  # no socket has inode 0

    def crossings(self, monkeypatch: pytest.MonkeyPatch) -> Crossings:
        monkeypatch.setattr(Crossings, "_table", staticmethod(self.table))
        monkeypatch.setattr(Crossings, "_owners", staticmethod(self.owners))
        return Crossings(hosts=[self.host1, self.host2])  # type: ignore[list-item]


@pytest.fixture
def daemon() -> Iterator[int]:
    """A process whose command line is the hosts daemon's, as a server's end of a connection."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", "_hostd.py"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    # Popen returns once the child's exec has closed its descriptors, which is before its command line is
    # set: read by a busy machine in that moment, it is empty. Its own first line comes after.
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    try:
        yield proc.pid
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()
        proc.wait(timeout=30)


def test_a_connection_seen_before_its_server_accepted_it_is_named_at_a_later_sample(
    monkeypatch: pytest.MonkeyPatch, daemon: int
) -> None:
    """A connection waiting in the server's accept queue has no socket yet (its inode reads 0). It was named
    ``?`` for good at its first sighting, and the run's list said ``host1 launcher-exec (ssh) -> host2 ?``
    (one run in nine of the two-host session test on a busy machine)."""
    connection = OneConnection(server_pid=daemon, server_inode=0)
    crossings = connection.crossings(monkeypatch)
    crossings.sample()
    assert crossings.lines() == [f"{CLIENT} -> host2 ?: 1 connection"]
    connection.server_inode = 222  # the daemon accepted it
    crossings.sample()
    assert crossings.lines() == [f"{CLIENT} -> {SERVER}: 1 connection"]


def test_a_process_without_a_command_line_yet_is_named_at_a_later_sample(
    monkeypatch: pytest.MonkeyPatch, daemon: int
) -> None:
    """A process inside its exec reads an empty command line (as an exited, unreaped one does): not yet named."""
    ended = subprocess.Popen([sys.executable, "-c", ""])
    while Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # exited, not reaped: its command line reads empty
    connection = OneConnection(server_pid=ended.pid)
    crossings = connection.crossings(monkeypatch)
    try:
        crossings.sample()
        assert crossings.lines() == [f"{CLIENT} -> host2 ?: 1 connection"]
    finally:
        ended.wait()
    connection.server_pid = daemon
    crossings.sample()
    assert crossings.lines() == [f"{CLIENT} -> {SERVER}: 1 connection"]


def test_an_end_is_named_once(monkeypatch: pytest.MonkeyPatch, daemon: int) -> None:
    """Both ends known: later samples do not list the hosts' processes again."""
    connection = OneConnection(server_pid=daemon)
    crossings = connection.crossings(monkeypatch)
    for _ in range(3):
        crossings.sample()
    assert crossings.lines() == [f"{CLIENT} -> {SERVER}: 1 connection"]
    assert connection.listed == ["host1", "host2"]
