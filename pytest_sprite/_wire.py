"""The wire protocol between controller, rank agents and test children: the only place frames are encoded.

A frame is a 4-byte big-endian length followed by a JSON object ``{"event": name, **payload}``.
Children write frames to a pipe; their agent relays them unchanged over its socket, so the
controller sees one ordered stream per rank. Both sides import this module; it imports only stdlib.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Final

__all__ = [
    "AGENT_EVENTS",
    "CHILD_DONE",
    "CONTROLLER_COMMANDS",
    "FrameReader",
    "decode_frame",
    "encode_frame",
    "recv_frame",
    "send_frame",
]

_HEADER = struct.Struct(">I")
MAX_FRAME: Final = 1 << 30

# Controller -> agent.
CONTROLLER_COMMANDS: Final = frozenset({"reserve_port", "run", "abort", "shutdown"})

# Agent (or a child, relayed by its agent) -> controller.
AGENT_EVENTS: Final = frozenset(
    {
        "agent_ready",  # agent: connected; who it is (rank, local rank, host, pid)
        "port_reserved",  # agent 0: a free rendezvous port on its host for the next test
        "child_started",  # agent: forked the child for a test
        "report",  # child: one serialized TestReport (setup / call / teardown)
        "collected",  # child: world.collect(name, tensor)
        "output",  # child: what it printed, when capture is off (-s)
        "interrupted",  # child: KeyboardInterrupt in the test
        "child_exited",  # agent: the child ended; exit status, output tail, stacks
        "agent_error",  # agent: could not run what it was asked (unknown test id, fork failed)
    }
)

# Child -> agent only: the child's last frame before os._exit(0); the agent answers it with child_exited.
CHILD_DONE: Final = "child_done"


def encode_frame(event: str, payload: dict[str, Any]) -> bytes:
    """One frame for ``event`` with ``payload``; both must be JSON-serializable."""
    body = json.dumps({"event": event, **payload}, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame for {event!r} is {len(body)} bytes, above the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> tuple[str, dict[str, Any]]:
    """Split a frame body into its event name and payload."""
    msg = json.loads(body)
    event = msg.pop("event")
    return event, msg


def send_frame(sock: socket.socket, event: str, **payload: Any) -> None:
    """Send one frame on a connected socket."""
    sock.sendall(encode_frame(event, payload))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket) -> tuple[str, dict[str, Any]] | None:
    """Block for the next frame; None when the peer closed the connection."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _recv_exact(sock, length)
    if body is None:
        return None
    return decode_frame(body)


class FrameReader:
    """Incremental decoder for a non-blocking byte stream (a child's pipe read with ``os.read``)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the complete raw frames (header included) now available."""
        self._buf += data
        frames = []
        while len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            frames.append(bytes(self._buf[:end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buf)
