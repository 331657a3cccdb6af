"""Processes a test child leaves running: found by session id, ended, named (issue 9). No pytest session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sprite.rank import leftovers
from pytest_sprite.rank.leftovers import (
    Leftover,
    describe_leftovers,
    end_session_leftovers,
    session_processes,
)

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)"),
]

# The leader starts three processes and prints their pids: `sleep 600`; a Python process that ignores
# SIGTERM in a process group of its own (still in the session); one that calls setsid (escapes).
LEADER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
    sleeper = subprocess.Popen(["sleep", "600"])
    stubborn = subprocess.Popen([sys.executable, "-c", ignore], process_group=0, stdout=subprocess.PIPE)
    stubborn.stdout.readline()  # its SIGTERM handler is installed
    escaped = subprocess.Popen(["sleep", "601"], start_new_session=True)
    print(sleeper.pid, stubborn.pid, escaped.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def leader() -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    try:
        yield proc, pids
    finally:
        for pid in [*pids, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def test_leftovers_in_the_session_are_ended_and_named(
    leader: tuple[subprocess.Popen[str], list[int]],
) -> None:
    proc, (sleeper, stubborn, escaped) = leader
    found = session_processes(proc.pid, exclude={proc.pid})
    assert sorted(found) == sorted([sleeper, stubborn])
    assert found[sleeper] == "sleep 600"

    ended = end_session_leftovers(proc.pid, exclude={proc.pid}, grace=0.5)

    assert [(e.pid, e.ended_by) for e in ended] == sorted([(sleeper, "SIGTERM"), (stubborn, "SIGKILL")])
    assert session_processes(proc.pid, exclude={proc.pid}) == {}
    assert proc.poll() is None, "the session's leader itself is left alone"
    # A process that made a session of its own is not the test child's to end (the documented escape).
    os.kill(escaped, 0)


def test_nothing_left_means_nothing_ended() -> None:
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert end_session_leftovers(proc.pid, exclude={proc.pid}, grace=0.1) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def _fake_proc(root: Path, entries: dict[int, tuple[str, str, int, bytes]]) -> None:
    for pid, (name, state, sid, cmdline) in entries.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} ({name}) {state} 1 {pid} {sid} 0 -1 4194560 0 0")
        (root / str(pid) / "cmdline").write_bytes(cmdline)
    (root / "self").mkdir()


def test_stat_names_with_parentheses_and_zombies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_proc(
        tmp_path,
        {
            10: ("python", "S", 7, b"python\0-c\0print('a b')\0"),
            11: ("odd) (name", "R", 7, b""),
            12: ("sleep", "Z", 7, b""),
            13: ("other", "S", 8, b"other\0"),
            7: ("leader", "S", 7, b"leader\0"),
        },
    )
    monkeypatch.setattr(leftovers, "_PROC", tmp_path)
    monkeypatch.setattr(leftovers, "_session_of", lambda pid: leftovers._read_stat(pid)[2])  # type: ignore[index]
    assert session_processes(7, exclude={7}) == {
        10: "python -c 'print('\"'\"'a b'\"'\"')'",
        11: "[odd) (name]",
    }


def test_a_process_caught_inside_exec_is_named_by_its_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inside execve the kernel gives the process its new name before its arguments: the first read of
    # cmdline is empty. The command is read again, as it is once exec has finished (here: at the pause).
    _fake_proc(tmp_path, {10: ("sleep", "R", 7, b"")})
    monkeypatch.setattr(leftovers, "_PROC", tmp_path)
    monkeypatch.setattr(leftovers, "_session_of", lambda pid: leftovers._read_stat(pid)[2])  # type: ignore[index]
    monkeypatch.setattr(
        leftovers, "sleep", lambda _: (tmp_path / "10" / "cmdline").write_bytes(b"sleep\x00600\x00")
    )
    assert session_processes(7) == {10: "sleep 600"}


def test_long_commands_are_shortened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_proc(tmp_path, {10: ("sh", "S", 7, b"sh\0-c\0" + b"x" * 500 + b"\0")})
    monkeypatch.setattr(leftovers, "_PROC", tmp_path)
    monkeypatch.setattr(leftovers, "_session_of", lambda pid: leftovers._read_stat(pid)[2])  # type: ignore[index]
    (command,) = session_processes(7).values()
    assert len(command) == 200 and command.startswith("sh -c xxx") and command.endswith("...")


def test_warning_text_names_rank_pid_command_and_how() -> None:
    text = describe_leftovers(
        1,
        [
            Leftover(pid=4242, command="sleep 600", ended_by="SIGTERM"),
            Leftover(pid=4243, command="python -c 'import time'", ended_by="SIGKILL"),
        ],
    )
    assert text == (
        "rank 1 left 2 processes running after the test; pytest-sprite ended them (stop what a test starts, "
        "e.g. proc.terminate(); proc.wait() in a finally or a fixture's teardown):\n"
        "  pid 4242: sleep 600 (ended by SIGTERM)\n"
        "  pid 4243: python -c 'import time' (ended by SIGKILL)"
    )
    assert describe_leftovers(0, [Leftover(pid=1, command="x", ended_by="SIGTERM")]).startswith(
        "rank 0 left 1 process running after the test; pytest-sprite ended it ("
    )


# A subreaper that starts nothing, then a process, then a daemon that double-forks (orphaned, so it
# becomes the subreaper's child): started_nothing() must say so each time (issue 23).
SUBREAPER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pytest_sprite.rank.leftovers import lead_own_session, started_nothing

    lead_own_session()
    seen = [started_nothing()]
    proc = subprocess.Popen(["sleep", "600"])
    seen.append(started_nothing())
    proc.kill()
    proc.wait()
    seen.append(started_nothing())
    if os.fork() == 0:  # the middle process exits at once; its child is orphaned
        if os.fork() == 0:
            os.close(1), os.close(2)  # holds no pipe the test reads to its end
            time.sleep(600)
        os._exit(0)
    os.wait()
    time.sleep(0.2)
    seen.append(started_nothing())
    print(seen, flush=True)
    """
)


def test_a_subreaper_knows_when_it_started_nothing() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SUBREAPER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "[True, False, True, False]"
    finally:  # the orphan sleeps on in the subreaper's session: found and ended as a leftover
        ended = end_session_leftovers(proc.pid, grace=0.5)
    assert len(ended) == 1  # the orphan, which the subreaper saw as its child
