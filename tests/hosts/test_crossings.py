"""What crossed hosts, from TCP tables given to it: which process is at each end of a connection.

No hosts are made: the two hosts' TCP tables and socket owners are stand-ins; the processes named are real
(this pytest process and a child whose command line names the hosts' daemon), as ``/proc`` reads them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_sprite.hosts.crossings import Crossings

pytestmark = pytest.mark.cpu

LISTEN, ESTABLISHED = "0A", "01"


@dataclass
class FakeHost:
    name: str
    address: str
    pid: int = 0
    lost: bool = False


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
    host1, host2 = FakeHost("host1", "10.9.0.1"), FakeHost("host2", "10.9.0.2")
    accepted = {"inode": 0}  # host2's end of the connection: not accepted yet

    def table(host: FakeHost) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
        if host is host1:
            return [((host1.address, 40000), (host2.address, 5000), ESTABLISHED, 111)]
        return [
            ((host2.address, 5000), ("0.0.0.0", 0), LISTEN, 200),
            ((host2.address, 5000), (host1.address, 40000), ESTABLISHED, accepted["inode"]),
        ]

    def owners(host: FakeHost) -> dict[int, int]:
        return {111: os.getpid()} if host is host1 else {200: daemon, 222: daemon}

    monkeypatch.setattr(Crossings, "_table", staticmethod(table))
    monkeypatch.setattr(Crossings, "_owners", staticmethod(owners))
    crossings = Crossings(hosts=[host1, host2])  # type: ignore[list-item]

    crossings.sample()
    assert crossings.lines() == ["host1 pytest controller -> host2 ?: 1 connection"]
    accepted["inode"] = 222  # the daemon accepted it
    crossings.sample()
    assert crossings.lines() == ["host1 pytest controller -> host2 hosts daemon (ssh): 1 connection"]


def test_an_end_is_named_once(monkeypatch: pytest.MonkeyPatch, daemon: int) -> None:
    """Both ends known: later samples do not list the hosts' processes again."""
    host1, host2 = FakeHost("host1", "10.9.0.1"), FakeHost("host2", "10.9.0.2")
    listed: list[str] = []

    def table(host: FakeHost) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
        if host is host1:
            return [((host1.address, 40000), (host2.address, 5000), ESTABLISHED, 111)]
        return [
            ((host2.address, 5000), ("0.0.0.0", 0), LISTEN, 200),
            ((host2.address, 5000), (host1.address, 40000), ESTABLISHED, 222),
        ]

    def owners(host: FakeHost) -> dict[int, int]:
        listed.append(host.name)
        return {111: os.getpid()} if host is host1 else {222: daemon}

    monkeypatch.setattr(Crossings, "_table", staticmethod(table))
    monkeypatch.setattr(Crossings, "_owners", staticmethod(owners))
    crossings = Crossings(hosts=[host1, host2])  # type: ignore[list-item]
    for _ in range(3):
        crossings.sample()
    assert crossings.lines() == ["host1 pytest controller -> host2 hosts daemon (ssh): 1 connection"]
    assert listed == ["host1", "host2"]


def test_a_process_without_a_command_line_yet_is_named_at_a_later_sample(
    monkeypatch: pytest.MonkeyPatch, daemon: int
) -> None:
    """A process inside its exec reads an empty command line (as an exited, unreaped one does): not yet named."""
    host1, host2 = FakeHost("host1", "10.9.0.1"), FakeHost("host2", "10.9.0.2")
    ended = subprocess.Popen([sys.executable, "-c", ""])
    while not Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
        time.sleep(0.01)  # exited, not reaped: its command line reads empty
    holder = {222: ended.pid}

    def table(host: FakeHost) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
        if host is host1:
            return [((host1.address, 40000), (host2.address, 5000), ESTABLISHED, 111)]
        return [
            ((host2.address, 5000), ("0.0.0.0", 0), LISTEN, 200),
            ((host2.address, 5000), (host1.address, 40000), ESTABLISHED, 222),
        ]

    monkeypatch.setattr(Crossings, "_table", staticmethod(table))
    monkeypatch.setattr(
        Crossings, "_owners", staticmethod(lambda host: {111: os.getpid()} if host is host1 else holder)
    )
    crossings = Crossings(hosts=[host1, host2])  # type: ignore[list-item]
    try:
        crossings.sample()
        assert crossings.lines() == ["host1 pytest controller -> host2 ?: 1 connection"]
    finally:
        ended.wait()
    holder[222] = daemon
    crossings.sample()
    assert crossings.lines() == ["host1 pytest controller -> host2 hosts daemon (ssh): 1 connection"]
