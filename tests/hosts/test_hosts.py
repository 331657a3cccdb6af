"""Two hosts on this machine (issue 25): real pytest sessions through ``python -m pytest_sprite hosts 2``.

Each session is the command a user runs: the controller on host1, ``--ranks=4`` as two ranks on each host
through MPICH's ``mpiexec``, every address a bridge address (nothing reaches another host over loopback),
``/tmp`` and the process table each host's own, the basetemp in the run's shared directory. The inner test
files live in pytester's directory, which the hosts see as the machine's shared file system (it is the
command's working directory). Skipped, with the reason, where this machine cannot make hosts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sprite_testing import fnescape

from pytest_sprite.hosts import cannot_make_hosts
from pytest_sprite.hosts.machine import ROOT

_WHY_NOT = cannot_make_hosts()

pytestmark = pytest.mark.cpu
needs_hosts = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no hosts here: {_WHY_NOT}")

TIMEOUT = 240
SLOW = 4
"""Seconds host2 waits before it starts its ranks (a node slow to start) in the session test."""


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")


def hosts(pytester: pytest.Pytester, *pytest_args: str, options: tuple[str, ...] = ()) -> pytest.RunResult:
    """``python -m pytest_sprite hosts 2 [options] -- python -m pytest <args>`` in pytester's directory."""
    result = pytester.run(
        sys.executable,
        "-m",
        "pytest_sprite",
        "hosts",
        "2",
        *options,
        "--",
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--ranks=4",
        *pytest_args,
        timeout=TIMEOUT,
    )
    print(result.stdout.str())
    print(result.stderr.str())
    assert _left_by(result.stderr.str()) == set(), "the run left hosts behind"
    return result


def _left_by(output: str) -> set[str]:
    """What the run whose output this is left on the machine: its directory and interfaces (all carry its
    id, so other runs on the machine, yours or a colleague's, do not count)."""
    found = re.search(r"bridge spb([0-9a-f]{6}) ", output)
    assert found, output
    run_id = found.group(1)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    left = {n for n in names if run_id in n}
    return left | {p.name for p in ROOT.glob(f"sprite-hosts-{run_id}")}


WORLD = """
import os
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from pytest_sprite import run_subworld

def two_per_host(names):
    # ranks 0-1 on one host, 2-3 on the other (which host takes rank 0 is the order agents connected in)
    return sorted(names) == ["host1", "host1", "host2", "host2"] and names[0] == names[1]

@pytest.mark.ranks(2)
def test_packed_a(world):
    assert len(set(world.gather_object(socket.gethostname()))) == 1  # within one host: it fits

@pytest.mark.ranks(2)
def test_packed_b(world):
    assert len(set(world.gather_object(socket.gethostname()))) == 1

def where(world):
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    return socket.gethostname(), os.environ["MASTER_ADDR"], t.item()

@pytest.mark.ranks(4)
def test_world_spans_the_hosts(world, tmp_path):
    names = world.gather_object(socket.gethostname())
    assert two_per_host(names), names
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    assert t.item() == 6.0
    assert [g.item() for g in world.gather(torch.tensor([world.rank]))] == [0, 1, 2, 3]
    world.collect("rank_host", torch.tensor([float(names[world.rank][-1] == names[0][-1])]))
    # one tmp_path for every rank, on the shared directory: host2 writes, host1 reads
    (tmp_path / f"from{world.rank}").write_text(socket.gethostname())
    world.barrier()
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == sorted(names)
    # each host names itself 127.0.1.1 (as Debian does): gloo was given the interface that others reach
    assert socket.gethostbyname(socket.gethostname()) == "127.0.1.1"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0"

@pytest.mark.ranks(4)
def test_sub_world_across_hosts(world):
    values = run_subworld(where).values()
    assert two_per_host([v[0] for v in values]), values
    assert {v[2] for v in values} == {6.0}
    half = run_subworld(where, ranks=2).values()
    assert [v[2] for v in half] == [1.0, 1.0]


@pytest.mark.ranks(4)
@settings(max_examples=3, deadline=None, database=None)
@given(st.integers(0, 9))
def test_hypothesis_on_ranks(world, x):
    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    assert t.item() == 4 * x

@pytest.mark.ranks(4)
def test_leaves_a_process_on_each_host(world):
    proc = subprocess.Popen(["sleep", "600"])
    print(f"LEFT rank {world.rank} pid {proc.pid} on {socket.gethostname()}")
"""

