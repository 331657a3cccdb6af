"""Collective names from stack records and torch's mismatch error, without processes."""

from __future__ import annotations

import pytest

from pytest_sprite.plumbing.collectives import mismatch_summary, waiting_collective
from pytest_sprite.plumbing.stacks import parse_stacks

pytestmark = pytest.mark.cpu

SITE = "/usr/lib/python3.11/site-packages/torch/distributed"
HANGING = f"""\
Thread 0x00007f8700001000 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f871142eb80 (most recent call first):
  File "{SITE}/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/c10d_logger.py", line 83 in wrapper
  File "/home/me/tests/test_sync.py", line 12 in test_sync
"""

# torch 2.13's message under TORCH_DISTRIBUTED_DEBUG=DETAIL (the device options shortened).
MISMATCH = (
    "Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
    "SequenceNumber=301, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float, TensorDeviceTypes="
    "TensorOptions(dtype=float (default), device=cpu)), but Rank 1 is running collective: CollectiveFingerPrint("
    "SequenceNumber=301, OpType=ALLREDUCE, TensorShape=[2, 3], TensorDtypes=Float, TensorDeviceTypes="
    "TensorOptions(dtype=float (default), device=cpu)). Collectives differ in the following aspects: "
    "Tensor Tensor shapes: 1vs 2 3"
)


def test_the_collective_a_rank_waits_in_and_its_caller() -> None:
    assert waiting_collective(parse_stacks(HANGING)) == "all_reduce (called at test_sync.py:12)"


def test_a_rank_outside_torch_distributed_waits_in_nothing() -> None:
    assert (
        waiting_collective(
            parse_stacks(
                'Current thread 0x1 (most recent call first):\n  File "/t/test_x.py", line 9 in run\n'
            )
        )
        is None
    )


def test_a_barrier_through_the_world_names_the_barrier() -> None:
    stacks = (
        "Current thread 0x1 (most recent call first):\n"
        f'  File "{SITE}/distributed_c10d.py", line 4800 in barrier\n'
        f'  File "{SITE}/c10d_logger.py", line 83 in wrapper\n'
        '  File "/src/pytest_sprite/world.py", line 70 in barrier\n'
    )
    assert waiting_collective(parse_stacks(stacks)) == "barrier (called at world.py:70)"


def test_mismatch_in_one_line_per_rank() -> None:
    assert (
        mismatch_summary(MISMATCH)
        == "rank 0: ALLREDUCE #301 shape [1] Float\nrank 1: ALLREDUCE #301 shape [2, 3] Float"
    )


def test_other_errors_have_no_mismatch_summary() -> None:
    assert mismatch_summary("Connection reset by peer") is None
