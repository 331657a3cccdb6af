"""ranks("world"), --collective-check, and the collective a timed-out rank waits in (issue 9)."""

from __future__ import annotations

from functools import partial

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 180


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("SPRITE_COLLECTIVE_CHECK", raising=False)


run = partial(run_pytest, timeout=TIMEOUT)


WORLD_TESTS = """
    import pytest

    @pytest.mark.ranks("world")
    def test_whole(world):
        assert world.size == int(world.gather_object(world.size)[-1])
        print(f"WHOLE size={world.size}")

    @pytest.mark.ranks([1, 2, "world"])
    def test_below_and_whole(world):
        pass
"""


@pytest.mark.parametrize(
    ("ranks", "ids"),
    [
        (2, ["test_whole[ranks2]", "test_below_and_whole[ranks1]", "test_below_and_whole[ranks2]"]),
        pytest.param(
            4,
            [
                "test_whole[ranks4]",
                "test_below_and_whole[ranks1]",
                "test_below_and_whole[ranks2]",
                "test_below_and_whole[ranks4]",
            ],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_world_runs_on_the_sessions_world_and_shows_its_size(
    pytester: pytest.Pytester, ranks: int, ids: list[str]
) -> None:
    pytester.makepyfile(test_world=WORLD_TESTS)
    collected = run(pytester, f"--ranks={ranks}", "--co", "-q")
    collected.stdout.fnmatch_lines([f"test_world.py::{i.replace('[', '[[]')}" for i in ids])
    result = run(pytester, f"--ranks={ranks}", "-s")
    result.assert_outcomes(passed=len(ids))


def test_without_ranks_the_world_is_the_largest_size_a_marker_asks_for(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_world=WORLD_TESTS)
    collected = run(pytester, "--co", "-q")
    collected.stdout.fnmatch_lines(["test_world.py::test_whole[[]ranks-world[]]"])
    result = run(pytester, "-s")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*WHOLE size=2*"])


def test_world_without_a_world_size_says_how_to_give_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks("world")
        def test_whole(world):
            pass

        def test_plain():
            pass
        """
    )
    result = run(pytester, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            'SKIPPED [[]1[]] *: @pytest.mark.ranks("world") runs on the session\'s world, whose size nothing '
            "sets here: pass --ranks=W (or SPRITE_RANKS, or the ini option ranks)"
        ]
    )


MISMATCH = """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.ranks(2)
    def test_mismatch(world):
        dist.all_reduce(torch.ones(world.rank + 1))
"""


@pytest.mark.parametrize("switch", [["--collective-check"], ["-o", "collective_check=true"]])
def test_mismatched_all_reduce_fails_at_once_showing_both_shapes(
    pytester: pytest.Pytester, switch: list[str]
) -> None:
    pytester.makepyfile(MISMATCH)
    result = run(pytester, *switch, "--rank-timeout=120")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "still running after" not in out, "the check fails the test, not the timeout"
    result.stdout.fnmatch_lines_random(
        [
            "*Detected mismatch between collectives on ranks*",
            "*rank 0: ALLREDUCE #* shape [[]1[]] Float*",
            "*rank 1: ALLREDUCE #* shape [[]2[]] Float*",
        ]
    )


@pytest.mark.slow
def test_collective_check_from_the_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(MISMATCH)
    monkeypatch.setenv("SPRITE_COLLECTIVE_CHECK", "1")
    result = run(pytester, "--rank-timeout=120")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Detected mismatch between collectives on ranks*"])


def test_a_timeout_names_the_collective_each_rank_waits_in(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import time
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ranks(2, timeout=8)
        def test_hang(world):
            if world.rank == 0:
                dist.all_reduce(torch.ones(3))
            else:
                time.sleep(600)
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "ranks 0-1 were still running after the 8s timeout (from @pytest.mark.ranks(timeout=...)) (during call)*",
            "where the 2 ranks were*",
            "  rank 0: waiting in all_reduce (test_a_timeout_names_the_collective_each_rank_waits_in.py:9)*",
            "  rank 1: elsewhere, in time.sleep (test_a_timeout_names_the_collective_each_rank_waits_in.py:11)*",
        ]
    )
