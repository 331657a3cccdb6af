"""End-to-end behaviour of ranks tests, as users meet it: real pytest sessions with real ranks."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from sprite_testing import fnescape, run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 180


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short-summary lines keep their message only when they fit the terminal."""
    monkeypatch.setenv("COLUMNS", "240")


run = partial(run_pytest, timeout=TIMEOUT)


def test_collectives_pass_at_two_and_four_ranks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest
        from pytest_sprite import collected

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_protocol(item):
            result = yield
            for name, tensors in collected(item).items():
                print(f"COLLECTED {item.name} {name} {[t.tolist() for t in tensors]}")
            return result

        def pytest_sessionfinish(session):
            import torch.distributed as dist
            print(f"CONTROLLER_PG_INITIALIZED={dist.is_initialized()}")
        """
    )
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_two(world):
            assert (world.size, dist.get_world_size(), dist.get_rank()) == (2, 2, world.rank)
            assert os.environ["RANK"] == str(world.rank) and os.environ["WORLD_SIZE"] == "2"
            assert os.environ["LOCAL_RANK"] == str(world.local_rank)
            t = torch.tensor([world.rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == 3.0
            assert [g.item() for g in world.gather(torch.tensor([world.rank]))] == [0, 1]
            assert world.gather_object({"r": world.rank}) == [{"r": 0}, {"r": 1}]
            assert world.run_on_rank(1, lambda: world.rank * 10) == 10
            world.barrier()
            world.collect("rank_plus_one", torch.tensor([world.rank + 1.0]))

        @pytest.mark.ranks(4)
        def test_four(world):
            t = torch.ones(3) * world.rank
            dist.all_reduce(t)
            assert t.tolist() == [6.0, 6.0, 6.0]
            assert world.gather(torch.arange(world.rank + 1))[3].tolist() == [0, 1, 2, 3]

        def test_plain_world_of_one(world):
            assert (world.rank, world.size, world.distributed) == (0, 1, False)
            assert not dist.is_initialized()
            world.collect("solo", torch.tensor([7.0]))
        """
    )
    result = run(pytester, "-s")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "*" + fnescape("COLLECTED test_two rank_plus_one [[1.0], [2.0]]") + "*",
            "*" + fnescape("COLLECTED test_plain_world_of_one solo [[7.0]]") + "*",
            "*CONTROLLER_PG_INITIALIZED=False*",
        ]
    )


def test_failure_on_one_rank_is_labelled_and_identical_failures_fold(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_only_rank_one(world):
            assert world.rank != 1, "rank one disagrees"

        @pytest.mark.ranks(4)
        def test_everyone(world):
            assert False, "same everywhere"

        @pytest.mark.ranks(2)
        def test_after():
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=2, passed=1)
    out = result.stdout.str()
    only = out.split("test_only_rank_one")[1].split("test_everyone")[0]
    assert "-- rank 1 --" in only.replace("-" * 3, "--") or "rank 1" in only
    assert "rank 0" not in only
    result.stdout.fnmatch_lines(
        [
            "*- ranks 0-3 -*",
            "FAILED test_*::test_only_rank_one - [[]rank 1[]] AssertionError: rank one disagrees*",
            "FAILED test_*::test_everyone - [[]ranks 0-3[]] AssertionError: same everywhere*",
        ]
    )


