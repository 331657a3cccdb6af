"""The protocol between controller, rank agents and test children: the only place frames are made and read.

A frame: a 4-byte big-endian length, then a JSON object ``{"event": name, **payload}`` (a TypedDict below);
one ordered stream per rank, relayed unchanged by its agent; an unknown event raises. Stdlib only at run time.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, NotRequired, TypedDict

if TYPE_CHECKING:  # the records' shapes only: at run time this module imports the standard library alone
    from .stacks import StacksPayload

__all__ = [
    "AGENT_EVENTS",
    "AGENT_FAILED",
    "CHILD_DONE",
    "COMMANDS",
    "DEBUGGER_FRAMES",
    "FIRST_FRAME_MAX",
    "HEADER_SIZE",
    "MAX_FRAME",
    "Abort",
    "AgentError",
    "AgentFailed",
    "AgentLost",
    "AgentReady",
    "ChildDone",
    "ChildExited",
    "Collected",
    "CollectivesCalled",
    "DebugEnd",
    "DebugHello",
    "DebugInput",
    "DebugOutput",
    "DebugRead",
    "DebugReply",
    "DebuggerAddress",
    "EndedBy",
    "FrameReader",
    "FrameTooLarge",
    "Interrupted",
    "LaunchFailed",
    "ObjectReader",
    "Output",
    "Progress",
    "Report",
    "Run",
    "RunSpec",
    "Shutdown",
    "Warning_",
    "child_exited",
    "decode_frame",
    "encode_frame",
    "encode_object",
    "forked",
    "frame_event",
    "read_zygote_news",
    "recv_exact",
    "recv_fork_request",
    "recv_frame",
    "send_fork_request",
    "send_frame",
    "zygote_news",
]

_HEADER = struct.Struct(">I")
HEADER_SIZE: Final = _HEADER.size
MAX_FRAME: Final = 1 << 30
FIRST_FRAME_MAX: Final = 4096
"""The most a connection's first frame (``agent_ready``, before its token is checked) may hold."""


EndedBy = Literal["timeout", "peer_failed", "agent_lost", "agent_error"]
"""Why the harness ended a child (None in a payload: it ended on its own)."""

# -- controller -> agent ------------------------------------------------------------------------


class DebuggerAddress(TypedDict):
    """Where a test child's debugger finds the controller's terminal (the debug relay), or why it cannot."""

    host: str
    port: int
    """0: no debugger opens on a rank in this session; ``refusal`` says why."""
    key: str
    """The session's secret: a connection that does not show it is not served."""
    refusal: str


class RunSpec(TypedDict):
    """Where one child sits in its test's world; the agent hands it to the child with the listening socket."""

    run_id: int
    nodeid: str
    rank: int
    world_size: int
    local_rank: int
    """Rank among this test's ranks on its node (LOCAL_RANK), 0..local_size-1."""
    local_size: int
    node: int
    device_index: int
    """The agent's own launcher local rank: the device this child uses, so tests side by side never share one."""
    local_devices: list[int]
    """The device indices of this test's ranks on this node, in local-rank order (``World.local_devices``)."""
    master_addr: str
    master_port: int
    device: str
    timeout: float
    basetemp: str
    """The controller's session basetemp: the children make none of their own."""
    tmp_path: str
    """The test's directory in it, made by the controller: ``tmp_path`` on every rank."""
    hypothesis_seed: int | str
    """The session's hypothesis seed, decided once (``--hypothesis-seed`` or drawn), for every rank."""
    collective_check: bool
    """``--collective-check``: torch's collective fingerprint checks (TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    mutant: str | None
    """``--sprite-mutate``: the mutant spec this run plants (``skip_allreduce@rank1:from3``), None for a clean run."""
    record_collectives: bool
    """``--sprite-mutate``: run on the recording process group and send ``collectives_called`` at the end."""
    debugger: DebuggerAddress
    """Where ``--pdb``, ``--trace`` and ``breakpoint()`` on this rank reach the user's terminal."""
    last: bool
    """No ranks test of the session comes after this one: the agent prepares no spare child for a next
    test (one that comes anyway, a rerun say, gets a child forked when it starts)."""


Run = RunSpec
"""``run``: fork (or wake) a child that runs ``nodeid`` as ``rank`` of ``world_size``."""


class Abort(TypedDict):
    """``abort``: end the child (a timeout, or a peer that failed), in two phases over all of a test's agents.

    First ``kill=False``: take the child's stacks and answer ``stacks_taken``; then, once every agent of the
    test answered, ``kill=True``: no rank is killed while a peer's stack is still to be taken.
    """

    run_id: int
    reason: EndedBy
    detail: str
    kill: bool