CHAOS = """
import socket
from functools import partial
from pathlib import Path

import pytest
from pytest_sprite import assert_crash_consistent, crash_fn
from pytest_sprite.save_crashes.protocols import train_rank0_rename

def on_host2(names, event):
    # a rank of host2 writing its part of a save (which rank makes the .tmp folder is a race: left out)
    return names[event.rank] == "host2" and event.kind != "mkdir"

@pytest.mark.ranks(4)
def test_crash_matrix_across_hosts(world):
    names = world.gather_object(socket.gethostname())
    out = Path(__file__).parent / "chaos"  # the matrix's folder, which both hosts see
    select = partial(on_host2, names)
    m = assert_crash_consistent(crash_fn(train_rank0_rename), out_dir=out, select=select, tear="none")
    assert m.ranks == 4 and m.passed
    assert world.gather_object(m.summary()) == [m.summary()] * 4  # every rank judged the same matrix
"""

COLLECTED = """
import pytest
from pytest_sprite import collected

@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    result = yield
    for name, tensors in collected(item).items():
        print(f"COLLECTED {item.name} {name} {[t.tolist() for t in tensors]}")
    return result
"""


@needs_hosts
def test_a_ranks_session_across_two_hosts(pytester: pytest.Pytester) -> None:
    """Everything a ranks session does, with the controller on host1 and the ranks on host1 and host2, a
    crash matrix among it."""
    pytester.makeconftest(COLLECTED)
    pytester.makepyfile(test_world=WORLD, test_chaos=CHAOS)
    result = hosts(
        pytester,
        "--collective-check",
        "--sprite-report=report.json",
        "-s",
        options=("--delay", f"host2={SLOW}", "--host-env", "host2:RANK=0"),
    )
    assert result.ret == 0
    result.assert_outcomes(passed=7)
    err = result.stderr.str()
    assert "launcher: MPICH mpiexec" in err
    assert "2 ranks per host; controller on host1" in err
    result.stdout.fnmatch_lines(
        ["*" + fnescape("COLLECTED test_world_spans_the_hosts rank_host [[1.0], [1.0], [0.0], [0.0]]") + "*"]
    )
    for rank in (0, 1, 2, 3):
        result.stdout.fnmatch_lines([f"*rank {rank} left 1 process running after the test*", "*sleep 600*"])
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["environment"]["hosts"] == ["host1", "host2"]
    assert report["environment"]["launcher"] == "mpiexec"
    # what crossed hosts, as the run lists it: the agents' connections to the controller, the launch, the
    # rendezvous and gloo pairs of tests and sub-worlds
    err_lines = err.splitlines()
    crossed = err_lines[err_lines.index(next(x for x in err_lines if "what crossed hosts" in x)) + 1 :]
    assert any("host2 rank agent -> host1 pytest controller" in x for x in crossed), crossed
    assert any("host1 launcher-exec (ssh) -> host2 hosts daemon (ssh)" in x for x in crossed), crossed
    assert any(re.search(r"host\d test/sub-world rank -> host\d test/sub-world rank", x) for x in crossed), (
        crossed
    )
    tests = {t["nodeid"].rsplit("::", 1)[1]: t for t in report["tests"]}
    spans = tests["test_world_spans_the_hosts"]
    assert sorted(r["host"] for r in spans["ranks"]) == ["host1", "host1", "host2", "host2"]
    # host2 started its ranks SLOW seconds late; the crash matrix (a whole-world test, collected first) waited
    # for it. A 2-rank test then takes the node its agents reached first (of two equally free ones), which holds
    # the whole-world test's rank 0: usually host1, not always (its agents can be the later ones to connect).
    first = spans["ranks"][0]["host"]
    assert [r["host"] for r in tests["test_packed_a"]["ranks"]] == [first, first]
    _check_crash_matrix(pytester, tests["test_crash_matrix_across_hosts"])


def _check_crash_matrix(pytester: pytest.Pytester, test: dict[str, Any]) -> None:
    """The crash matrix of a sound save protocol, crashed on host2's ranks: every row crashed there, and
    every resume, across both hosts from what the crash left in the shared folder, came back as PASS."""
    on_host2 = [rank for rank, r in enumerate(test["ranks"]) if r["host"] == "host2"]
    assert len(on_host2) == 2, test["ranks"]
    rows = json.loads((pytester.path / "chaos" / "matrix.json").read_text())["rows"]
    points = [r for r in rows if r["event"] != "control"]
    # each of host2's ranks writes its optimizer's part of both saves: a crash point each
    assert sorted((r["rank"], r["file"], r["torn"]) for r in points) == sorted(
        (rank, f"ckpt-{step}.tmp/optim-{rank}.pt", False) for rank in on_host2 for step in (2, 4)
    )
    assert {r["verdict"] for r in rows} == {"PASS"}, rows
    # a point is "rank r's n-th event" of the fault-free run; r's first save is always reached
    assert {r["rank"] for r in points if r["crashed"]} == set(on_host2), points


