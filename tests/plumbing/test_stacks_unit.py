"""A rank's stacks as records: read once from faulthandler's text, shown as that text, carried as data."""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import pytest

from pytest_sprite.plumbing.stacks import Frame, Stacks, ThreadStack, is_harness, parse_stacks, read_stacks

pytestmark = pytest.mark.cpu

PACKAGE = str(Path(__file__).resolve().parents[2] / "pytest_sprite")
SITE = "/venv/lib/python3.11/site-packages"
DUMP = f"""\
Thread 0x00007f8700001000 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait
  <no Python frame>

Current thread 0x00007f871142eb80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/home/me/tests/test_sync.py", line 12 in test_sync
  File ???, line ??? in ???
  File "{SITE}/_pytest/python.py", line 166 in pytest_pyfunc_call
  File "{PACKAGE}/rank/child.py", line 216 in run_child
  ..."""


def test_a_dump_reads_into_threads_of_frames_and_shows_as_it_was_written() -> None:
    stacks = parse_stacks(DUMP + "\n\n")
    assert [(t.label, t.ident) for t in stacks.threads] == [
        ("Thread", "0x00007f8700001000"),
        ("Current thread", "0x00007f871142eb80"),
    ]
    assert stacks.threads[0].notes == ("<no Python frame>",)
    current = stacks.threads[1]
    assert current.frames[:3] == (
        Frame(f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
        Frame("/home/me/tests/test_sync.py", 12, "test_sync"),
        Frame("???", None, "???"),
    )
    assert current.notes == ("...",)
    assert stacks.text() == DUMP


def test_the_harness_frames_are_left_out_of_the_records() -> None:
    kept = parse_stacks(DUMP).without_harness().threads[1]
    assert [f.function for f in kept.frames] == ["all_reduce", "test_sync", "???"]
    assert is_harness(Frame(f"{PACKAGE}/launch/controller.py", 9, "run"))
    assert not is_harness(Frame(f"{PACKAGE}/world.py", 60, "barrier"))


def test_stacks_cross_the_wire_as_data_and_compare_without_thread_addresses() -> None:
    stacks = parse_stacks(DUMP)
    assert Stacks.from_dict(json.loads(json.dumps(stacks.to_dict()))) == stacks
    other_rank = parse_stacks(DUMP.replace("0x00007f871142eb80", "0x00007f0000000002"))
    assert other_rank != stacks and other_rank.key() == stacks.key()
    missing = Stacks(missing="no answer to SIGUSR1 within 15s (state R)")
    assert Stacks.from_dict(json.loads(json.dumps(missing.to_dict()))) == missing
    assert missing.text() == "sprite: no stack: no answer to SIGUSR1 within 15s (state R)"
    assert missing.present and not Stacks().present and Stacks().text() == ""


def test_a_cut_keeps_the_last_threads_and_the_innermost_frames() -> None:
    stacks = parse_stacks(DUMP)
    assert stacks.last_lines(100) == stacks
    cut = stacks.last_lines(4)
    assert [t.label for t in cut.threads] == ["Current thread"]
    assert [f.function for f in cut.threads[0].frames] == ["all_reduce", "test_sync", "???"]


def test_this_process_s_own_dump_names_this_test_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "stacks.txt"
    with open(path, "w") as out:
        line = sys._getframe().f_lineno + 1
        faulthandler.dump_traceback(file=out, all_threads=True)
    stacks = read_stacks(path)
    frames = [f for t in stacks.threads for f in t.frames]
    assert Frame(__file__, line, "test_this_process_s_own_dump_names_this_test_at_its_line") in frames
    assert stacks.text() == path.read_text().rstrip()
    assert read_stacks(tmp_path / "absent.txt") == Stacks()


def test_a_thread_without_a_title_still_reads() -> None:
    stacks = parse_stacks('File "t.py", line 9 in barrier')
    assert stacks.threads == (ThreadStack(label="", frames=(Frame("t.py", 9, "barrier"),)),)
    assert stacks.text() == '  File "t.py", line 9 in barrier'