class StacksTaken(TypedDict):
    """``stacks_taken``: the agent has its child's stacks (or knows why not); it waits for the kill."""

    run_id: int


class Shutdown(TypedDict):
    """``shutdown``: end the agent's loop."""


# -- agent (or a child, relayed by its agent) -> controller ----------------------------------------


class AgentReady(TypedDict):
    """``agent_ready``: the agent's first frame; who it is and where the launcher placed it."""

    token: str
    rank: int
    local_rank: int
    world_size: int
    node: int | None
    host: str
    pid: int
    next_port: int | None
    """A listening port on its host for the rendezvous store of the first test whose rank 0 it runs."""
    collect_errors: NotRequired[dict[str, str]]
    """A launched agent's collection errors: node id -> the error's text (the controller compares its own)."""


class AgentFailed(TypedDict):
    """``agent_failed``: a launched agent's only frame when it failed before it could join (a conftest)."""

    token: str
    rank: int | None
    detail: str


class Report(TypedDict):
    """``report``: one TestReport (setup, call or teardown), from ``pytest_report_to_serializable``."""

    run_id: int
    rank: int
    report: dict[str, Any]


class Collected(TypedDict):
    """``collected``: ``world.collect(name, tensor)``; the tensor is ``torch.save``'d and base64-encoded."""

    run_id: int
    rank: int
    name: str
    tensor: str


class Output(TypedDict):
    """``output``: what the child printed, sent when capture is off (``-s``)."""

    run_id: int
    rank: int
    text: str


class Warning_(TypedDict):
    """``warning``: a warning the test raised in the child; the controller folds them over ranks."""

    run_id: int
    rank: int
    category: str
    message: str
    filename: str
    lineno: int


class Progress(TypedDict):
    """``progress``: a progress line of a long assertion on rank 0 (``pytest_sprite.progress``), shown at once."""

    run_id: int
    rank: int
    message: str


class Interrupted(TypedDict):
    """``interrupted``: KeyboardInterrupt or ``pytest.exit`` in the test; the session ends after it."""

    run_id: int
    rank: int
    message: str
    returncode: NotRequired[int | None]
    reason: NotRequired[str]  # what the rank did, for its own entry: ``called pytest.exit('enough')``
    """``pytest.exit(..., returncode=N)``'s N: the session's exit status; absent: interrupted (2)."""


class CollectivesCalled(TypedDict):
    """``collectives_called``: the op names this rank's collectives called, in order (``--sprite-mutate``'s
    clean run: a mutant whose op no rank called is not run for the test)."""

    run_id: int
    rank: int
    ops: list[str]


class ChildExited(TypedDict):
    """``child_exited``: the child ended; its status, output tail and stacks."""

    run_id: int
    rank: int
    exitcode: int | None
    signal: int | None
    ended_by: EndedBy | None
    detail: str
    output_tail: str
    stacks: StacksPayload
    leftovers: str
    """What a crashed or ended child left running and the agent ended (pid, command), or empty."""
    next_port: int | None
    """The agent's listening port for the rendezvous of the next test whose rank 0 it runs, so no test waits on a round trip."""


class AgentError(TypedDict):
    """``agent_error``: the agent could not run what it was asked (unknown test id)."""

    run_id: int
    rank: int
    message: str


class AgentLost(TypedDict):
    """``agent_lost``: posted by the controller's reader thread when an agent's connection closed, broke or
    sent what could not be read, and when a command could not be sent to it."""

    detail: str
    """What happened to the connection, completing "the connection to rank agent N ...": ``closed``,
    ``broke (...)``, ``sent a frame that could not be read (...)``, ``took no command (...)``."""


class LaunchFailed(TypedDict):
    """``launch_failed``: posted by the controller's accepting thread when the world cannot be completed
    (the launch ended, --connect-timeout passed, an agent reported a rank that does not fit); agent -1."""

    detail: str


# -- child -> agent only ---------------------------------------------------------------------------


class ChildDone(TypedDict):
    """``child_done``: the child's last frame before ``os._exit(0)``; the agent answers it with child_exited."""

    run_id: int
    rank: int


CHILD_DONE: Final = "child_done"


# -- test child <-> controller, on a connection of its own to the debug relay ------------------------


class DebugHello(TypedDict):
    """``debug_hello``: a rank's debugger asks for the terminal; its first frame on the relay connection.
    ``kind``: ``post_mortem`` (``--pdb`` on a failure) or ``trace`` (``breakpoint()``, ``--trace``)."""

    key: str
    run_id: int
    rank: int
    nodeid: str
    kind: Literal["post_mortem", "trace"]


class DebugReply(TypedDict):
    """``debug_go`` (the terminal is this rank's now) or ``debug_decline`` (another rank of the test had it)."""