@needs_hosts
def test_what_this_machine_cannot_do_is_said(pytester: pytest.Pytester) -> None:
    """A bad request is refused before anything is made; nothing is left."""
    result = pytester.run(sys.executable, "-m", "pytest_sprite", "hosts", "2", "--", "pytest", "--ranks=3")
    assert result.ret != 0
    assert "--ranks=3 does not spread evenly over 2 hosts" in result.stderr.str()
    assert "hosts on bridge" not in result.stderr.str()  # refused before anything was made


@needs_hosts
def test_leftovers_of_a_killed_run_are_removed(tmp_path: Path) -> None:
    """A run whose process was killed (its directory names a dead owner) is cleaned by the next run."""

    from pytest_sprite.hosts.machine import clean_leftovers

    run_id = "ffff01"
    subprocess.run(["ip", "link", "add", f"spb{run_id}", "type", "bridge"], check=True)
    directory = ROOT / f"sprite-hosts-{run_id}"
    directory.mkdir()
    proc = subprocess.Popen(["true"])
    proc.wait()  # its pid names an owner that has ended
    (directory / "state.json").write_text(
        json.dumps({"owner": proc.pid, "bridge": f"spb{run_id}", "veths": [], "pids": []})
    )
    removed = clean_leftovers()
    assert f"spb{run_id}" in removed and str(directory) in removed
    assert not directory.exists()


@needs_hosts
def test_a_stale_rank_on_one_host_is_there_only(pytester: pytest.Pytester) -> None:
    """``--host-env host2:RANK=0`` is in host2's login environment only (the session test shows the
    plugin copes: its agents there drop it); the launch reaches host2 through the launcher-exec."""
    result = pytester.run(
        sys.executable,
        "-m",
        "pytest_sprite",
        "hosts",
        "2",
        "--host-env",
        "host2:RANK=0",
        "--",
        "mpiexec",
        "-n",
        "2",
        "-ppn",
        "1",
        "sh",
        "-c",
        'echo "on $(hostname) RANK=${RANK-unset}"',
        timeout=TIMEOUT,
    )
    assert result.ret == 0, result.stderr.str()
    assert sorted(line for line in result.stdout.lines if line.startswith("on ")) == [
        "on host1 RANK=unset",
        "on host2 RANK=0",
    ]


LOST = """
import socket
import time

import pytest
import torch
import torch.distributed as dist
from pytest_sprite.hosts import {fault}

@pytest.mark.ranks(4)
def test_host2_goes(world):
    names = world.gather_object(socket.gethostname())
    world.barrier()
    if world.rank == names.index("host1"):
        print({fault}("host2"))
    for _ in range(1200):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.05)

@pytest.mark.ranks(2)
def test_next_one_on_what_is_left(world):
    assert {{socket.gethostname()}} == {{"host1"}}
    world.barrier()
"""


def _host2_ranks(pytester: pytest.Pytester) -> list[int]:
    report = json.loads((pytester.path / "report.json").read_text())
    first = next(t for t in report["tests"] if t["nodeid"].endswith("test_host2_goes"))
    return sorted(i for i, r in enumerate(first["ranks"]) if r["host"] == "host2")


@needs_hosts
def test_a_whole_host_lost_mid_test(pytester: pytest.Pytester) -> None:
    """Every process of host2 killed mid-collective: the test fails at once naming host2 and its ranks;
    the session goes on, its fresh world on host1 (the host left), and nothing is left on either host."""
    pytester.makepyfile(test_lost=LOST.format(fault="kill_host"))
    result = hosts(pytester, "--rank-timeout=60", "--sprite-report=report.json")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("failed"), outcomes.get("passed")) == (1, 1), outcomes
    # MPICH's mpiexec ends its whole launch once host2's daemon is gone, host1's agents too. When that lands
    # while the failed test tears down, host1's ranks are reported lost there as well: one teardown error of
    # the same test, naming host1 (seen at load 30). Otherwise none.
    if outcomes.get("errors", 0):
        assert outcomes["errors"] == 1, outcomes
        result.stdout.fnmatch_lines(
            [
                "*ERROR at teardown of test_host2_goes*",
                "*its rank agent was lost during teardown (the connection to rank agent * closed; it ran on host1)*",
            ]
        )
    lost = _host2_ranks(pytester)
    assert len(lost) == 2
    out = result.stdout.str()
    for rank in lost:
        result.stdout.fnmatch_lines(
            [
                f"*rank {rank}: its rank agent was lost during call (the connection to rank agent * closed; it ran on host2)*"
            ]
        )
    # host1's ranks either saw their peers go right away (gloo: connection reset / closed by peer), or went
    # with their agents when mpiexec ended the whole launch (seen on a quiet machine): a race with MPICH's
    # teardown, not the harness's; each is named either way.
    host1 = sorted(set(range(4)) - set(lost))
    went = [f"rank {r}: its rank agent was lost during" in out for r in host1]
    assert "by peer" in out or all(went), out[-3000:]
    if all(went):
        assert out.count("it ran on host1") >= len(host1)
    assert "after the 60s timeout" not in out  # at once: nobody waited for --rank-timeout
    assert "killed every process of host2; later launches place their ranks on host1" in result.stderr.str()
    assert "(lost during the run: host2)" in result.stderr.str()


