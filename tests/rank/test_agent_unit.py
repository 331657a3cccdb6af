"""The rank agent's handling of its children, without a controller or a pytest session of its own."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sprite.plumbing.protocol import CHILD_DONE, recv_frame, send_frame
from pytest_sprite.rank.agent import Agent, _Child, _Spare

pytestmark = pytest.mark.cpu


@pytest.fixture
def agent(tmp_path: Path, pytestconfig: pytest.Config) -> Iterator[tuple[Agent, socket.socket]]:
    """An agent talking to a socket this test reads, holding a spare that is never used."""
    controller, agent_end = socket.socketpair()
    agent = Agent(config=pytestconfig, items={}, rank=3, sock=agent_end)
    spare_control, spare_end = socket.socketpair()
    rfd, wfd = os.pipe()
    os.close(wfd)
    agent.spare = _Spare(pid=os.getpid(), control=spare_control, rfd=rfd, run_dir=tmp_path / "spare")
    yield agent, controller
    spare_end.close()
    controller.close()
    agent_end.close()


def _child_that_said_done_and_exited(tmp_path: Path) -> _Child:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        send_frame(wfd, CHILD_DONE, {"run_id": 7, "rank": 3})
        os._exit(0)
    os.close(wfd)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped, its frame unread
    run_dir = tmp_path / "child"
    run_dir.mkdir()
    return _Child(run_id=7, pid=pid, rfd=rfd, run_dir=run_dir)


def test_a_child_reaped_before_its_done_frame_is_read_is_reported_once(
    agent: tuple[Agent, socket.socket], tmp_path: Path
) -> None:
    """The child wrote its last frame and exited between the agent's select and its waitpid.

    Reaping it relays the done frame, which reports the child; the agent must not then report it a
    second time from its exit status (it used to fail an assertion here and lose the whole agent).
    """
    served, controller = agent
    served.child = _child_that_said_done_and_exited(tmp_path)
    served._reap(block=True)
    assert served.child is None
    frame = recv_frame(controller)
    assert frame is not None
    event, payload = frame
    assert (event, payload["run_id"], payload["rank"], payload["exitcode"]) == ("child_exited", 7, 3, 0)
    controller.setblocking(False)
    with pytest.raises(BlockingIOError):
        controller.recv(1)  # one report, not two
    assert not served.exiting  # it was reaped, so nothing is left to reap later


def test_the_child_session_is_registered_once_and_idle_until_bound(pytestconfig: pytest.Config) -> None:
    """An agent registers the hooks every child binds (issue 23); unbound, they do nothing in the agent."""
    from pytest_sprite.rank.child import CHILD_SESSION, ChildSession, register_child_session

    manager = pytestconfig.pluginmanager
    assert manager.get_plugin(CHILD_SESSION) is None
    try:
        register_child_session(pytestconfig)
        session = manager.get_plugin(CHILD_SESSION)
        register_child_session(pytestconfig)
        assert manager.get_plugin(CHILD_SESSION) is session
        assert isinstance(session, ChildSession) and not session.bound
        session.pytest_runtest_setup(item=None)  # type: ignore[arg-type]  # never reaches the item
        session.pytest_warning_recorded(warning_message=None, when="runtest", nodeid="", location=None)
        assert session.store is None
    finally:
        plugin = manager.get_plugin(CHILD_SESSION)
        if plugin is not None:
            manager.unregister(plugin)