def test_crashes_name_rank_phase_and_signal_and_the_next_test_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os, signal
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def exit_in_setup(world):
            if world.rank == 1:
                print("about to exit in setup")
                os._exit(3)

        @pytest.fixture
        def kill_in_teardown(world):
            yield
            if world.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)

        @pytest.mark.ranks(2)
        def test_segv_in_call(world):
            if world.rank == 1:
                print("about to segfault")
                os.kill(os.getpid(), signal.SIGSEGV)
            dist.barrier()

        @pytest.mark.ranks(2)
        def test_next_1(world):
            dist.barrier()

        @pytest.mark.ranks(2)
        def test_exit_in_setup(exit_in_setup):
            pass

        @pytest.mark.ranks(2)
        def test_next_2(world):
            dist.barrier()

        @pytest.mark.ranks(2)
        def test_kill_in_teardown(kill_in_teardown):
            pass

        @pytest.mark.ranks(2)
        def test_next_3(world):
            dist.barrier()
        """
    )
    result = run(pytester, "--rank-grace=2", "-v")
    # The teardown crash test's call passed; its teardown is the error.
    result.assert_outcomes(passed=4, failed=1, errors=2)
    result.stdout.fnmatch_lines_random(
        ["*test_next_1 PASSED*", "*test_next_2 PASSED*", "*test_next_3 PASSED*"]
    )
    # The crashed rank is shown first: it is the cause, its peers' gloo errors the consequence.
    result.stdout.fnmatch_lines(
        ["FAILED *::test_segv_in_call - [[]rank 1[]] rank 1 CRASHED with signal 11 (SIGSEGV) during call*"]
    )
    out = result.stdout.str()
    for line in (
        "rank 1 CRASHED with signal 11 (SIGSEGV) during call",
        "about to segfault",
        "rank 1 exited with code 3 during setup before reporting its result",
        "about to exit in setup",
        "rank 0 CRASHED with signal 9 (SIGKILL) during teardown",
    ):
        assert line in out, line


def test_a_rank_killed_right_after_the_ready_barrier_is_the_cause_and_its_peer_only_lost_it(
    pytester: pytest.Pytester,
) -> None:
    """The ready handshake is a barrier (issue 20): rank 0 dies as its setup starts, 20 times over.

    Before the barrier, rank 1 could still be inside rank 0's store when rank 0 died, and failed
    with its own setup error (``DistNetworkError: Connection reset by peer``).
    """
    pytester.makepyfile(
        """
        import os, signal
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.fixture(autouse=True)
        def die_on_rank_0(world):
            if world.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)

        @pytest.mark.ranks(2)
        @pytest.mark.parametrize("attempt", range(20))
        def test_peer_dies(world, attempt):
            dist.all_reduce(torch.ones(1))
        """
    )
    result = run(pytester, "--rank-grace=2", "-rE")
    result.assert_outcomes(errors=20)
    out = result.stdout.str()
    assert out.count("rank 0 CRASHED with signal 9 (SIGKILL) during setup") >= 20
    summary = [line for line in out.splitlines() if line.startswith("ERROR ")]
    assert len(summary) == 20
    for line in summary:
        assert "[rank 0] rank 0 CRASHED with signal 9 (SIGKILL) during setup" in line, line
    # Rank 1's failure is only ever a lost peer: never an error of its own.
    lines = out.splitlines()
    rank_1 = [lines[i + 1] for i, line in enumerate(lines) if line.strip("- ") == "rank 1"]
    assert len(rank_1) == 20
    assert all(line.startswith("rank 1 lost its peer: rank 0 crashed with signal 9") for line in rank_1), (
        rank_1
    )


def test_hang_dumps_every_rank_stack_and_the_next_test_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import time
        import pytest
        import torch.distributed as dist

        def wait_forever():
            time.sleep(1000)

        @pytest.mark.ranks(2, timeout=8)
        def test_rank0_skips_the_collective(world):
            if world.rank == 0:
                wait_forever()
            dist.barrier()

        @pytest.mark.ranks(2)
        def test_next(world):
            dist.barrier()
        """
    )
    result = run(pytester, "-v")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*test_next PASSED*"])
    out = result.stdout.str()
    # One roll call for both ranks (issue 27): where each was, then one stack per distinct stack.
    block = out.split("- ranks 0-1 -")[1].split("test_next")[0]
    assert (
        "ranks 0-1 were still running after the 8s timeout (from @pytest.mark.ranks(timeout=...)) (during call)"
        in block
    )
    assert (
        "  rank 0: elsewhere, in time.sleep (test_hang_dumps_every_rank_stack_and_the_next_test_passes.py:6)"
        in block
    )
    assert (
        "  rank 1: waiting in barrier (test_hang_dumps_every_rank_stack_and_the_next_test_passes.py:12)"
        in block
    )
    assert "stacks of rank 0 (most recent call first)" in block
    assert '.py", line 6 in wait_forever' in block
    assert "stacks of rank 1 (most recent call first)" in block
    assert "in barrier" in block
    assert "pluggy" not in block, "harness frames are stripped from the stacks"


def test_a_failed_rank_ends_its_waiting_peers_after_the_grace_period(pytester: pytest.Pytester) -> None:
    # Rank 1 fails but its process lives on (a slow teardown), so no transport error wakes the
    # ranks waiting in the collective: only the grace period does, long before the timeout.
    pytester.makepyfile(
        """
        import time
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def slow_teardown_on_rank1(world):
            yield
            if world.rank == 1:
                time.sleep(1000)

        @pytest.mark.ranks(3, timeout=600)
        def test_rank1_raises_before_the_collective(world, slow_teardown_on_rank1):
            if world.rank == 1:
                raise RuntimeError("rank 1 gave up")
            dist.barrier()
        """
    )
    result = run(pytester, "--rank-grace=1")
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*- rank 1 -*",
            "*RuntimeError: rank 1 gave up*",
            "*- ranks 0, 2 -*",
            "*ranks 0, 2 were ended during call 1s after rank 1 failed (--rank-grace)*",
            "*ranks 0, 2: waiting in barrier (*.py:15)*",
            "*rank 1: elsewhere, in time.sleep (*.py:9), after its call failed*",
        ]
    )
    assert "600s timeout" not in result.stdout.str()


