"""The launcher scenarios every real engine runs (``tests/launch/test_slurm_real.py``, ``test_openmpi.py``).

A passing test on the session's whole world (``--ranks``) with its layout on one node, a rank killed by SIGKILL (named with its signal), a hung rank
(named with its stack), and a passing test after each, so the next launch after a lost step works.
"""

from __future__ import annotations

import re

SCENARIOS = """
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks("world")
def test_passes(world):
    n = world.size
    t = torch.tensor([world.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == n * (n + 1) / 2
    assert (world.local_rank, world.local_size, world.node) == (world.rank, n, 0)
    # under Slurm the test runs in the job the session was started in (where the session knows it)
    if "SPRITE_EXPECTED_JOB" in os.environ:
        assert os.environ["SLURM_JOB_ID"] == os.environ["SPRITE_EXPECTED_JOB"]
    # the launch's own variables stay out of the test child
    assert not {"SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"} & set(os.environ)


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


def verdicts(output: str) -> dict[str, str]:
    """Each scenario's outcome in a ``-v`` session's output (``test_passes[ranks4]`` as ``test_passes``)."""
    return dict(re.findall(r"^test_scenarios\.py::(\w+)(?:\[\w+\])? (PASSED|FAILED|ERROR)", output, re.M))