class DebugOutput(TypedDict):
    """``debug_output``: what the rank's pdb wrote, whole lines."""

    text: str


class DebugRead(TypedDict):
    """``debug_read``: the rank's pdb waits for a line; ``prompt`` is what it wrote since its last whole line."""

    prompt: str


class DebugInput(TypedDict):
    """``debug_input``: the line the user typed (with its newline); empty at end of input."""

    line: str


class DebugEnd(TypedDict):
    """``debug_end``: the rank left its debugger (continue, or quit: the session stops after the test)."""

    quit: bool


DEBUGGER_FRAMES: Final[Mapping[str, type]] = {
    "debug_hello": DebugHello,
    "debug_go": DebugReply,
    "debug_decline": DebugReply,
    "debug_output": DebugOutput,
    "debug_read": DebugRead,
    "debug_input": DebugInput,
    "debug_end": DebugEnd,
}
"""A test child's debugger <-> the controller's debug relay (``rank/debugger.py``, ``launch/debug_relay.py``)."""

COMMANDS: Final[Mapping[str, type]] = {"run": RunSpec, "abort": Abort, "shutdown": Shutdown}
"""Controller -> agent."""

AGENT_EVENTS: Final[Mapping[str, type]] = {
    "agent_ready": AgentReady,
    "report": Report,
    "collected": Collected,
    "collectives_called": CollectivesCalled,
    "output": Output,
    "warning": Warning_,
    "progress": Progress,
    "interrupted": Interrupted,
    "child_exited": ChildExited,
    "stacks_taken": StacksTaken,
    "agent_error": AgentError,
    "agent_lost": AgentLost,
    "launch_failed": LaunchFailed,
}
"""Agent (or a child, relayed) -> controller."""

AGENT_FAILED: Final = "agent_failed"
"""A launched agent's only frame when it fails before it can join (:class:`AgentFailed`); the controller's
accepting thread turns it into ``launch_failed``, so it never reaches the event loop."""

_ALL_EVENTS: Final = frozenset({*COMMANDS, *AGENT_EVENTS, *DEBUGGER_FRAMES, CHILD_DONE, AGENT_FAILED})


class FrameTooLarge(ValueError):
    """A frame header announced more bytes than the reader accepts."""


def child_exited(
    *,
    run_id: int,
    rank: int,
    exitcode: int | None = 0,
    signal: int | None = None,
    ended_by: EndedBy | None = None,
    detail: str = "",
    output_tail: str = "",
    stacks: StacksPayload | None = None,
    leftovers: str = "",
    next_port: int | None = None,
) -> ChildExited:
    """The one place a ``child_exited`` payload is built (defaults: a child that ended cleanly)."""
    return ChildExited(
        run_id=run_id,
        rank=rank,
        exitcode=exitcode,
        signal=signal,
        ended_by=ended_by,
        detail=detail,
        output_tail=output_tail,
        stacks=stacks if stacks is not None else {"threads": [], "missing": None},
        leftovers=leftovers,
        next_port=next_port,
    )


def _check_event(event: object) -> str:
    if not isinstance(event, str) or event not in _ALL_EVENTS:
        raise ValueError(f"unknown event {event!r}; known: {', '.join(sorted(_ALL_EVENTS))}")
    return event


def encode_frame(event: str, payload: Mapping[str, Any]) -> bytes:
    """One frame for ``event`` with ``payload``; both must be JSON-serializable."""
    body = json.dumps({"event": _check_event(event), **payload}, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame for {event!r} is {len(body)} bytes, above the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> tuple[str, dict[str, Any]]:
    """Split a frame body (the bytes after the header) into its event name and payload."""
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError(f"a frame must hold a JSON object, not {type(msg).__name__}")
    event = _check_event(msg.pop("event", None))
    return event, msg


_EVENT_PREFIX = b'{"event":"'


def frame_event(frame: bytes) -> str:
    """The event name of a whole frame (header included), read without decoding its payload.

    :func:`encode_frame` writes the name first. An agent relays its child's frames and needs only their
    names: decoding a report there built hundreds of objects per test, each write into the heap it shares
    with its children a copy-on-write fault. A frame made otherwise is decoded whole.
    """
    start = HEADER_SIZE + len(_EVENT_PREFIX)
    end = frame.find(b'"', start, start + 64)
    if frame[HEADER_SIZE:start] != _EVENT_PREFIX or end < 0:
        return decode_frame(frame[HEADER_SIZE:])[0]
    return _check_event(frame[start:end].decode("ascii", "replace"))


def send_frame(sink: socket.socket | int, event: str, payload: Mapping[str, Any]) -> None:
    """Send one frame on a connected socket, or write it whole to a file descriptor (a child's pipe)."""
    data = encode_frame(event, payload)
    if isinstance(sink, socket.socket):
        sink.sendall(data)
        return
    view = memoryview(data)
    while view:
        view = view[os.write(sink, view) :]


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(min(n - len(chunks), 1 << 20))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, max_size: int = MAX_FRAME) -> tuple[str, dict[str, Any]] | None:
    """Block for the next frame; None when the peer closed the connection.

    Raises FrameTooLarge, before reading the body, when the header announces more than ``max_size``
    bytes: a connection that has not shown its token yet gets :data:`FIRST_FRAME_MAX`.
    """
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > max_size:
        raise FrameTooLarge(f"a frame of {length} bytes is above the {max_size}-byte limit")
    body = _recv_exact(sock, length)
    if body is None:
        return None
    return decode_frame(body)


