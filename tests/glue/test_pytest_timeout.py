"""pytest-timeout on ranks tests: its timeout is the test's rank timeout, never a timer in the controller."""

from __future__ import annotations

import importlib.util

import pytest
from sprite_testing import run_pytest

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(importlib.util.find_spec("pytest_timeout") is None, reason="needs pytest-timeout"),
]

TIMEOUT = 240

BODY = """
import time
import pytest

@pytest.mark.ranks(2)
@pytest.mark.timeout(1)
def test_marked(world):
    if world.rank == 1:
        time.sleep(60)

@pytest.mark.ranks(2)
def test_by_the_session_option(world):
    if world.rank == 0:
        time.sleep(60)

def test_plain_stays_pytest_timeouts():
    time.sleep(60)

@pytest.mark.ranks(2)
def test_after_them(world):
    pass
"""


def test_the_marker_and_the_option_become_rank_timeouts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BODY)
    result = run_pytest(pytester, "-p", "timeout", "--timeout=2", timeout=TIMEOUT)
    result.assert_outcomes(failed=3, passed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*rank 1 was still running after the 1s timeout (from @pytest.mark.timeout(1)) (during call)*",
            "where the 2 ranks were*",
            "*rank 0 was still running after the 2s timeout (from --timeout=2) (during call)*",
        ]
    )
    assert "Timeout (>2.0s) from pytest-timeout" in out  # the plain test keeps pytest-timeout's own timer
    assert "INTERNALERROR" not in out


def test_the_sprite_option_wins_over_pytest_timeouts_session_timeout(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import time
        import pytest

        @pytest.mark.ranks(2)
        def test_hangs(world):
            time.sleep(60 if world.rank == 1 else 0)
        """
    )
    result = run_pytest(pytester, "-p", "timeout", "--timeout=100", "--rank-timeout=1", timeout=TIMEOUT)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*after the 1s timeout (from --rank-timeout)*"])


def test_two_timeouts_on_one_ranks_test_are_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2, timeout=5)
        @pytest.mark.timeout(3)
        def test_twice(world):
            pass
        """
    )
    result = run_pytest(pytester, "-p", "timeout", timeout=TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*test_twice: both @pytest.mark.ranks(timeout=5) and @pytest.mark.timeout(3) set its timeout; keep one*"
        ]
    )


def test_a_timeout_marker_that_is_not_seconds_is_refused_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        @pytest.mark.timeout("soon")
        def test_soon(world):
            pass
        """
    )
    result = run_pytest(pytester, "-p", "timeout", timeout=TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_soon: @pytest.mark.timeout('soon') is not a number of seconds*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
