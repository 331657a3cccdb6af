"""Diagnosis at scale (issue 27): the roll call, the rank that left, stacks kept, timeouts, no false leftovers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _pytest.reports import TestReport
from diagnosis_suite import SUITE
from sprite_testing import run_pytest

from pytest_sprite.glue.options import settings_key
from pytest_sprite.launch.controller import item_timeout
from pytest_sprite.launch.merge import merge_rank_reports
from pytest_sprite.launch.rank_end import RankEnd
from pytest_sprite.plumbing.collectives import waiting_collective
from pytest_sprite.plumbing.stacks import Frame, Stacks, is_harness, parse_stacks

TIMEOUT = 300

SITE = "/venv/lib/python3.11/site-packages/torch/distributed"
WAITING = f"""Current thread 0x00007f0000000001 (most recent call first):
  File "{SITE}/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/c10d_logger.py", line 83 in wrapper
  File "/src/test_x.py", line 9 in test_hang
  File "/venv/bin/pytest", line 8 in <module>
"""
SLEEPING = """Current thread 0x00007f0000000002 (most recent call first):
  File "/src/test_x.py", line 11 in test_hang
  File "/venv/bin/pytest", line 8 in <module>
"""


def rep(when: str, outcome: str = "passed", longrepr: Any = None) -> TestReport:
    return TestReport("t.py::test", ("t.py", 0, "test"), {}, outcome, longrepr, when)  # type: ignore[arg-type]


def merged_text(
    per_rank: dict[int, list[TestReport]], ends: dict[int, RankEnd], n: int, woken: tuple[int, ...] = ()
) -> dict[str, Any]:
    merged = merge_rank_reports(
        woken=woken,
        nodeid="t.py::test",
        location=("t.py", 0, "test"),
        keywords={},
        per_rank=per_rank,
        ends=ends,
        world_size=n,
        stacks_took=2.5,
    )
    return {r.when: r for r in merged}


@pytest.mark.cpu
def test_a_hang_at_96_ranks_reads_as_a_short_roll_call_naming_the_odd_rank() -> None:
    n = 96
    per_rank = {r: [rep("setup")] for r in range(n)}
    detail = "after the 8s timeout (from @pytest.mark.ranks(timeout=...))"
    ends = {
        r: RankEnd(
            rank=r, ended_by="timeout", detail=detail, stacks=parse_stacks(SLEEPING if r == 1 else WAITING)
        )
        for r in range(n)
    }
    ends[57] = RankEnd(
        rank=57,
        ended_by="timeout",
        detail=detail,
        stacks=Stacks(missing="no answer to SIGUSR1 within 15s (state R)"),
    )
    call = merged_text(per_rank, ends, n)["call"]
    text = str(call.longrepr)
    lines = text.splitlines()
    assert (
        f"ranks 0-95 were still running {detail} (during call): rank 1 was elsewhere (test_x.py:11)" in text
    )
    start = next(i for i, line in enumerate(lines) if line.startswith("where the 96 ranks were"))
    roll = lines[start : next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))]
    assert len(roll) <= 10, roll
    assert roll == [
        "where the 96 ranks were (stacks of 95 of the 96 ranks ended, taken within 2.5s):",
        "  ranks 0, 2-56, 58-95: waiting in all_reduce (test_x.py:9)",
        "  rank 1: elsewhere (test_x.py:11)  <- odd one out",
        "  rank 57: no stack (see below)  <- odd one out",
    ]
    assert text.count("--- stacks of ") == 2
    assert "--- stacks of ranks 0, 2-56, 58-95 (most recent call first) ---" in text
    assert "--- stacks of rank 1 (most recent call first) ---" in text
    assert "rank 57: no answer to SIGUSR1 within 15s (state R)" in text
    # One section for the ended ranks, not 96.
    assert [ranks for ranks, _ in call.longrepr.groups] == [tuple(range(n))]


@pytest.mark.cpu
def test_a_rank_that_returned_from_a_collective_is_the_cause_and_its_peers_the_consequence() -> None:
    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4242"

    class Crash:
        def __init__(self, rank: int) -> None:
            self.reprcrash = type("C", (), {"path": "t.py", "lineno": 9, "message": closed})()
            self.reprtraceback = type(
                "T",
                (),
                {
                    "reprentries": [
                        type(
                            "E",
                            (),
                            {
                                "reprfileloc": type("L", (), {"path": "t.py", "lineno": 9})(),
                                "lines": [">       dist.all_reduce(t)", f"E       {closed}"],
                            },
                        )()
                    ]
                },
            )()

        def __str__(self) -> str:
            return closed

    per_rank = {
        r: [
            rep("setup"),
            rep("call", "passed" if r == 1 else "failed", None if r == 1 else Crash(r)),
            rep("teardown"),
        ]
        for r in range(4)
    }
    ends = {r: RankEnd(rank=r, exitcode=0) for r in range(4)}
    call = merged_text(per_rank, ends, 4)["call"]
    assert call.failed
    groups = call.longrepr.groups
    assert [ranks for ranks, _ in groups] == [(1,), (0, 2, 3)]
    cause = "rank 1 ended the test (passed) while ranks 0, 2-3 waited in all_reduce (t.py:9)"
    assert str(groups[0][1]).startswith(cause)
    assert str(groups[1][1]).startswith(
        f"ranks 0, 2-3 lost their peer: {cause}; their own errors during call"
    )
    assert call.longrepr.reprcrash.message.startswith(f"[rank 1] {cause}")


@pytest.mark.cpu
def test_ranks_woken_by_the_end_of_a_peer_join_the_roll_call_even_if_they_finished() -> None:
    """At 96 ranks, killing one rank broke its peers' all_reduce before their own abort came; some of
    them even finished their test before being killed. Their transport errors are the harness's doing."""
    closed = "RuntimeError: Connection closed by peer [127.0.0.1]:4242"
    crash = TestReport("t.py::test", ("t.py", 0, "test"), {}, "failed", closed, "call")
    detail = "after the 8s timeout (from @pytest.mark.ranks(timeout=...))"
    per_rank = {r: [rep("setup")] for r in range(4)}
    ends = {
        r: RankEnd(
            rank=r, ended_by="timeout", detail=detail, stacks=parse_stacks(SLEEPING if r == 1 else WAITING)
        )
        for r in range(4)
    }
    per_rank[2] += [crash, rep("teardown")]  # woken, then finished before its agent killed it
    per_rank[3] += [crash]  # woken, killed in its teardown
    merged = merged_text(per_rank, ends, 4, woken=(2, 3))
    assert merged["teardown"].passed  # rank 2's own teardown
    groups = merged["call"].longrepr.groups
    assert [ranks for ranks, _ in groups] == [(0, 1, 2, 3)]
    assert "  ranks 0, 2-3: waiting in all_reduce (test_x.py:9)" in str(groups[0][1])


