"""Merging per-rank reports into one result, without processes."""

from __future__ import annotations

import pytest
from _pytest.reports import TestReport

from pytest_sprite.launch.merge import merge_rank_reports
from pytest_sprite.launch.rank_end import RankEnd, phase_in_progress
from pytest_sprite.plumbing.ranges import fold_ranks
from pytest_sprite.plumbing.stacks import parse_stacks

pytestmark = pytest.mark.cpu

LOC = ("test_x.py", 3, "test_x")


def rep(
    when: str, outcome: str = "passed", longrepr: object = None, sections: list | None = None
) -> TestReport:
    return TestReport(
        nodeid="test_x.py::test_x",
        location=LOC,
        keywords={},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=longrepr,
        when=when,
        sections=sections or [],
        duration=0.1,  # type: ignore[arg-type]
    )


def clean(*ranks: int) -> dict[int, RankEnd]:
    return {r: RankEnd(rank=r, exitcode=0) for r in ranks}


def passing(*ranks: int) -> dict[int, list[TestReport]]:
    return {r: [rep("setup"), rep("call"), rep("teardown")] for r in ranks}


def merge(
    per_rank: dict[int, list[TestReport]], ends: dict[int, RankEnd], n: int, order: tuple[int, ...] = ()
) -> dict[str, TestReport]:
    merged = merge_rank_reports(
        nodeid="test_x.py::test_x",
        location=LOC,
        keywords={},
        per_rank=per_rank,
        ends=ends,
        world_size=n,
        failure_order=order,
    )
    return {r.when: r for r in merged}


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([1], "rank 1"),
        ([0, 1, 2, 3], "ranks 0-3"),
        ([0, 2, 3], "ranks 0, 2-3"),
        ([5, 0, 1, 3], "ranks 0-1, 3, 5"),
        ([2, 2], "rank 2"),
    ],
)
def test_fold_ranks(ranks: list[int], text: str) -> None:
    assert fold_ranks(ranks) == text


def test_fold_ranks_refuses_nothing() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        fold_ranks([])


def test_all_ranks_passing_is_a_pass_with_per_rank_sections() -> None:
    per_rank = passing(0, 1)
    per_rank[1][1] = rep("call", sections=[("Captured stdout call", "hi from 1\n")])
    merged = merge(per_rank, clean(0, 1), 2)
    assert [merged[p].outcome for p in ("setup", "call", "teardown")] == ["passed"] * 3
    assert merged["call"].sections == [("Captured stdout call [rank 1]", "hi from 1\n")]
    assert ("sprite.rank1", "passed") in merged["call"].user_properties


def test_one_failing_rank_fails_the_test_and_is_named() -> None:
    per_rank = passing(0, 1)
    per_rank[1][1] = rep("call", "failed", "AssertionError: boom")
    merged = merge(per_rank, clean(0, 1), 2, order=(1,))
    call = merged["call"]
    assert call.failed
    assert call.longrepr.reprcrash.message == "[rank 1] AssertionError: boom"
    assert "rank 1" in str(call.longrepr) and "rank 0" not in str(call.longrepr)


def test_identical_failures_fold_and_different_ones_do_not() -> None:
    per_rank = {r: [rep("setup"), rep("call", "failed", "same"), rep("teardown")] for r in range(4)}
    per_rank[2][1] = rep("call", "failed", "different")
    call = merge(per_rank, clean(0, 1, 2, 3), 4, order=(0, 1, 3, 2))["call"]
    groups = [ranks for ranks, _ in call.longrepr.groups]
    assert groups == [(0, 1, 3), (2,)]
    assert call.longrepr.reprcrash.message == "[ranks 0-1, 3] same (+1 more)"


def test_skip_only_when_every_rank_skipped() -> None:
    skipped = ("test_x.py", 3, "Skipped: no")
    all_skip = {r: [rep("setup", "skipped", skipped), rep("teardown")] for r in (0, 1)}
    assert merge(all_skip, clean(0, 1), 2)["setup"].skipped
    one_skip = passing(0, 1)
    one_skip[1] = [rep("setup"), rep("call", "skipped", skipped), rep("teardown")]
    call = merge(one_skip, clean(0, 1), 2)["call"]
    assert call.passed
    assert ("sprite", "rank 1 skipped, the others passed") in call.sections


