"""``--launcher=srun`` under a real Slurm (``tests/slurm_cluster.py``): inside ``salloc`` and inside an ``sbatch`` job.

The harness core's launcher scenarios as a user meets them on a cluster: a passing 4-rank test, a rank killed by
SIGKILL (named with its signal), a hung rank (named with its stack), and a test after each that passes, so the
next launch after a lost step works. ``test_launchers.py`` keeps the srun stand-in for what this one-node Slurm
cannot show (two nodes' layout with a recorded command line).
"""

from __future__ import annotations

import re
import sys

import pytest
from slurm_cluster import SlurmCluster
from sprite_testing import clear_rank_variables

pytestmark = pytest.mark.cpu

TIMEOUT = 180

SCENARIOS = """
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks(4)
def test_passes(world):
    t = torch.tensor([world.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 10.0
    assert (world.local_rank, world.local_size, world.node) == (world.rank, 4, 0)
    assert os.environ["SLURM_JOB_ID"] == os.environ["SPRITE_EXPECTED_JOB"]
    assert "SLURM_PROCID" not in os.environ  # the launch's own variables stay out of the test child


@pytest.mark.ranks(2)
def test_crash(world):
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.ranks(2)
def test_after_crash(world):
    dist.barrier()


@pytest.mark.ranks(2, timeout=6)
def test_hang(world):
    if world.rank == 0:
        time.sleep(1000)
    dist.barrier()


@pytest.mark.ranks(2)
def test_after_hang(world):
    dist.barrier()
"""

EXPECTED = {
    "test_passes": "PASSED",
    "test_crash": "FAILED",
    "test_after_crash": "PASSED",
    "test_hang": "FAILED",
    "test_after_hang": "PASSED",
}
EXPECTED_LINES = [
    "*rank 1 CRASHED with signal 9 (SIGKILL) during call*",
    "*still running after the 6s timeout (from @pytest.mark.ranks(timeout=...))*",
    "*--- stacks of rank* (most recent call first) ---*",
    "*rank 0: elsewhere, in time.sleep (test_scenarios.py:*)*",
]

SESSION = (
    "-m",
    "pytest",
    "-p",
    "no:cacheprovider",
    "-v",
    "--launcher=srun",
    "--ranks=4",
    "--rank-grace=2",
    "--connect-timeout=60",
    "--pack=off",
    "test_scenarios.py",
)


def in_slurm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster) -> None:
    """This test's sessions talk to ``slurm`` and start as a process no launcher started."""
    clear_rank_variables(monkeypatch)
    for name, value in slurm.env.items():
        if name.startswith("SLURM_"):
            monkeypatch.setenv(name, value)
    pytester.makepyfile(test_scenarios=SCENARIOS)


def verdicts(output: str) -> dict[str, str]:
    return dict(re.findall(r"^test_scenarios\.py::(\w+) (PASSED|FAILED|ERROR)", output, re.M))


def test_scenarios_inside_salloc(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    script = pytester.path / "session.sh"
    # the job id is known only inside the allocation: the shell hands it to the ranks' check
    script.write_text(f'SPRITE_EXPECTED_JOB=$SLURM_JOB_ID exec {sys.executable} "$@"\n')
    result = pytester.run("salloc", "-n4", "--time=5", "bash", str(script), *SESSION, timeout=TIMEOUT)
    assert verdicts(result.stdout.str()) == EXPECTED, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines_random(EXPECTED_LINES)
    assert slurm.jobs() == []


@pytest.mark.slow  # 30 s; test_sbatch_script.py runs a job of the shipped sbatch script in CI
def test_scenarios_inside_sbatch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    script = pytester.path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=4\n#SBATCH --time=5\n"
        f"SPRITE_EXPECTED_JOB=$SLURM_JOB_ID exec {sys.executable} {' '.join(SESSION)}\n"
    )
    job = slurm.submit(["--output=job.out", str(script)], cwd=pytester.path)
    ended = slurm.wait_job(job, timeout=TIMEOUT)
    output = (pytester.path / "job.out").read_text()
    assert ended["ExitCode"] == "1:0", output  # pytest's "some tests failed", as the job's exit code
    assert verdicts(output) == EXPECTED, output
    pytest.LineMatcher(output.splitlines()).fnmatch_lines_random(EXPECTED_LINES)
    assert slurm.jobs() == []
