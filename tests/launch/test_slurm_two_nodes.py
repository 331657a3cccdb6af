"""``--launcher=srun`` across two Slurm nodes: a slurmd on each simulated host (``python -m pytest_sprite hosts``).

The controller's slurmctld and the session run on host1, a slurmd and a munged on each host (its own network,
hostname, ``/tmp`` and process table; the run's shared directory holds the configuration and the basetemp).
``salloc -N2 --ntasks-per-node=2 pytest --launcher=srun --ranks=4`` puts two ranks on each node: each rank's
node, hostname and Slurm variables are the node's, and a test's ranks share ``tmp_path`` on the shared
directory; a basetemp in a host's own ``/tmp`` is a clear error on the other host's ranks.

``salloc -N2 -n4`` is another allocation: on shared nodes (``select/cons_tres``) Slurm gives it 3 tasks on
host1 and 1 on host2 (``SLURM_TASKS_PER_NODE=3,1``), and srun lays any step out within those, whatever
``--ntasks-per-node`` it is given. The ranks then follow the allocation, each placed by its real node, and a
``--ppn=2`` that allocation cannot hold is a launch error naming the allocation to ask for.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, require, slurm_missing
from sprite_testing import clear_rank_variables

from pytest_sprite.hosts import Machine, cannot_make_hosts
from pytest_sprite.launch.launchers.srun import allocation_tasks

pytestmark = pytest.mark.cpu

TIMEOUT = 420
MUNGE_SOCKET = "/tmp/sprite-munge.socket"
"""In each host's own /tmp: every host has its own munged, all with the run's key."""


@dataclass
class TwoNodes:
    machine: Machine
    cluster: SlurmCluster

    def on_host1(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """``argv`` on host1 with this test's environment (its rank variables cleared) and this Slurm."""
        host1 = self.machine.hosts[0]
        env = {**os.environ, "SLURM_CONF": str(self.cluster.conf)}
        for name in [n for n in env if n.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
            if name != "SLURM_CONF":
                del env[name]
        return subprocess.run(
            [*self.machine.enter(host1, cwd=cwd), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    """Two Slurm nodes on two simulated hosts for the module's sessions (a few seconds to start)."""
    require(slurm_missing() or cannot_make_hosts())
    with Machine(n=2) as machine:
        home = machine.shared / "slurm"
        home.mkdir()
        for sub in ("state", "spool"):
            (home / sub).mkdir()
        key = home / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        host1, host2 = machine.hosts
        cluster = SlurmCluster(home, node=host1.name)
        node_line = f"NodeName={host1.name} NodeAddr=127.0.0.1"
        text = (
            cluster.config_text()
            .replace(f"({'127.0.0.1'})", f"({host1.address})")
            .replace(f"AuthInfo=socket={cluster.munge_socket}", f"AuthInfo=socket={MUNGE_SOCKET}")
            .replace(node_line, f"NodeName={host1.name} NodeAddr={host1.address}")
        )
        second = text.split(f"NodeName={host1.name} ", 1)[1].split("\n", 1)[0]
        second = second.replace(f"NodeAddr={host1.address}", f"NodeAddr={host2.address}")
        text = text.replace("PartitionName", f"NodeName={host2.name} {second}\nPartitionName")
        cluster.conf.write_text(text)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for host in machine.hosts:
                log = open(home / f"munged-{host.name}.out", "wb")
                procs.append(
                    machine.run(
                        host,
                        [
                            "/usr/sbin/munged",
                            "--foreground",
                            "--force",
                            f"--socket={MUNGE_SOCKET}",
                            f"--key-file={key}",
                            "--pid-file=/tmp/munged.pid",
                            "--log-file=/tmp/munged.log",
                            "--seed-file=/tmp/munged.seed",
                        ],
                        env=cluster.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            nodes = TwoNodes(machine, cluster)
            cluster.wait_until(
                lambda: nodes.on_host1(["test", "-S", MUNGE_SOCKET], home, 30).returncode == 0,
                "munged on host1",
            )
            log = open(home / "slurmctld.out", "wb")
            procs.append(
                machine.run(
                    host1,
                    ["/usr/sbin/slurmctld", "-D", "-i", "-f", str(cluster.conf)],
                    env=cluster.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            for host in machine.hosts:
                log = open(home / f"slurmd-{host.name}.out", "wb")
                procs.append(
                    machine.run(
                        host,
                        ["/usr/sbin/slurmd", "-D", "-f", str(cluster.conf), "-N", host.name],
                        env=cluster.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )

            def both_idle() -> bool:
                out = nodes.on_host1(["sinfo", "-h", "-N", "-o", "%N %t"], home, 30).stdout
                return out.count(" idle") == 2

            cluster.wait_until(both_idle, "both nodes idle in sinfo")
            yield nodes
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in reversed(procs):
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


LAYOUT = """
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist


def launch_variables():
    # The test child drops the launch's own rank variables (they describe the launch, not the test's
    # world); /proc keeps the environment srun started the rank's agent with, which the child forked from.
    with open("/proc/self/environ", "rb") as f:
        words = f.read().decode().split("\\0")
    return dict(word.split("=", 1) for word in words if "=" in word)


@pytest.mark.ranks(4)
def test_layout(world, tmp_path):
    host = socket.gethostname()
    env = os.environ
    assert env["SLURMD_NODENAME"] == host
    assert (env["SLURM_JOB_NUM_NODES"], env["SLURM_JOB_NODELIST"]) == ("2", "host[1-2]")
    assert not {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS"} & set(env)
    assert (env["LOCAL_RANK"], env["NODE_RANK"]) == (str(world.local_rank), str(world.node))
    launch = launch_variables()
    row = {"host": host, "node": world.node, "local_rank": world.local_rank, "local_size": world.local_size}
    row.update({name: launch[name] for name in ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURMD_NODENAME")})
    (tmp_path / f"rank{world.rank}.json").write_text(json.dumps(row))
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # every rank has written its file into the shared tmp_path
    assert t.item() == 4.0
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.iterdir())]
    assert len(rows) == 4, rows
    # the world's layout is the hosts': same host, same node index; local sizes count the host's ranks
    mine = [r for r in rows if r["host"] == host]
    assert {r["node"] for r in mine} == {world.node}, rows
    assert world.local_size == len(mine), rows
    assert sorted(r["local_rank"] for r in mine) == list(range(len(mine))), rows
"""

NODE_IDS = {"host1": "0", "host2": "1"}
"""Slurm numbers a job's nodes in its node list's order: host[1-2]."""


def session(
    nodes: TwoNodes, cwd: Path, allocation: list[str], *args: str
) -> subprocess.CompletedProcess[str]:
    """``salloc <allocation> pytest --launcher=srun --ranks=4 <args>`` on host1; the allocation's tasks per
    node (as the salloc shell sees them) are kept in ``cwd/allocation.txt``."""
    keep = 'echo "$SLURM_TASKS_PER_NODE" > allocation.txt; exec "$@"'
    return nodes.on_host1(
        [
            "salloc",
            *allocation,
            "--time=5",
            "bash",
            "-c",
            keep,
            "bash",
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
            "-v",
            "--launcher=srun",
            "--ranks=4",
            # a bound on agents starting on 2 loaded cores (60 s was too short at load 20), not a check
            "--connect-timeout=240",
            *args,
        ],
        cwd,
        TIMEOUT,
    )


def workdir(nodes: TwoNodes, name: str) -> Path:
    """A fresh folder on the hosts' shared directory holding the layout test."""
    work = nodes.machine.shared / name
    work.mkdir()
    (work / "test_layout.py").write_text(LAYOUT)
    return work


def layout_rows(basetemp: Path) -> list[dict[str, object]]:
    """What each rank of the passed layout test wrote: its host, place in the world, and launch variables."""
    return [json.loads(p.read_text()) for p in sorted((basetemp / "test_layout0").iterdir())]


def check_slurm_placed(rows: list[dict[str, object]], per_host: dict[str, int]) -> None:
    """Each rank sits where Slurm put it: ``per_host`` ranks on each host, each with its node's Slurm
    variables, local ids 0.. on each node, and block distribution's rank order (host1's ranks first)."""
    hosts = [str(row["host"]) for row in rows]
    assert {host: hosts.count(host) for host in NODE_IDS} == per_host, rows
    for row in rows:
        assert (row["SLURMD_NODENAME"], row["SLURM_NODEID"]) == (row["host"], NODE_IDS[str(row["host"])]), (
            rows
        )
    for host, count in per_host.items():
        mine = [row for row in rows if row["host"] == host]
        assert sorted(int(str(row["SLURM_LOCALID"])) for row in mine) == list(range(count)), rows
        first = 0 if host == "host1" else per_host["host1"]
        assert sorted(int(str(row["SLURM_PROCID"])) for row in mine) == list(range(first, first + count)), (
            rows
        )


def test_two_ranks_on_each_of_two_slurm_nodes(two_nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_rank_variables(monkeypatch)
    work = workdir(two_nodes, "even")
    done = session(two_nodes, work, ["-N2", "--ntasks-per-node=2"], f"--basetemp={work / 'tmp'}")
    assert "test_layout.py::test_layout PASSED" in done.stdout, done.stdout + done.stderr
    assert (work / "allocation.txt").read_text().strip() == "2(x2)"
    check_slurm_placed(layout_rows(work / "tmp"), {"host1": 2, "host2": 2})


@pytest.mark.slow  # 10 s more: CI runs the 2 + 2 session; this one differs in the allocation only
def test_ranks_follow_an_uneven_allocation(two_nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_rank_variables(monkeypatch)
    work = workdir(two_nodes, "uneven")
    done = session(two_nodes, work, ["-N2", "-n4"], f"--basetemp={work / 'tmp'}")
    assert "test_layout.py::test_layout PASSED" in done.stdout, done.stdout + done.stderr
    # 3,1 here (select/cons_tres fills host1 first); whatever Slurm allocates, the ranks sit as it says
    tasks = allocation_tasks({"SLURM_TASKS_PER_NODE": (work / "allocation.txt").read_text()})
    assert tasks is not None and len(tasks) == 2 and sum(tasks) == 4, tasks
    check_slurm_placed(layout_rows(work / "tmp"), dict(zip(NODE_IDS, tasks, strict=True)))


@pytest.mark.slow  # 5 s more; CI checks the refusal on the command line (test_launchers_commands.py)
def test_a_ppn_the_allocation_cannot_hold_is_a_clear_error(
    two_nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    work = workdir(two_nodes, "uneven-ppn")
    done = session(two_nodes, work, ["-N2", "-n4"], f"--basetemp={work / 'tmp'}", "--ppn=2")
    allocation = (work / "allocation.txt").read_text().strip()
    assert allocation == "3,1", f"this test needs Slurm's 3+1 allocation of salloc -N2 -n4, got {allocation}"
    # refused before anything starts: the session stops, the test errors with the reason
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
    pytest.LineMatcher(done.stdout.splitlines()).fnmatch_lines(
        [
            "*--launcher=srun: --ppn=2 asks for 4 ranks at 2 a node on 2 nodes, but this allocation has 3+1 "
            "tasks on its nodes (SLURM_TASKS_PER_NODE=3,1), and srun lays a step out within them, not at 2 a "
            "node. Allocate 2 tasks a node (salloc -N2 --ntasks-per-node=2, or #SBATCH --ntasks-per-node=2), "
            "or drop --ppn to follow the allocation's layout.*"
        ]
    )


@pytest.mark.slow  # 10 s more; CI checks the same refusal on two hosts under mpiexec (tests/hosts)
def test_a_basetemp_only_host1_sees_is_a_clear_error(
    two_nodes: TwoNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    work = workdir(two_nodes, "not-shared")
    done = session(two_nodes, work, ["-N2", "--ntasks-per-node=2"], "--basetemp=/tmp/sprite-not-shared")
    assert "test_layout.py::test_layout FAILED" in done.stdout or "ERROR" in done.stdout, done.stdout
    assert "does not exist on this rank's host (host2)" in done.stdout, done.stdout
    assert "pass --basetemp=DIR with DIR on it" in done.stdout, done.stdout
