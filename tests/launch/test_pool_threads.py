"""The pool's threads never end silently: the controller hears how each ended (no wait until a timeout)."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sprite_testing import local_settings

from pytest_sprite.launch.pool import AgentPool, Event, _Agent
from pytest_sprite.plumbing.protocol import send_frame

pytestmark = pytest.mark.cpu


@pytest.fixture
def pool(pytestconfig: pytest.Config) -> Iterator[AgentPool]:
    made = AgentPool(pytestconfig, local_settings(world_size=1), 1, {})
    yield made
    made.close()


def _read_until_lost(pool: AgentPool, sock: socket.socket) -> list[Event]:
    """Run the pool's reader thread on ``sock`` until it ends; the events it posted."""
    agent = _Agent(rank=0, sock=sock, host="localhost", local_rank=0, node=("localhost", None), pid=0)
    reader = threading.Thread(target=pool._read_agent, args=(agent,), daemon=True)
    reader.start()
    reader.join(timeout=10.0)
    assert not reader.is_alive(), "the reader thread did not end"
    events = []
    while True:
        try:
            events.append(pool.events.get_nowait())
        except queue.Empty:
            return events


def test_a_reader_whose_agent_closed_its_connection_posts_agent_lost_saying_so(pool: AgentPool) -> None:
    ours, theirs = socket.socketpair()
    send_frame(theirs, "progress", {"run_id": 1, "rank": 0, "message": "half way"})
    theirs.close()
    events = _read_until_lost(pool, ours)
    assert events == [
        (0, "progress", {"run_id": 1, "rank": 0, "message": "half way"}),
        (0, "agent_lost", {"detail": "closed"}),
    ]


def test_a_reader_that_cannot_read_a_frame_posts_agent_lost_with_why(pool: AgentPool) -> None:
    ours, theirs = socket.socketpair()
    body = b"\xff\xfe not a frame"
    theirs.sendall(struct.pack("!I", len(body)) + body)  # the protocol's header: the body's length
    events = _read_until_lost(pool, ours)
    theirs.close()
    assert len(events) == 1
    rank, event, payload = events[0]
    assert (rank, event) == (0, "agent_lost")
    assert payload["detail"].startswith("sent a frame that could not be read (")


def test_an_accepting_thread_that_fails_posts_launch_failed(
    pool: AgentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("a bug in the accepting loop")

    monkeypatch.setattr(pool, "_accept_until_complete", broken)
    pool._accept_all()
    assert pool.events.get_nowait() == (
        -1,
        "launch_failed",
        {"detail": "the controller's accepting thread failed: RuntimeError: a bug in the accepting loop"},
    )


def test_an_accepting_thread_whose_listener_fails_while_open_posts_launch_failed(
    pool: AgentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_files() -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(pool, "_accept_until_complete", out_of_files)
    pool._accept_all()
    rank, event, payload = pool.events.get_nowait()
    assert (rank, event) == (-1, "launch_failed")
    assert "Too many open files" in payload["detail"]
    pool._closing = True  # closing: the listener's end is expected, nothing is posted
    pool._accept_all()
    assert pool.events.empty()


def test_an_agent_that_died_with_a_command_unread_closed_its_connection(pool: AgentPool) -> None:
    """The kernel resets the connection of a process that exits with unread data: the same loss as a close."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    client.sendall(b"a command the agent never read")
    server.close()  # closing with unread data sends a reset
    events = _read_until_lost(pool, client)
    assert events == [(0, "agent_lost", {"detail": "closed"})]


def test_a_connection_reset_before_it_is_accepted_does_not_end_the_accepting(
    pool: AgentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accept() fails with ECONNABORTED for a client that reset its connection while it waited: not a failure
    of the launch, and the thread goes on accepting the agents."""
    calls: list[str] = []

    class Listener:
        def settimeout(self, _: float) -> None:
            pass

        def accept(self) -> tuple[socket.socket, Any]:
            calls.append("accept")
            if len(calls) == 1:
                raise ConnectionAbortedError(103, "Software caused connection abort")
            pool._closing = True  # the second call: the pool closes, the loop ends
            raise TimeoutError

    class Launch:
        def poll(self) -> int | None:
            return None

    monkeypatch.setattr(pool, "_listener", Listener())
    monkeypatch.setattr(pool, "handle", Launch())
    monkeypatch.setattr(pool, "launched_at", time.monotonic())  # within --connect-timeout
    pool._accept_all()
    assert calls == ["accept", "accept"]
    assert pool.events.empty()
