"""The protocol module and stack trimming, without processes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import pytest_sprite
from pytest_sprite.glue.markers import parse_ranks_marker
from pytest_sprite.plumbing.output import strip_harness_frames, tail_of_file
from pytest_sprite.plumbing.protocol import (
    AGENT_EVENTS,
    COMMANDS,
    FIRST_FRAME_MAX,
    HEADER_SIZE,
    FrameReader,
    FrameTooLarge,
    child_exited,
    decode_frame,
    encode_frame,
    frame_event,
    recv_frame,
    send_frame,
)

PACKAGE = Path(pytest_sprite.__file__).resolve().parent

pytestmark = pytest.mark.cpu


def test_frames_round_trip_over_a_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, "report", {"run_id": 3, "rank": 1, "report": {"outcome": "passed", "text": "é" * 10}})
        send_frame(a, "child_exited", child_exited(run_id=3, rank=1, next_port=4242))
        a.close()
        assert recv_frame(b) == (
            "report",
            {"run_id": 3, "rank": 1, "report": {"outcome": "passed", "text": "é" * 10}},
        )
        assert recv_frame(b) == (
            "child_exited",
            {
                "run_id": 3,
                "rank": 1,
                "exitcode": 0,
                "signal": None,
                "ended_by": None,
                "detail": "",
                "output_tail": "",
                "stacks": {"threads": [], "missing": None},
                "leftovers": "",
                "next_port": 4242,
            },
        )
        assert recv_frame(b) is None


def test_frame_reader_reassembles_frames_split_anywhere() -> None:
    first, second = encode_frame("output", {"x": 1}), encode_frame("report", {"y": [1, 2]})
    data = first + second
    for cut in range(len(data) + 1):
        reader = FrameReader()
        frames = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert frames == [first, second]
        assert reader.pending == 0
    assert decode_frame(second[HEADER_SIZE:]) == ("report", {"y": [1, 2]})


def test_strip_harness_frames_keeps_the_test_and_library_frames() -> None:
    dump = "\n".join(
        [
            "Current thread 0x1 (most recent call first):",
            '  File "/site/torch/distributed/distributed_c10d.py", line 5356 in barrier',
            '  File "/tmp/test_x.py", line 6 in test_x',
            '  File "/site/_pytest/python.py", line 166 in pytest_pyfunc_call',
            '  File "/site/pluggy/_callers.py", line 121 in _multicall',
            f'  File "{PACKAGE}/rank/child.py", line 216 in run_child',
            f'  File "{PACKAGE}/launch/controller.py", line 9 in run',
            f'  File "{PACKAGE}/world.py", line 60 in barrier',
            '  File "<frozen runpy>", line 88 in _run_code',
        ]
    )
    kept = strip_harness_frames(dump).splitlines()
    assert kept == [
        "Current thread 0x1 (most recent call first):",
        '  File "/site/torch/distributed/distributed_c10d.py", line 5356 in barrier',
        '  File "/tmp/test_x.py", line 6 in test_x',
        f'  File "{PACKAGE}/world.py", line 60 in barrier',
    ]


def test_marker_forms() -> None:
    assert parse_ranks_marker([4], {}, "t").sizes == (4,)
    spec = parse_ranks_marker([[1, 2, 4]], {"timeout": 30}, "t")
    assert (spec.sizes, spec.parametrized, spec.timeout) == ((1, 2, 4), True, 30.0)
    assert parse_ranks_marker([(2, 3)], {}, "t").sizes == (2, 3)


def test_unknown_event_names_raise_both_ways() -> None:
    with pytest.raises(ValueError, match=r"unknown event 'reserve_port'"):
        encode_frame("reserve_port", {})
    with pytest.raises(ValueError, match=r"unknown event 'bogus'"):
        decode_frame(b'{"event":"bogus"}')
    with pytest.raises(ValueError, match=r"unknown event None"):
        decode_frame(b'{"run_id":1}')


def test_every_event_has_a_typed_payload_and_agent_lost_is_one_of_them() -> None:
    assert "agent_lost" in AGENT_EVENTS
    assert set(COMMANDS) == {"run", "abort", "shutdown"}
    for events in (AGENT_EVENTS, COMMANDS):
        for name, payload in events.items():
            assert payload.__annotations__ is not None, name


def test_child_done_is_recognized_whatever_the_key_order() -> None:
    body = b'{"run_id":3,"rank":0,"event":"child_done"}'
    assert decode_frame(body) == ("child_done", {"run_id": 3, "rank": 0})


def test_a_relay_reads_the_event_name_of_any_frame_without_its_payload() -> None:
    """What an agent reads of the frames it relays (issue 23): the name, whatever the payload holds."""
    report = encode_frame("report", {"run_id": 1, "rank": 0, "report": {"nodeid": 'a"b', "event": "x"}})
    assert frame_event(report) == "report"
    assert frame_event(encode_frame("child_done", {"run_id": 1, "rank": 0})) == "child_done"
    reordered = b'{"run_id":3,"event":"child_done"}'  # not made by encode_frame: decoded whole
    assert frame_event(len(reordered).to_bytes(HEADER_SIZE, "big") + reordered) == "child_done"
    bogus = b'{"event":"bogus","run_id":3}'
    with pytest.raises(ValueError, match=r"unknown event 'bogus'"):
        frame_event(len(bogus).to_bytes(HEADER_SIZE, "big") + bogus)


def test_an_oversized_first_frame_is_refused_before_its_body_is_read() -> None:
    """The controller reads a connection's first frame before the token: a stranger may not make it allocate."""
    import struct
    import tracemalloc

    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 1 << 30) + b"x" * 64)  # announces 1 GiB, sends 64 bytes
        b.settimeout(5.0)  # were the body awaited, recv would time out instead of raising FrameTooLarge
        tracemalloc.start()
        try:
            with pytest.raises(FrameTooLarge, match=r"1073741824 bytes is above the 4096-byte limit"):
                recv_frame(b, max_size=FIRST_FRAME_MAX)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20


def test_the_controller_drops_a_connection_whose_first_frame_is_too_large() -> None:
    import struct

    from pytest_sprite.launch.pool import AgentPool

    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", FIRST_FRAME_MAX + 1))
        assert AgentPool._first_frame(b) is None  # the accept loop closes the connection
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x00\x00\x00\x05junk!")
        assert AgentPool._first_frame(b) is None
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_frame("agent_ready", {"token": "t"}))
        assert AgentPool._first_frame(b) == ("agent_ready", {"token": "t"})


def test_tail_of_file_reads_the_end_and_strips_harness_frames(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    assert tail_of_file(log) == ""
    harness = f'  File "{PACKAGE}/rank/agent.py", line 1 in serve'
    log.write_text("\n".join([f"line {i}" for i in range(100)] + [harness, "last"]) + "\n")
    assert tail_of_file(log, 2) == f"{harness}\nlast"
    assert tail_of_file(log, 2, strip_harness=True) == "line 99\nlast"