class FrameReader:
    """Incremental decoder for a non-blocking byte stream (a child's pipe read with ``os.read``)."""

    def __init__(self, header: struct.Struct = _HEADER) -> None:
        self._buf = bytearray()
        self._header = header
        """The length prefix of a frame: a JSON frame's, or a sub-world frame's (:class:`ObjectReader`)."""

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the complete raw frames (header included) now available."""
        self._buf += data
        frames = []
        while len(self._buf) >= self._header.size:
            (length,) = self._header.unpack_from(self._buf)
            end = self._header.size + length
            if len(self._buf) < end:
                break
            frames.append(bytes(self._buf[:end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buf)


# -- sub-world frames: a sub-world rank <-> the test process that started it, a zygote <-> its test child --
#
# A sub-world rank sends pickled tuples (what the function returned, emitted, raised, where it was killed)
# on its socket to the process that hosts it; values can be any picklable object, so these frames carry
# pickle, not JSON, and an 8-byte length (a returned state dict can be larger than a JSON frame may be).

_OBJECT_HEADER = struct.Struct(">Q")
_ZYGOTE_NEWS = struct.Struct(">cQQ")


def encode_object(message: object) -> bytes:
    """One sub-world frame holding ``message`` (a record of ``subworld.messages``), pickled with its plain CPU
    tensors as their bytes (``tensor_pickle``): a resume role emits whole training states, and torch's own
    pickle of each tensor storage made the host read every one through a nested ``torch.load``."""
    from .tensor_pickle import dumps

    body = dumps(message)
    return _OBJECT_HEADER.pack(len(body)) + body


class ObjectReader:
    """Incremental decoder of sub-world frames read from a non-blocking socket."""

    def __init__(self) -> None:
        self._frames = FrameReader(_OBJECT_HEADER)

    def feed(self, data: bytes) -> list[Any]:
        """Add bytes; return the messages now complete, in order (the reader checks their type)."""
        size = _OBJECT_HEADER.size
        return [pickle.loads(memoryview(frame)[size:]) for frame in self._frames.feed(data)]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket; EOFError when it closes first."""
    data = _recv_exact(sock, n)
    if data is None:
        raise EOFError("connection closed mid-message")
    return data


def send_fork_request(sock: socket.socket, payload: bytes, channel: socket.socket) -> None:
    """Test child -> zygote: fork a sub-world rank with ``payload``, talking on ``channel`` (passed along); one
    message where the socket has room, so requests of test children sharing a socket never interleave."""
    data = _OBJECT_HEADER.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], [channel.fileno()])
    sock.sendall(data[sent:])


def recv_fork_request(sock: socket.socket) -> tuple[bytes, socket.socket] | None:
    """Zygote side of :func:`send_fork_request`; None when the test child closed the socket."""
    header, fds, _, _ = socket.recv_fds(sock, _OBJECT_HEADER.size, 1)
    if not header:
        return None
    (length,) = _OBJECT_HEADER.unpack(header)
    payload = recv_exact(sock, length)
    return payload, socket.socket(fileno=fds[0])


def forked(pid: int) -> bytes:
    """Zygote -> test child: the rank it was asked for runs as ``pid``."""
    return _ZYGOTE_NEWS.pack(b"p", pid, 0)


def zygote_news(pid: int, status: int) -> bytes:
    """Zygote -> test child: rank process ``pid`` ended with wait status ``status``."""
    return _ZYGOTE_NEWS.pack(b"e", pid, status)


def read_zygote_news(buf: bytearray) -> list[tuple[str, int, int]]:
    """Take the complete records out of ``buf``: ``("pid", pid, 0)`` or ``("exit", pid, status)``."""
    out = []
    while len(buf) >= _ZYGOTE_NEWS.size:
        kind, pid, status = _ZYGOTE_NEWS.unpack(bytes(buf[: _ZYGOTE_NEWS.size]))
        del buf[: _ZYGOTE_NEWS.size]
        out.append(("pid" if kind == b"p" else "exit", pid, status))
    return out