def test_skips_and_xfails_on_every_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_skip_everywhere(world):
            pytest.skip("not on this cluster")

        @pytest.mark.ranks(2)
        def test_skip_on_one_rank_only(world):
            if world.rank == 1:
                pytest.skip("only rank 1")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(reason="known gap", strict=True)
        def test_xfail(world):
            assert False

        @pytest.mark.ranks(2)
        @pytest.mark.skip(reason="marked")
        def test_marked_skip(world):
            raise AssertionError("never runs")
        """
    )
    result = run(pytester, "-rsx")
    result.assert_outcomes(skipped=2, passed=1, xfailed=1)
    result.stdout.fnmatch_lines_random(["*not on this cluster*", "*marked*", "*known gap*"])


def test_parametrized_world_sizes_and_skips_beyond_the_world(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.ranks([1, 2, 4])
        def test_sizes(world):
            assert dist.get_world_size() == world.size

        @pytest.mark.ranks(3)
        def test_three(world):
            pass
        """
    )
    only_two = run(pytester, "--ranks=2", "-k", "ranks2")
    only_two.assert_outcomes(passed=1, deselected=3)
    result = run(pytester, "--ranks=2", "-v", "-rs")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines_random(
        [
            "*test_sizes?ranks1? PASSED*",
            "*test_sizes?ranks2? PASSED*",
            "*test_sizes?ranks4? SKIPPED*",
            "*needs 4 ranks, the world has 2 (--ranks=2); run with --ranks=4 or more to include it*",
            "*needs 3 ranks, the world has 2 (--ranks=2); run with --ranks=3 or more to include it*",
        ]
    )


def test_exitfirst_keyword_and_last_failed_behave_as_in_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_a_fails(world):
            assert world.rank == 0

        @pytest.mark.ranks(2)
        def test_b_passes(world):
            pass
        """
    )
    first = run_pytest(pytester, "-x", timeout=TIMEOUT, cache=True)
    first.assert_outcomes(failed=1)
    only_b = run_pytest(pytester, "-k", "b_passes", timeout=TIMEOUT, cache=True)
    only_b.assert_outcomes(passed=1, deselected=1)
    last_failed = run_pytest(pytester, "--lf", "-v", timeout=TIMEOUT, cache=True)
    last_failed.assert_outcomes(failed=1)
    assert "test_b_passes" not in last_failed.stdout.str()


def test_child_keyboard_interrupt_ends_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_interrupted(world):
            if world.rank == 1:
                raise KeyboardInterrupt

        @pytest.mark.ranks(2)
        def test_never_runs(world):
            pass
        """
    )
    result = run(pytester, "-v")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "*rank 1 got KeyboardInterrupt during call, which ends the session*",
            "*KeyboardInterrupt on rank 1*",
        ]
    )
    assert "test_never_runs PASSED" not in result.stdout.str()


