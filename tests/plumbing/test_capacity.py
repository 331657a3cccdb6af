"""A local world beyond the machine is refused with the figures: each limit names itself and its numbers."""

from __future__ import annotations

import pytest

from pytest_sprite.plumbing.capacity import Capacity, local_world_shortfall, measure

pytestmark = pytest.mark.cpu

ROOMY = Capacity(
    processes=30000, processes_from="kernel.pid_max 32768 less 2768 tasks running", descriptors=20000,
    memory=64 << 30, per_process=40 << 20,
)  # fmt: skip


def test_a_world_that_fits_is_not_refused() -> None:
    assert local_world_shortfall(96, ROOMY) is None


def test_processes_name_their_limit() -> None:
    why = local_world_shortfall(20000, ROOMY)
    assert why == (
        "a local world of 20000 ranks needs about 60000 processes (3 a rank: agent, test child, spare) and this "
        "machine has 30000 left (kernel.pid_max 32768 less 2768 tasks running)"
    )


def test_descriptors_name_their_limit() -> None:
    cap = Capacity(processes=None, processes_from="", descriptors=100, memory=None, per_process=None)
    why = local_world_shortfall(64, cap)
    assert (
        why is not None
        and "needs about 128 file descriptors" in why
        and "it has 100 left (RLIMIT_NOFILE" in why
    )


def test_memory_is_measured_on_a_fork() -> None:
    why = local_world_shortfall(1000, ROOMY)
    assert why == (
        "a local world of 1000 ranks needs about 78.1 GiB of memory before any test computes (2 processes a rank "
        "at 40 MiB each, measured on a fork of this process) and 64.0 GiB is available (MemAvailable)"
    )


def test_this_machine_is_measured() -> None:
    cap = measure(probe=True)
    assert cap.per_process is not None and cap.per_process > 0
    assert cap.memory is not None and cap.memory > 0
    assert cap.descriptors is None or cap.descriptors > 0
