"""Sub-worlds inside ranks tests: real pytest sessions whose tests start fresh worlds of their own."""

from __future__ import annotations

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 240

FUNCTIONS = """
import os
import torch
import torch.distributed as dist
from pytest_sprite.subworld import emit, kill_point, run_subworld

def where(world, base):
    t = torch.tensor([base + world.rank])
    dist.all_reduce(t)
    return (world.rank, world.size, t.item(), os.getpid(), os.environ["MASTER_PORT"])

def steps(world, n):
    for step in range(1, n + 1):
        emit("step", step)
        kill_point("step", step)
        dist.barrier()
    return "done"

def nest(world):
    return run_subworld(where, args=(0.0,))

def comm(pid):
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()

def names(world):
    return comm(os.getpid()), comm(os.getppid())
"""


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")


def test_sub_worlds_inside_ranks_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(subfns=FUNCTIONS)
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch.distributed as dist
        from pytest_sprite import KillAt, SubworldError, run_subworld
        from pytest_sprite.errors import SpriteUsageError
        from subfns import comm, names, nest, steps, where

        @pytest.mark.ranks(2)
        def test_results_from_every_rank(world):
            result = run_subworld(where, args=(1.0,))
            values = result.values()
            assert [v[:3] for v in values] == [(0, 2, 3.0), (1, 2, 3.0)]
            assert os.getpid() not in {v[3] for v in values}
            assert values[0][4] != os.environ["MASTER_PORT"]  # a fresh rendezvous
            assert world.gather_object(result.report()) == [result.report()] * 2  # the same on every rank
            assert dist.get_world_size() == 2  # the test's own process group is untouched

        @pytest.mark.ranks(4)
        def test_fewer_ranks(world):
            result = run_subworld(where, args=(0.0,), ranks=2)
            assert [v[:3] for v in result.values()] == [(0, 2, 1.0), (1, 2, 1.0)]

        @pytest.mark.ranks(2)
        def test_killed_at_a_step(world):
            result = run_subworld(steps, args=(5,), kill=KillAt(event="step", at=3, ranks=(1,)))
            assert result.killed() == [1]
            assert result.outcomes[1].emitted("step") == [1, 2, 3]
            assert result.outcomes[0].status == "ended"
            print(result.report())
            with pytest.raises(SubworldError):
                result.values()
            # the test carries on: another sub-world, then the test's own collective
            assert run_subworld(steps, args=(2,)).values() == ["done", "done"]
            world.barrier()

        @pytest.mark.ranks(2)
        def test_nested_refused(world):
            result = run_subworld(nest)
            assert {o.status for o in result.outcomes} == {"raised"}
            assert "run_subworld cannot be nested" in result.outcomes[0].error

        @pytest.mark.ranks(2)
        def test_more_ranks_than_the_test(world):
            with pytest.raises(SpriteUsageError, match=r"run_subworld\\(ranks=3\\): a sub-world has the same or fewer ranks than the test that starts it, which has 2"):
                run_subworld(where, args=(0.0,), ranks=3)

        def test_plain_test_is_a_world_of_its_own():
            assert [v[:3] for v in run_subworld(where, args=(2.0,), ranks=2).values()] == [(0, 2, 5.0), (1, 2, 5.0)]
            assert run_subworld(names).values() == [("sprite-subworld", comm(os.getpid()))]

        @pytest.mark.ranks(2)
        def test_processes_are_named_by_role(world):  # what ps -o comm and top show
            assert (comm(os.getpid()), comm(os.getppid())) == ("sprite-test", "sprite-agent")
            assert run_subworld(names).values() == [("sprite-subworld", "sprite-zygote")] * 2
        """
    )
    result = run_pytest(pytester, "--ranks=4", "-v", timeout=TIMEOUT)
    result.assert_outcomes(passed=7)


def test_what_sub_world_ranks_leave_running_is_ended_and_named(pytester: pytest.Pytester) -> None:
    """A test's zygote is forked on its first sub-world and leads a session of its own (issue 23): what the
    sub-world's ranks leave running is found there, ended and named with the test's leftovers; a test
    without a sub-world has no zygote and no leftover."""
    pytester.makepyfile(
        leaving="""
        import subprocess

        def leave_sleep(world):
            subprocess.Popen(["sleep", "67"])
            return world.rank
        """
    )
    pytester.makepyfile(
        """
        import pytest
        from pytest_sprite import run_subworld
        from leaving import leave_sleep

        @pytest.mark.ranks(2)
        def test_leaves(world):
            assert run_subworld(leave_sleep).values() == [0, 1]

        @pytest.mark.ranks(2)
        def test_no_sub_world(world):
            pass
        """
    )
    result = run_pytest(pytester, "--ranks=2", timeout=TIMEOUT)
    result.assert_outcomes(passed=2, warnings=2)
    text = result.stdout.str()
    assert text.count("left 1 process running after the test") == 2
    assert text.count("sleep 67 (ended by SIGTERM)") == 2
    assert "test_no_sub_world" not in text.split("warnings summary")[1]


def test_an_agent_forks_its_pristine_zygote_at_its_first_sub_world(pytester: pytest.Pytester) -> None:
    """A session pays for sub-worlds only once a test starts one (issue 23): until then every process an
    agent forked is a test child or its spare, each leading a session of its own; the first sub-world forks
    the agent's pristine zygote (which leads none), and later tests find that one still serving."""
    pytester.makepyfile(subfns=FUNCTIONS)
    pytester.makepyfile(
        """
        import os
        import time
        import pytest
        from pytest_sprite import run_subworld
        from subfns import where

        def zygotes_of_my_agent(expected):
            # A spare leads its session from its first statement: wait out one that was just forked.
            agent, deadline = os.getppid(), time.monotonic() + 20
            while True:
                children = set()
                for tid in os.listdir(f"/proc/{agent}/task"):
                    with open(f"/proc/{agent}/task/{tid}/children") as f:
                        children |= {int(pid) for pid in f.read().split()}
                others = []
                for pid in children - {os.getpid()}:
                    try:
                        if os.getsid(pid) != pid:
                            others.append(pid)
                    except ProcessLookupError:
                        pass
                if len(others) == expected or time.monotonic() > deadline:
                    return len(others)
                time.sleep(0.05)

        @pytest.mark.ranks(2)
        def test_before_any_sub_world(world):
            assert zygotes_of_my_agent(0) == 0

        @pytest.mark.ranks(2)
        def test_first_sub_world(world):
            assert [v[:3] for v in run_subworld(where, args=(1.0,)).values()] == [(0, 2, 3.0), (1, 2, 3.0)]
            assert zygotes_of_my_agent(1) == 1

        @pytest.mark.ranks(2)
        def test_after(world):
            assert zygotes_of_my_agent(1) == 1
            assert [v[:3] for v in run_subworld(where, args=(2.0,)).values()] == [(0, 2, 5.0), (1, 2, 5.0)]
        """
    )
    result = run_pytest(pytester, "--ranks=2", timeout=TIMEOUT)
    result.assert_outcomes(passed=3)


def test_returned_ranks_are_done_before_their_exits_and_end_before_the_test(
    pytester: pytest.Pytester,
) -> None:
    """A ranks test's sub-world is over once its ranks returned and closed their channels (their zygote
    reports the exits later); the test's teardown waits for those exits, so twenty sub-worlds in a row leave
    no rank running and no leftover warning."""
    pytester.makepyfile(
        """
        import os
        import pytest
        from pytest_sprite import run_subworld
        from pytest_sprite.subworld import zygote

        def pid(world):
            return os.getpid()

        @pytest.mark.ranks(2)
        def test_many(world):
            pids = []
            for _ in range(20):
                result = run_subworld(pid)
                assert [o.exitcode for o in result.outcomes] == [0, 0]
                pids += result.values()[world.rank : world.rank + 1]
            zygote.settle_zygote_ranks()
            assert zygote.current_zygote(world.rank)._live == set()
            for p in pids:  # reaped by the zygote: gone
                with pytest.raises(ProcessLookupError):
                    os.kill(p, 0)
        """
    )
    result = run_pytest(
        pytester, "--ranks=2", "-W", "error::pytest_sprite.errors.LeftoverProcessWarning", timeout=TIMEOUT
    )
    result.assert_outcomes(passed=1, warnings=0)