def test_disabling_the_plugin_runs_tests_as_plain_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_runs_once_in_process():
            import torch.distributed as dist
            assert not dist.is_initialized()
        """
    )
    result = run_pytest(
        pytester, "-p", "no:sprite", "-W", "ignore::pytest.PytestUnknownMarkWarning", timeout=TIMEOUT
    )
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("pack", ["off", "on"])
def test_in_process_fixtures_are_torn_down_around_ranks_tests(pytester: pytest.Pytester, pack: str) -> None:
    pytester.makepyfile(
        test_a="""
        import pytest

        @pytest.fixture(scope="module")
        def module_resource():
            yield "a"
            print("TORN DOWN a")

        def test_in_process(module_resource):
            assert module_resource == "a"

        @pytest.mark.ranks(2)
        def test_ranks_last_in_module(world):
            pass
        """,
        test_b="""
        def test_next_module_in_process():
            pass
        """,
    )
    result = run(pytester, "-s", "-v", f"--pack={pack}")
    result.assert_outcomes(passed=3)
    if pack == "off":
        result.stdout.fnmatch_lines(
            ["*test_ranks_last_in_module PASSED*TORN DOWN a*", "*test_next_module_in_process PASSED*"]
        )
    else:
        # Packed, the ranks test is logged when it finishes, which may be after the next module's test:
        # module a is still torn down once that test has started, before the next module's test.
        result.stdout.fnmatch_lines(["*TORN DOWN a*", "*test_next_module_in_process PASSED*"])
        result.stdout.fnmatch_lines(["*test_ranks_last_in_module PASSED*"])


def test_capture_off_shows_every_ranks_output_marked_with_its_test_and_rank(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_prints(world):
            print(f"hello from rank {world.rank}")
        """
    )
    result = run(pytester, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines_random(
        [
            "[[]test_capture_off_shows_every_ranks_output_marked_with_its_test_and_rank.py::test_prints rank 0[]] "
            "hello from rank 0",
            "[[]test_capture_off_shows_every_ranks_output_marked_with_its_test_and_rank.py::test_prints rank 1[]] "
            "hello from rank 1",
        ]
    )


def test_a_lost_agent_fails_its_test_and_leaves_no_rank_behind(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os, signal, time
        import pytest
        import torch.distributed as dist

        @pytest.mark.ranks(2, timeout=120)
        def test_rank1_kills_its_agent(world):
            if world.rank == 1:
                with open("rank1.pid", "w") as fh:
                    fh.write(str(os.getpid()))
                # the agent relays the setup report before the kill; a loss before it arrives is "during setup"
                time.sleep(1)
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(1000)  # dies with its agent, not after this sleep
            dist.barrier()

        @pytest.mark.ranks(2)
        def test_next(world):
            dist.barrier()
        """
    )
    result = run(pytester, "--rank-grace=2", "-v")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines_random(
        ["*rank 1: its rank agent was lost during call*", "*test_next PASSED*"]
    )
    pid = int((pytester.path / "rank1.pid").read_text())
    assert not Path(f"/proc/{pid}").exists(), "the rank whose agent died is still running"


def test_each_rank_finds_the_child_hooks_bound_to_its_own_test(pytester: pytest.Pytester) -> None:
    """The child's hooks are registered once in the agent (issue 23) and bound in each child to its test:
    two tests on the same two agents each see their own test and rank, nothing left from the other."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        @pytest.mark.parametrize("i", range(2))
        def test_bound(world, request, i):
            session = request.config.pluginmanager.get_plugin("sprite-child")
            assert session.bound
            assert (session.spec["rank"], session.spec["nodeid"]) == (world.rank, request.node.nodeid)
        """
    )
    result = run(pytester, "--pack=off")
    result.assert_outcomes(passed=2)


def test_each_rank_inherits_its_items_location(pytester: pytest.Pytester) -> None:
    """pytest works out ``Item.location`` on first use, per process: the local launcher does it before it forks,
    so a test child finds it made before its first report needs it (issue 23)."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(item):
            item.stash_location_was_inherited = "location" in item.__dict__
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_location(world, request):
            assert request.node.stash_location_was_inherited
        """
    )
    run(pytester).assert_outcomes(passed=1)


def test_the_last_ranks_test_has_no_spare_child_forked_after_it(pytester: pytest.Pytester) -> None:
    """An agent forks the next test's child while a test runs; after the session's last ranks test nothing
    would take it (issue 23). A test that comes anyway gets a child forked when it starts."""
    pytester.makepyfile(
        """
        import os
        import time
        import pytest

        def alive_siblings():
            # Children of this rank's agent still running, besides this one: the spare it forked for a
            # later test, or an earlier test's child still exiting (a zombie once it has).
            agent, alive = os.getppid(), []
            for tid in os.listdir(f"/proc/{agent}/task"):
                with open(f"/proc/{agent}/task/{tid}/children") as f:
                    for pid in {int(pid) for pid in f.read().split()} - {os.getpid()}:
                        try:
                            with open(f"/proc/{pid}/stat", "rb") as stat:
                                if stat.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                                    alive.append(pid)
                        except OSError:
                            pass
            return len(alive)

        def spares_of_my_agent(expected):
            deadline = time.monotonic() + 20  # an earlier test's child may take a moment to exit
            while alive_siblings() != expected and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # and it stays so
            return alive_siblings()

        @pytest.mark.ranks(2)
        def test_first(world):
            assert spares_of_my_agent(1) == 1

        @pytest.mark.ranks(2)
        def test_last(world):
            assert spares_of_my_agent(0) == 0
        """
    )
    run(pytester).assert_outcomes(passed=2)
    # The last test run once more after it (as pytest-rerunfailures does): it gets children forked then.
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_protocol(item, nextitem):
            result = yield
            if nextitem is None and not hasattr(item, "ran_again"):
                item.ran_again = True
                item.ihook.pytest_runtest_protocol(item=item, nextitem=None)
            return result
        """
    )
    run(pytester, "--pack=off").assert_outcomes(passed=3)


def test_a_session_without_assertions_loads_no_assertion_tables(pytester: pytest.Pytester) -> None:
    """What the report forms need for assertions is imported only when a test made one (issue 23)."""
    pytester.makeconftest(
        """
        import sys

        def pytest_unconfigure(config):
            loaded = sorted(m for m in sys.modules if m in ("pytest_sprite.report.kinds", "pytest_sprite.report.terminal"))
            print(f"LOADED {loaded}")
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_plain(world):
            pass
        """
    )
    result = run(pytester, "-s", "--junitxml=out.xml")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["LOADED []"])
    assert 'name="sprite.rank1" value="passed"' in (pytester.path / "out.xml").read_text()