@pytest.mark.cpu
def test_every_form_of_the_marker_carries_its_timeout(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks("world", timeout=8)
        def test_world(world): pass

        @pytest.mark.ranks([1, 2], timeout=9)
        def test_list(world): pass

        @pytest.mark.ranks(2, timeout=7)
        def test_number(world): pass

        @pytest.mark.ranks(2)
        def test_default(world): pass
        """
    )
    items, _ = pytester.inline_genitems("--ranks=2", "--rank-timeout=33")
    settings = items[0].config.stash[settings_key]
    found = {item.name: item_timeout(item, settings) for item in items}
    marker = "@pytest.mark.ranks(timeout=...)"
    assert found == {
        "test_world[ranks2]": (8.0, marker),
        "test_list[ranks1]": (9.0, marker),
        "test_list[ranks2]": (9.0, marker),
        "test_number": (7.0, marker),
        "test_default": (33.0, "--rank-timeout"),
    }


@pytest.mark.cpu
def test_a_child_keeps_its_stack_dump_when_a_library_resets_the_signal(tmp_path: Any) -> None:
    """Lightning's signal connector puts SIG_DFL back on every signal at the end of a fit (issue 27)."""
    script = textwrap.dedent(
        f"""
        import faulthandler, os, signal, time
        from pytest_sprite.plumbing.stacks import keep_stack_dumps
        keep_stack_dumps()
        dump = open({str(tmp_path / "stacks.txt")!r}, "w")
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True, chain=False)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print("survived")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "survived", done.stderr
    assert "most recent call first" in (tmp_path / "stacks.txt").read_text()


def run_suite(pytester: pytest.Pytester, ranks: int, hang_timeout: int, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_suite=SUITE.replace("HANG_TIMEOUT", str(hang_timeout)))
    return run_pytest(pytester, f"--ranks={ranks}", "--rank-grace=3", *args, timeout=TIMEOUT * (ranks // 4))


def check_suite(result: pytest.RunResult, ranks: int, hang_timeout: int) -> None:
    result.assert_outcomes(failed=4, passed=1)
    out = result.stdout.str()
    lines = out.splitlines()
    others = f"ranks 0, 2-{ranks - 1}"
    # The hang: ended at the marker's timeout, a roll call of at most 10 lines naming rank 1.
    assert f"still running after the {hang_timeout}s timeout (from @pytest.mark.ranks(timeout=...))" in out
    start = next(i for i, line in enumerate(lines) if line.startswith(f"where the {ranks} ranks were"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    roll = lines[start:end]
    assert len(roll) <= 10
    assert f"  {others}: waiting in all_reduce (test_suite.py:9)" in roll, roll
    assert "  rank 1: elsewhere, in time.sleep (test_suite.py:11)  <- odd one out" in roll, roll
    assert f"--- stacks of {others} (most recent call first) ---" in out
    assert "--- stacks of rank 1 (most recent call first) ---" in out
    # The rank that returned without the collective is the cause, its peers the consequence.
    cause = f"rank 1 ended the test (passed) while {others} waited in all_reduce (test_suite.py:17)"
    assert f"FAILED test_suite.py::test_leaver[ranks{ranks}] - [rank 1] {cause}"[:60] in out
    assert cause in out
    # torch.distributed's frames (the source and docstring of all_reduce) are not in the tracebacks.
    assert "bitwise identical in all processes" not in out
    # No test here starts a process: none is reported as left running, whichever way it ended.
    assert "LeftoverProcessWarning" not in out


@pytest.mark.cpu
def test_diagnosis_at_4_ranks(pytester: pytest.Pytester) -> None:
    check_suite(run_suite(pytester, 4, 8, "--sprite-report=report.json"), 4, 8)
    check_stacks_in_the_json_report(pytester.path / "report.json")


def check_stacks_in_the_json_report(path: Path) -> None:
    """Each hung rank's stacks reach the JSON report as the records the terminal's text is made from."""
    import jsonschema

    from pytest_sprite.report.json_report import load_schema

    document = json.loads(path.read_text())
    jsonschema.validate(document, load_schema())
    hang = next(t for t in document["tests"] if "test_hang" in t["nodeid"])
    stacks = {entry["rank"]: Stacks.from_dict(entry["stacks"]) for entry in hang["ranks"]}
    sleeper = [f for t in stacks[1].threads for f in t.frames]
    assert Frame(str(path.parent / "test_suite.py"), 11, "test_hang") in sleeper
    assert not any(is_harness(f) for f in sleeper)
    for rank in (0, 2, 3):
        assert waiting_collective(stacks[rank]) == "all_reduce (called at test_suite.py:9)"
    passed = next(t for t in document["tests"] if "test_passes" in t["nodeid"])
    assert all("stacks" not in entry for entry in passed["ranks"])


@pytest.mark.cpu
@pytest.mark.slow
def test_diagnosis_at_48_ranks(pytester: pytest.Pytester) -> None:
    check_suite(run_suite(pytester, 48, 60), 48, 60)
