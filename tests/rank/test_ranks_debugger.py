"""The debugger on a rank: ``--pdb``, ``--trace`` and ``breakpoint()`` in the user's terminal, one rank at a time.

The sessions run in a pseudo terminal (``run_pytest_in_terminal``), typed into as a user would; without one
(pytester's stdin is not a terminal) the debugger says why in one line and every test ends as usual.
"""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Any, cast

import pytest
from sprite_testing import local_settings, run_pytest, run_pytest_in_terminal

from pytest_sprite.launch.controller import Controller
from pytest_sprite.launch.debug_relay import Lent, debugger_refusal
from pytest_sprite.launch.item_runs import _Run
from pytest_sprite.plumbing.timing import monotonic

pytestmark = pytest.mark.cpu

TIMEOUT = 120

terminal = partial(run_pytest_in_terminal, timeout=TIMEOUT)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_pdb_opens_in_the_failing_ranks_frame_and_breakpoint_on_rank_1(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_fails_on_rank_1(world):
            some_local = 40 + world.rank
            assert world.rank == 0

        @pytest.mark.ranks(2)
        def test_fails_on_both_ranks(world):
            assert world.rank < 0

        @pytest.mark.ranks(2)
        def test_stops_on_rank_1(world):
            value = 7 * (world.rank + 1)
            if world.rank == 1:
                breakpoint()
            world.barrier()
        """
    )
    session = terminal(pytester, "--pdb", "--ranks=2")
    shown = session.expect("(Pdb rank 1) ")
    assert (
        "PDB post-mortem on rank 1 of test_pdb_opens_in_the_failing_ranks_frame_and_breakpoint_on_rank_1.py"
        in shown
    )
    assert "AssertionError: assert 1 == 0" in shown, "the failure is shown before the prompt"
    session.send("p some_local")
    assert "\n41\n" in session.expect("(Pdb rank 1) ")
    session.send("c")
    session.expect("PDB continue (rank 1)")
    # Both ranks fail: pdb opens on the first one only, the other's failure is reported as usual.
    session.expect("::test_fails_on_both_ranks")
    session.expect("(Pdb rank ")
    session.send("c")
    shown = session.expect("(Pdb rank 1) ")
    assert "PDB set_trace on rank 1 of" in shown and "-> world.barrier()" in shown
    session.send("p value")
    assert "\n14\n" in session.expect("(Pdb rank 1) ")
    session.send("c")
    assert session.finish() == 1
    assert session.output.count("(Pdb rank ") == 5, session.output
    assert "2 failed, 1 passed" in session.output, session.output


@pytest.mark.slow  # CI covers each path above; this adds the order and q
def test_breakpoints_on_two_ranks_are_served_one_at_a_time_and_q_stops_the_session(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_both_stop(world):
            mine = 10 * world.rank
            breakpoint()
            world.barrier()

        @pytest.mark.ranks(2)
        def test_never_runs(world):
            pass
        """
    )
    session = terminal(pytester, "--ranks=2", "-v")
    found = re.search(r"PDB set_trace on rank (\d)", session.expect("(Pdb rank "))
    assert found is not None
    first = int(found[1])
    session.send("p mine")
    assert f"\n{10 * first}\n" in session.expect(f"(Pdb rank {first}) ")
    session.send("c")
    shown = session.expect(f"(Pdb rank {1 - first}) ")
    assert f"PDB continue (rank {first})" in shown and f"PDB set_trace on rank {1 - first}" in shown
    session.send("q")
    assert session.finish() == pytest.ExitCode.INTERRUPTED
    assert "Quitting debugger" in session.output
    assert "test_both_stop PASSED" in session.output and "test_never_runs" not in session.output


@pytest.mark.slow  # CI runs the bookkeeping below without waiting out a timeout
def test_a_debugger_held_open_past_the_rank_timeout_is_no_hang(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        import time

        @pytest.mark.ranks(2)
        def test_stops_on_rank_1(world):
            if world.rank == 1:
                breakpoint()
                time.sleep(1)  # still running when the debugger is left: a timeout that ran would end it
            world.barrier()
        """
    )
    session = terminal(pytester, "--ranks=2", "--rank-timeout=4")
    session.expect("(Pdb rank 1) ")
    time.sleep(5)  # the user reads the code for longer than the test may run
    session.send("c")
    assert session.finish() == 0, session.output
    assert "1 passed" in session.output


@pytest.mark.slow  # --pdb and breakpoint() take the same path in CI; this waits out the 3 s before a rank is lent
def test_trace_steps_over_a_collective_while_the_other_rank_is_served(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_traced(world):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """
    )
    session = terminal(pytester, "--trace", "--ranks=2")
    shown = session.expect("(Pdb rank ")
    found = re.search(r"PDB set_trace on rank (\d)", shown)
    assert found is not None and "-> t = torch.ones(1)" in shown
    first, other = int(found[1]), 1 - int(found[1])
    session.expect(") ")
    session.send("n")
    assert "-> dist.all_reduce(t)" in session.expect(f"(Pdb rank {first}) ")
    session.send("n")  # the all_reduce waits for the other rank, which waits for the terminal
    shown = session.expect(f"(Pdb rank {other}) ")
    assert f"(rank {first} runs on; another rank waits for the debugger)" in shown
    session.send("c")
    shown = session.expect(f"(Pdb rank {first}) ")
    assert f"(back to rank {first}, which was running)" in shown and "-> assert t.item() == 2" in shown
    session.send("c")
    assert session.finish() == 0, session.output


