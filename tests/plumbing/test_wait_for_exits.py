"""Waiting for children to end without reaping them: woken by the exit, or polled where pidfds are missing."""

from __future__ import annotations

import os
import time

import pytest

from pytest_sprite.plumbing.process import wait_for_exits

pytestmark = pytest.mark.cpu


def _child(seconds: float) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(7)
    return pid


@pytest.fixture(params=["pidfd", "polled"])
def how(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "polled":

        def no_pidfds(pid: int, flags: int = 0) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfds, raising=False)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open here")
    return str(request.param)


def test_returns_when_every_child_has_ended_and_leaves_them_to_reap(how: str) -> None:
    quick, slow = _child(0.05), _child(0.4)
    start = time.monotonic()
    assert wait_for_exits([quick, slow], timeout=30)
    assert 0.35 < time.monotonic() - start < 20
    for pid in (quick, slow):  # not reaped: the caller's waitpid still gets each status
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7


def test_gives_up_at_the_timeout_with_a_child_still_running(how: str) -> None:
    pid = _child(5.0)
    try:
        start = time.monotonic()
        assert not wait_for_exits([pid], timeout=0.2)
        assert time.monotonic() - start < 3
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_child_already_reaped_counts_as_ended(how: str) -> None:
    pid = _child(0.0)
    os.waitpid(pid, 0)
    assert wait_for_exits([pid], timeout=0.1)


def test_a_child_whose_pidfd_numbers_beyond_1024(how: str) -> None:
    """select() refuses descriptors from 1024 on; a controller with many agents and sockets can reach them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"at most {hard} descriptors here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        pid = _child(0.05)
        assert wait_for_exits([pid], timeout=30)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
