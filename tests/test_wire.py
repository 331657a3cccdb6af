"""The frame protocol and stack trimming, without processes."""

from __future__ import annotations

import socket

import pytest

from pytest_sprite._markers import parse_ranks_marker
from pytest_sprite._stacks import strip_harness_frames
from pytest_sprite._wire import FrameReader, encode_frame, recv_frame, send_frame

pytestmark = pytest.mark.cpu


def test_frames_round_trip_over_a_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, "report", run_id=3, rank=1, report={"outcome": "passed", "text": "é" * 10})
        send_frame(a, "child_exited", run_id=3, rank=1, exitcode=0)
        a.close()
        assert recv_frame(b) == (
            "report",
            {"run_id": 3, "rank": 1, "report": {"outcome": "passed", "text": "é" * 10}},
        )
        assert recv_frame(b) == ("child_exited", {"run_id": 3, "rank": 1, "exitcode": 0})
        assert recv_frame(b) is None


def test_frame_reader_reassembles_frames_split_anywhere() -> None:
    data = encode_frame("a", {"x": 1}) + encode_frame("b", {"y": [1, 2]})
    for cut in range(len(data) + 1):
        reader = FrameReader()
        frames = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert frames == [encode_frame("a", {"x": 1}), encode_frame("b", {"y": [1, 2]})]
        assert reader.pending == 0


def test_strip_harness_frames_keeps_the_test_and_library_frames() -> None:
    dump = "\n".join(
        [
            "Current thread 0x1 (most recent call first):",
            '  File "/site/torch/distributed/distributed_c10d.py", line 5356 in barrier',
            '  File "/tmp/test_x.py", line 6 in test_x',
            '  File "/site/_pytest/python.py", line 166 in pytest_pyfunc_call',
            '  File "/site/pluggy/_callers.py", line 121 in _multicall',
            '  File "/repo/pytest_sprite/rank/child.py", line 216 in run_child',
            '  File "/repo/pytest_sprite/world.py", line 60 in barrier',
            '  File "<frozen runpy>", line 88 in _run_code',
        ]
    )
    kept = strip_harness_frames(dump).splitlines()
    assert kept == [
        "Current thread 0x1 (most recent call first):",
        '  File "/site/torch/distributed/distributed_c10d.py", line 5356 in barrier',
        '  File "/tmp/test_x.py", line 6 in test_x',
        '  File "/repo/pytest_sprite/world.py", line 60 in barrier',
    ]


def test_marker_forms() -> None:
    assert parse_ranks_marker([4], {}, "t").sizes == (4,)
    spec = parse_ranks_marker([[1, 2, 4]], {"timeout": 30}, "t")
    assert (spec.sizes, spec.parametrized, spec.timeout) == ((1, 2, 4), True, 30.0)
    assert parse_ranks_marker([(2, 3)], {}, "t").sizes == (2, 3)