@pytest.mark.slow  # the same debugger as breakpoint(), made through torch's private hook (test_private_apis.py)
def test_torch_distributed_breakpoint_opens_on_its_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_torch_breakpoint(world):
            mine = 5 + world.rank
            dist.breakpoint(rank=1)
        """
    )
    session = terminal(pytester, "--ranks=2")
    assert "dist.breakpoint(rank=1)" in session.expect("(Pdb rank 1) ")
    session.send("up")
    session.expect("(Pdb rank 1) ")
    session.send("p mine")
    assert "\n6\n" in session.expect("(Pdb rank 1) ")
    session.send("c")
    assert session.finish() == 0, session.output


def test_without_a_terminal_the_debugger_says_why_and_every_test_ends(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_fails_on_rank_1(world):
            assert world.rank == 0

        @pytest.mark.ranks(2)
        def test_stops_on_rank_1(world):
            if world.rank == 1:
                breakpoint()
            world.barrier()
        """
    )
    result = run_pytest(pytester, "--pdb", "--ranks=2", "-rw", timeout=TIMEOUT)
    result.assert_outcomes(failed=1, passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-sprite: --pdb cannot open a debugger on a rank: stdin is not a terminal; "
            "the ranks tests run and report as usual",
            "*DebuggerUnavailableWarning: rank 1: breakpoint() returned at once, no debugger opens: "
            "stdin is not a terminal",
        ]
    )
    assert "(Pdb" not in result.stdout.str()


class _Pool:
    """Records what the controller sends its agents."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict[str, Any]]] = []

    def send(self, agent: int, command: str, payload: dict[str, Any]) -> None:
        self.sent.append((agent, command, payload))


def test_time_in_the_debugger_counts_against_no_timeout_and_q_stops_the_session(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = Controller(pytestconfig, local_settings(grace=1.0))
    now = monotonic()
    run = _Run(
        run_id=1, item=cast(Any, None), nextitem=None, n=2, timeout=3.0, timeout_source="--rank-timeout"
    )
    run.agents, run.started, run.first_failure = (0, 1), now - 2.5, now - 0.5
    controller.running[run.run_id] = run
    monkeypatch.setattr(controller.debug, "serve", lambda: Lent(seconds=60.0, quit={run.run_id}))
    monkeypatch.setattr("pytest_sprite.launch.run_events.monotonic", lambda: now + 60.0)
    controller.lend_terminal()
    pool = _Pool()
    controller.events.check_deadlines(cast(Any, pool), run)
    assert pool.sent == [], (
        "neither the timeout nor the grace period ran while the debugger held the terminal"
    )
    assert run.interrupted == "Quitting debugger"


class _Plugins:
    def __init__(self, *names: str) -> None:
        self.names = names

    def get_plugin(self, name: str) -> object | None:
        return object() if name in self.names else None


@pytest.mark.parametrize(
    ("worker", "plugins", "tty", "refusal"),
    [
        (False, ("terminalreporter",), True, ""),
        (False, ("terminalreporter",), False, "stdin is not a terminal"),
        (False, (), True, "pytest's terminal is off (-p no:terminal)"),
        (
            True,
            ("terminalreporter",),
            True,
            "a pytest-xdist worker has no terminal (-n0 runs the tests in the terminal's process)",
        ),
    ],
)
def test_each_reason_a_debugger_cannot_open(
    monkeypatch: pytest.MonkeyPatch, worker: bool, plugins: tuple[str, ...], tty: bool, refusal: str
) -> None:
    config: Any = type("Config", (), {"pluginmanager": _Plugins(*plugins)})()
    if worker:
        config.workerinput = {}
    monkeypatch.setattr("pytest_sprite.launch.debug_relay.stdin_is_terminal", lambda config: tty)
    assert debugger_refusal(config) == refusal