@needs_hosts
def test_a_basetemp_host2_cannot_see(pytester: pytest.Pytester) -> None:
    """A basetemp in host1's own /tmp: host2's ranks fail with the existing clear error, naming host2."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(4)
        def test_files(world, tmp_path):
            pass
        """
    )
    result = hosts(pytester, "--basetemp=/tmp/only-on-host1", "--sprite-report=report.json")
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        [
            "*the session's basetemp /tmp/only-on-host1 does not exist on this rank's host (host2): the ranks of a "
            "test share tmp_path, so on a cluster the basetemp must be on a filesystem every node sees*"
        ]
    )
    assert "(host1)" not in result.stdout.str()


@needs_hosts
@pytest.mark.slow
def test_a_link_cut_mid_collective(pytester: pytest.Pytester) -> None:
    """host2's link down mid-collective: host1's ranks hang until --rank-timeout and are shown where they
    waited; host2's agents cannot be reached, so their ranks end as lost, naming host2; the next test runs
    in the session's fresh world, on host1 only (the launch no longer lists the host it cannot reach, so
    its tests never race a launch failing there), and the run removes everything."""
    pytester.makepyfile(test_lost=LOST.format(fault="cut_link"))
    result = hosts(pytester, "--rank-timeout=15", "--sprite-report=report.json")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*were still running after the 15s timeout (from --rank-timeout) (during call)*"]
    )
    for rank in _host2_ranks(pytester):
        result.stdout.fnmatch_lines(
            [
                f"*rank {rank}: its rank agent was lost during call (rank agent * on host2 did not end its child within*"
            ]
        )
    result.stdout.fnmatch_lines(["*  ranks *: lost with its rank agent"])
    assert re.search(
        r"host2's link \S+ is down; later launches place their ranks on host1", result.stderr.str()
    )


@needs_hosts
def test_ctrl_c_removes_everything(pytester: pytest.Pytester) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) mid-test: pytest stops, then the hosts go, all of them."""
    pytester.makepyfile(
        """
        import time
        import pytest

        @pytest.mark.ranks(4)
        def test_long(world):
            open(f"started{world.rank}", "w").close()
            time.sleep(300)
        """
    )
    command = [sys.executable, "-m", "pytest_sprite", "hosts", "2", "--", sys.executable, "-m", "pytest"]
    command += ["-p", "no:cacheprovider", "--ranks=4"]
    proc = subprocess.Popen(
        command, cwd=pytester.path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + TIMEOUT
    while (
        len(list(pytester.path.glob("started*"))) < 4 and time.monotonic() < deadline and proc.poll() is None
    ):
        time.sleep(0.2)
    assert len(list(pytester.path.glob("started*"))) == 4
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    text = out.decode(errors="replace")
    print(text)
    assert proc.returncode == 2, text  # pytest's status for an interrupted session
    assert "KeyboardInterrupt" in text
    assert "removed 2 hosts" in text
    assert _left_by(text) == set()


def test_a_machine_that_cannot_make_hosts_says_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not root, or no ``ip``: the reason, exit status 6, nothing made (the tests above skip with it)."""
    from pytest_sprite.hosts import machine

    monkeypatch.setattr(machine.os, "geteuid", lambda: 1000)
    assert machine.cannot_make_hosts() == (
        "hosts need root (network, UTS, mount and PID namespaces, a bridge); run as root"
    )
    monkeypatch.undo()
    result = pytester.run(
        "env", "PATH=/nonexistent", sys.executable, "-m", "pytest_sprite", "hosts", "2", "--", "pytest"
    )
    assert result.ret == 6
    why = "hosts need `ip` (iproute2), which is not on PATH" if _WHY_NOT is None else _WHY_NOT
    assert result.stderr.lines == [f"pytest-sprite hosts: cannot make hosts on this machine: {why}"]


@needs_hosts
def test_an_mpiexec_that_is_not_mpichs_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another mpiexec first on PATH would ignore the hosts and the launcher-exec, running every rank on one
    host: the machine says it cannot make hosts, naming that mpiexec."""
    from pytest_sprite.hosts import machine

    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.5'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert machine.cannot_make_hosts() == (
        f"hosts launch the ranks with MPICH's mpiexec (hydra), and {fake} is not it (mpiexec (OpenRTE) 4.1.5); "
        "put MPICH's first on PATH (pip install mpich)"
    )
