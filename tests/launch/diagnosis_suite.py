"""The ranks file of the diagnosis checks, shared by tests/launch/test_diagnosis.py and bench/diagnosis.py.

A hang with one odd rank, a rank that returns without the collective, and tests that pass, fail and crash;
none of them starts a process. ``HANG_TIMEOUT`` is replaced by the hang's timeout in seconds.
"""

SUITE = """
import os, signal, time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.ranks("world", timeout=HANG_TIMEOUT)
def test_hang(world):
    if world.rank != 1:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)

@pytest.mark.ranks("world")
def test_leaver(world):
    if world.rank == 1:
        return
    dist.all_reduce(torch.ones(1))

@pytest.mark.ranks("world")
def test_passes(world):
    dist.all_reduce(torch.ones(1))

@pytest.mark.ranks("world")
def test_fails(world):
    assert world.rank != 2, "rank 2 disagrees"

@pytest.mark.ranks("world")
def test_crashes(world):
    if world.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
"""