def test_a_crash_synthesizes_a_failure_for_the_running_phase_and_comes_first() -> None:
    per_rank = passing(0)
    per_rank[0][1] = rep("call", "failed", "RuntimeError: connection closed by peer")
    per_rank[1] = [rep("setup")]
    ends = {0: RankEnd(rank=0, exitcode=0), 1: RankEnd(rank=1, signal=11, output_tail="about to crash")}
    merged = merge(per_rank, ends, 2, order=(0, 1))
    call = merged["call"]
    assert [ranks for ranks, _ in call.longrepr.groups] == [(1,), (0,)]
    text = str(call.longrepr)
    assert "rank 1 CRASHED with signal 11 (SIGSEGV) during call" in text
    assert "about to crash" in text


def test_a_setup_failure_on_one_rank_means_no_call_phase() -> None:
    per_rank = passing(0)
    per_rank[1] = []
    ends = {0: RankEnd(rank=0, exitcode=0), 1: RankEnd(rank=1, exitcode=3)}
    merged = merge(per_rank, ends, 2)
    assert set(merged) == {"setup", "teardown"}
    assert merged["setup"].failed
    assert "rank 1 exited with code 3 during setup before reporting its result" in str(
        merged["setup"].longrepr
    )


def test_a_rank_without_any_exit_status_is_reported_lost() -> None:
    merged = merge(passing(0), clean(0), 2)
    assert "its rank agent was lost during setup" in str(merged["setup"].longrepr)


def test_timeout_and_peer_failure_texts_carry_the_stacks() -> None:
    per_rank = {0: [rep("setup")], 1: [rep("setup"), rep("call", "failed", "ValueError: x")]}
    ends = {
        0: RankEnd(
            rank=0,
            ended_by="peer_failed",
            detail="5s after rank 1 failed (--rank-grace)",
            stacks=parse_stacks('File "t.py", line 9 in barrier'),
        ),
        1: RankEnd(rank=1, exitcode=0),
    }
    per_rank[1].append(rep("teardown"))
    call = merge(per_rank, ends, 2, order=(1, 0))["call"]
    text = str(call.longrepr)
    assert text.index("ValueError: x") < text.index("rank 0 was ended during call 5s after rank 1 failed")
    assert 'File "t.py", line 9 in barrier' in text


@pytest.mark.parametrize(
    ("whens", "phase"),
    [((), "setup"), (("setup",), "call"), (("setup", "call"), "teardown")],
)
def test_phase_in_progress(whens: tuple[str, ...], phase: str) -> None:
    assert phase_in_progress([rep(w) for w in whens]) == phase


def test_phase_after_a_failed_setup_is_teardown() -> None:
    assert phase_in_progress([rep("setup", "failed", "x")]) == "teardown"


def test_xfail_on_every_rank_keeps_wasxfail() -> None:
    per_rank = {r: [rep("setup"), rep("call", "skipped", ("f", 1, "xfail")), rep("teardown")] for r in (0, 1)}
    for reports in per_rank.values():
        reports[1].wasxfail = "known"  # type: ignore[attr-defined]
    assert merge(per_rank, clean(0, 1), 2)["call"].wasxfail == "known"  # type: ignore[attr-defined]


def test_a_failed_launch_shows_its_cause_once_and_folds_the_other_ranks() -> None:
    """A launch that failed for all 64 ranks is two groups, not 64 paragraphs: rank 0's cause, the rest."""
    ends = {
        r: RankEnd(
            rank=r,
            ended_by="agent_error",
            detail="mpiexec: the launch ended"
            if r == 0
            else "the launch failed before it started (rank 0 shows why)",
        )
        for r in range(64)
    }
    setup = merge({}, ends, 64)["setup"]
    assert [ranks for ranks, _ in setup.longrepr.groups] == [(0,), tuple(range(1, 64))]
    text = str(setup.longrepr.groups[1][1])
    assert (
        text
        == "its rank agent could not run the test: the launch failed before it started (rank 0 shows why)"
    )
