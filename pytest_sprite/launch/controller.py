"""Controller: the pytest plugin of the process the user started, and its one event loop.

It starts the agent pool once per session (lazily, at the first ranks test), places each ranks test
on free agents (the packing scheduler, ``schedule.py``), consumes their events from the pool's queue
(the only consumer), enforces each test's timeout and the grace period after a failed rank, and logs
one merged result per phase as each test finishes.

With ``--pack=on`` (the default) the controller runs the test loop itself, as xdist's DSession does:
tests start in collection order, several ranks tests are in flight at once, each on its own agents,
and a finished ranks test goes through ``pytest_runtest_protocol`` (whose implementation here logs
its merged reports), so wrappers of that hook see it complete. Ordinary tests run in this process
between starts, as before. ``--pack=off`` keeps pytest's own loop and runs one ranks test at a time.
"""

from __future__ import annotations

import contextlib
import queue
from typing import Any, Final

import pytest

from ..errors import LaunchError, SpriteUsageError
from ..glue.around import around_ranks_key
from ..glue.options import Settings
from ..glue.pytest_internals import teardown_controller_state
from ..glue.tmp_path import TMP_FIXTURES, make_test_dir
from ..plumbing.coverage import combine_rank_data, session_started
from ..plumbing.distribution import importable
from ..plumbing.process import note_tests_ran_here
from ..plumbing.protocol import (
    AGENT_EVENTS,
)
from ..plumbing.timing import monotonic, wall
from .debug_relay import DebugRelay
from .early_failures import EarlyFailures
from .item_runs import (
    _hypothesis_seed,
    _Run,
    beyond_world_key,
    finished_run_key,
    item_timeout,
    item_world_size,
    launches_early,
    size_items,
    usable_cores,
    world_size_key,
)
from .mutant_runs import MutantRuns
from .pool import AgentPool
from .rank_end import RankEnd
from .reporting import log_run, log_warnings, merge_run
from .run_events import RunEvents
from .schedule import Scheduler, Utilisation

__all__ = ["Controller", "item_timeout", "item_world_size", "world_size_key"]

# The bookkeeping of a run lives in runs.py and the logging in reporting.py; ``launches_early``,
# ``usable_cores``, ``beyond_world_key`` and ``finished_run_key`` stay importable from here.

TORCH_MISSING: Final = (
    "ranks tests need torch, which is not installed in this environment: "
    "pip install torch (or your site's build)"
)
torch_missing_key = pytest.StashKey[str]()
"""Set on a ranks item when torch cannot be imported here: the item fails at setup with the stored line."""


class Controller:
    """Pytest plugin object of the controlling process (registered as ``sprite-controller``)."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        # An xdist worker's test loop is driven by its controller's commands, one item at a time: taking the
        # loop over there would starve the worker, so its ranks tests run one at a time (each worker still
        # has its own agents, so -n 2 runs two ranks tests at once).
        self.pack = settings.pack and not hasattr(config, "workerinput")
        self.world_size: int | None = settings.world_size
        self.pool: AgentPool | None = None
        self.early: AgentPool | None = None
        """A world launched before collection (:meth:`launch_early`), until the first ranks test takes it."""
        self.scheduler: Scheduler[int] | None = None
        self.items: dict[str, pytest.Item] = {}
        self.last_ranks_test: str | None = None
        """The session's last ranks test: its agents need no spare child for a test after it."""
        self.queued: dict[int, _Run] = {}
        """Submitted and not started, by run id."""
        self.running: dict[int, _Run] = {}
        """Started and not finished, by run id."""
        self.on_agent: dict[int, int] = {}
        """Agent rank -> run id of the test it runs."""
        self.use = Utilisation()
        self.interrupt: str | None = None
        self.collect_errors: set[str] = set()
        """Node ids this process failed to collect: a launched agent's own errors beyond these are shown."""
        self.differing = EarlyFailures()
        self.exit_code: int | None = None
        """With :attr:`interrupt`: the code of a rank's ``pytest.exit``, None for a KeyboardInterrupt."""
        self._run_ids = 0
        self.hypothesis_seed = _hypothesis_seed(config)
        session_started()  # before any agent is forked: where the ranks of a measured session write
        self.mutants = MutantRuns(config, settings)
        """``--sprite-mutate``: each test's mutant runs and the book of what they killed."""
        self.events = RunEvents(config, settings)
        """What each event of a running test's ranks does to its run, and how its ranks are ended."""
        self.debug = DebugRelay(config)
        """The user's terminal lent to a rank's pdb (``--pdb``, ``--trace``, ``breakpoint()``)."""

    # -- hooks (each hands off to a method) ---------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self) -> None:
        self.launch_early()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.add(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.plan(items)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool | None:
        if not self.pack or not any(self._ranks_size(item) for item in session.items):
            return None  # pytest's own loop: one ranks test at a time, in its protocol call
        return self.packed_loop(session)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        run = item.stash.get(finished_run_key, None)
        if run is not None:  # packed: the loop hands over a test that has finished
            self.log(run)
            return True
        n = self._ranks_size(item)
        if n is None:
            note_tests_ran_here()
            return None
        self.run_alone(item, nextitem, n)
        return True

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if torch_missing_key in item.stash:  # runs here, failing before its fixtures import torch
            pytest.fail(item.stash[torch_missing_key], pytrace=False)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.shutdown()
        combine_rank_data()
        self.mutants.verdict(session)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        line = self.use.line(pack=self.pack)
        if line is not None:
            terminalreporter.write_line(line)

    # -- planning ----------------------------------------------------------------------------

    def plan(self, items: list[pytest.Item]) -> None:
        """Record each item's world size and skip those that need more ranks than the world."""
        self.world_size = size_items(items, self.world_size)
        if not importable("torch"):  # the plugin installs without torch; a rank cannot start without it
            for item in items:
                if self._ranks_size(item):
                    item.stash[torch_missing_key] = TORCH_MISSING
        self.items = {item.nodeid: item for item in items}
        self.last_ranks_test = next((item.nodeid for item in reversed(items) if self._ranks_size(item)), None)
        if not any(self._ranks_size(item) for item in items):
            self.close_early()  # nothing selected runs on the world: free its cores for the tests that run
            return
        self.debug.say_refusal()
        if self.settings.launcher == "local" and not self.config.option.collectonly:
            # Fork the agents before a test computes here: a fork cannot use the OpenMP thread pool a
            # test may start (computing_before_fork). A failed launch is reported by the first ranks test.
            with contextlib.suppress(Exception):
                self.ensure_scheduler()

    @staticmethod
    def _ranks_size(item: pytest.Item) -> int | None:
        """The ranks a test runs on in the agents, None for a test that runs here (ordinary, or skipped)."""
        n = item.stash.get(world_size_key, None)
        return None if n is None or beyond_world_key in item.stash or torch_missing_key in item.stash else n

    # -- the loops -----------------------------------------------------------------------------

    def packed_loop(self, session: pytest.Session) -> bool:
        """pytest's ``pytest_runtestloop`` with ranks tests side by side.

        Every test starts in collection order: a ranks test is queued and this waits until it has
        started (the scheduler's head reserves the world, so it is never starved), then moves on;
        an ordinary test runs here when every test before it has started. Finished ranks tests are
        logged between starts. ``-x`` / ``--maxfail`` / an interrupt: the tests in flight finish and
        are logged, nothing new starts.
        """
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(
                f"{session.testsfailed} error{'s' if session.testsfailed != 1 else ''} during collection"
            )
        if session.config.option.collectonly:
            return True
        try:
            for i, item in enumerate(session.items):
                nextitem = session.items[i + 1] if i + 1 < len(session.items) else None
                n = self._ranks_size(item)
                if n is not None:
                    run = self.submit(item, nextitem, n)
                    teardown_controller_state(item, nextitem)
                    while run.run_id in self.queued and not self._stopping(session):
                        self.pump(timeout=0.1)
                else:
                    self.pump(timeout=0)
                    if not self._stopping(session):
                        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
                if self._stopping(session):
                    break
            self.drain()
        except KeyboardInterrupt:
            self.shutdown()
            raise
        if self.interrupt:
            pytest.exit(self.interrupt, returncode=self._exit_code())
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        return True

    def run_alone(self, item: pytest.Item, nextitem: pytest.Item | None, n: int) -> None:
        """``--pack=off``: run ``item`` on agents 0..n-1 and log it before the next test starts."""
        run = self.submit(item, nextitem, n)
        try:
            while not run.done:  # under --sprite-mutate: until its mutant runs have ended too
                self.pump(timeout=0.1)
        except KeyboardInterrupt:
            self.shutdown()
            raise
        self.log(run)
        teardown_controller_state(item, nextitem)
        if run.interrupted:
            pytest.exit(run.interrupted, returncode=self._exit_code())

    def _exit_code(self) -> int:
        """The status an interrupted session ends with: a rank's ``pytest.exit`` code, else pytest's 2."""
        return int(pytest.ExitCode.INTERRUPTED) if self.exit_code is None else self.exit_code

    def _stopping(self, session: pytest.Session) -> bool:
        """True once nothing new may start; drops the queue the first time."""
        stopping = bool(session.shouldfail or session.shouldstop or self.interrupt)
        if stopping and self.queued:
            if self.scheduler is not None:
                self.scheduler.stop()
            dropped = [run for run in self.queued.values() if run.mutant is not None]
            self.queued.clear()
            for run in dropped:  # their tests are still logged, without the mutants that never ran
                self._mutant_finished(run, dropped=True)
        return stopping

    def drain(self) -> None:
        """Wait until every test submitted has finished and been logged (none queued starts once stopped)."""
        while self.running or self.queued:
            self.pump(timeout=0.1)

    # -- submitting and starting -----------------------------------------------------------------

    def submit(
        self, item: pytest.Item, nextitem: pytest.Item | None, n: int, *, mutant: str | None = None
    ) -> _Run:
        """Queue ``item`` behind every test submitted before it and start what can start; ``mutant``: a
        ``--sprite-mutate`` run of the item under that mutant."""
        timeout, source = item_timeout(item, self.settings)
        self._run_ids += 1
        run = _Run(
            run_id=self._run_ids,
            item=item,
            nextitem=nextitem,
            n=n,
            timeout=timeout,
            timeout_source=source,
            mutant=mutant,
        )
        self.queued[run.run_id] = run
        try:
            scheduler = self.ensure_scheduler()
        except (LaunchError, SpriteUsageError) as exc:
            self._launch_failed(run, exc)
            return run
        scheduler.submit(run.run_id, n)
        self._start_ready()
        return run

    def launch_early(self) -> None:
        """Launch the world now, while this process collects, when nothing needs collection to do it.

        A launched agent (every launcher but local) starts a pytest session of its own and collects the
        tests itself: on a cluster's shared file system that takes as long as this process's collection,
        often tens of seconds. Launched after this process has collected, the two add up; launched
        before, they overlap. This needs the world's size before collection (``--ranks``). Local agents
        are forks that inherit the collected items, so they start at the first ranks test as before. A
        launch that fails here is dropped: the first ranks test launches again and reports the error. A
        world that no selected test needs is ended when collection ends (:meth:`plan`), without waiting
        for agents still starting. ``--launch-early`` decides (:func:`launches_early`).
        """
        if self.pool is not None or self.early is not None or self.world_size is None:
            return
        if not launches_early(
            self.settings, collect_only=self.config.option.collectonly, cores=usable_cores()
        ):
            return
        pool = AgentPool(self.config, self.settings, self.world_size, {})
        try:
            pool.launch()
        except Exception:  # reported by the first ranks test, which launches again
            pool.close()
            return
        self.early = pool

    def close_early(self) -> None:
        """End a world launched before collection that no test has taken (no-op without one)."""
        if self.early is not None:
            self.early.close()
            self.early = None

    def ensure_scheduler(self) -> Scheduler[int]:
        """The scheduler over a started pool; starts the pool at the first ranks test (or takes the early one)."""
        if self.pool is None:
            assert self.world_size is not None
            pool = self.early or AgentPool(self.config, self.settings, self.world_size, self.items)
            self.early = None
            pool.items = self.items  # an early pool was made before collection
            try:
                if not pool.launched:
                    pool.launch()
                self.use.open(self.world_size, pool.launched_at)
                pool.connect()
            except BaseException:
                pool.close()
                self.use.close(monotonic())
                raise
            self.pool = pool
            # No agent yet: each joins the scheduler as it connects (an agent_ready event).
            self.scheduler = Scheduler([], pack=self.pack, world_size=self.world_size)
        assert self.scheduler is not None
        return self.scheduler

    def _replace_pool(self) -> None:
        """A lost agent broke the pool and nothing runs on it any more: launch a fresh one for the queue."""
        assert self.scheduler is not None
        pending = list(self.scheduler.pending)
        self.shutdown()
        try:
            scheduler = self.ensure_scheduler()
        except (LaunchError, SpriteUsageError) as exc:
            head = self.queued[pending[0]]
            self._launch_failed(head, exc)
            return
        for run_id in pending:
            scheduler.submit(run_id, self.queued[run_id].n)

    def _launch_failed(self, run: _Run, exc: Exception) -> None:
        """The agents could not be started: this test fails and the session stops."""
        run.item.session.shouldstop = _launch_failure_line(exc)
        # The launch's command and output once, under rank 0: every rank failed for the same reason.
        for rank in range(run.n):
            detail = str(exc) if rank == 0 else "the launch failed before it started (rank 0 shows why)"
            run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=detail)
        self.queued.clear()  # the session stops: nothing queued will start
        if self.scheduler is not None:
            self.scheduler.stop()
        self._finished(run)

    def _start_ready(self) -> None:
        pool, scheduler = self.pool, self.scheduler
        if pool is None or scheduler is None:
            return
        if pool.broken:
            if self.running or not scheduler.pending:
                return  # the tests on healthy agents finish first; then a fresh pool for the queue
            self._replace_pool()
            pool, scheduler = self.pool, self.scheduler
            if pool is None or scheduler is None:
                return
        for start in scheduler.starts():
            self._start(pool, self.queued.pop(start.key), start.agents)

    def _start(self, pool: AgentPool, run: _Run, agents: tuple[int, ...]) -> None:
        """Send ``run`` to its agents: its own world 0..n-1, its own rendezvous on its first agent's host."""
        run.agents, run.started, run.started_at = agents, monotonic(), wall()
        self.running[run.run_id] = run
        self.on_agent.update((agent, run.run_id) for agent in agents)
        self.use.started(run.run_id, run.n, run.started)
        first = agents[0]
        master = "127.0.0.1" if self.settings.launcher == "local" else pool.agents[first].host
        port = pool.ports.get(first)
        if port is None:
            detail = f"rank agent {first} holds no rendezvous port for the next test. {pool.output_tail()}"
            pool.broken = detail
            for rank in range(run.n):
                run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=detail)
            return
        pool.ports[first] = None  # taken: the agent reports its next one when this child exits
        around = run.item.stash.get(around_ranks_key, None)
        fixtures = getattr(run.item, "fixturenames", ())
        basetemp, run.test_dir = make_test_dir(
            self.config,
            run.item.name,
            now=around is not None or not TMP_FIXTURES.isdisjoint(fixtures),
            run_id=run.run_id,
        )
        if around is not None:  # torch's parent side: setUp before the ranks start
            around.before(run.test_dir)
        run.hosts = {rank: pool.agents[agent].host for rank, agent in enumerate(agents)}
        for rank, (agent, where) in enumerate(zip(agents, pool.placement(agents), strict=True)):
            spec = run.spec(
                rank,
                where,
                rendezvous=(master, port),
                basetemp=basetemp,
                settings=self.settings,
                seed=self.hypothesis_seed,
                last=run.item.nodeid == self.last_ranks_test and not self.settings.mutate,
                debugger=self.debug.address(pool.address),
            )
            pool.send(agent, "run", spec)

    # -- the event loop ----------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """One turn of the loop: start what can start, handle the events that arrived, enforce deadlines,
        and finish the tests whose ranks have all ended."""
        self._start_ready()
        pool, scheduler = self.pool, self.scheduler
        if pool is not None and (self.running or (scheduler is not None and not scheduler.complete)):
            try:
                event: tuple[int, str, dict[str, Any]] | None = pool.events.get(timeout=timeout)
            except queue.Empty:
                event = None
            while event is not None:
                self.dispatch(pool, *event)
                try:
                    event = pool.events.get_nowait()
                except queue.Empty:
                    event = None
            if self.differing.due(every_agent_spoke=pool.complete):
                self.on_launch_failed(pool, self.differing.take())
            if self.debug.waiting():  # a rank's pdb asks for the terminal
                self.lend_terminal()
            for run in list(self.running.values()):
                self.events.check_deadlines(pool, run)
        ended = [run for run in self.running.values() if not run.live]
        for run in ended:
            self._release(run)
        if ended and not any(run.failed or run.interrupted for run in ended):
            self._start_ready()  # freed agents take their next tests before these are logged
        for run in ended:  # a failure is logged before anything new starts (-x, --maxfail)
            self._finished(run)
        self._start_ready()

    def _release(self, run: _Run) -> None:
        """Every rank of ``run`` has ended: free its agents for the next tests and count it."""
        if self.running.pop(run.run_id, None) is not None:
            for agent in run.agents:
                self.on_agent.pop(agent, None)
            if self.scheduler is not None:
                self.scheduler.finish(run.run_id)
            self.use.finished(run.run_id, monotonic())

    def _finished(self, run: _Run) -> None:
        """Every rank of ``run`` has ended: free its agents, count it, and log it when packed (after its
        mutant runs under ``--sprite-mutate``; a mutant run is only counted in the book)."""
        self._release(run)
        if run.mutant is not None:
            self._mutant_finished(run)
            return
        around = run.item.stash.get(around_ranks_key, None)
        if around is not None:  # torch's parent side: tearDown, and its exit-code rule
            around.after(run.reports, run.ends)
        if self.mutants.on and self._submit_mutants(run):
            return  # logged when its last mutant run has ended
        self._complete(run)

    def _submit_mutants(self, run: _Run) -> bool:
        """Queue ``run``'s test once per applicable mutant; whether any was queued."""
        return self.mutants.submit_for(
            run,
            self.merge(run),
            stopping=self._stopping(run.item.session),
            submit=lambda text: self.submit(run.item, run.nextitem, run.n, mutant=text),
        )

    def _mutant_finished(self, run: _Run, *, dropped: bool = False) -> None:
        """A mutant run ended (or was dropped by a stopping session): count it; log its test after the last."""
        parent = self.mutants.finished(run, [] if dropped else self.merge(run), dropped=dropped)
        if parent is not None:
            self._complete(parent)

    def _complete(self, run: _Run) -> None:
        """The test is done: log it when packed (``run_alone`` logs it itself)."""
        run.done = True
        if run.interrupted and self.interrupt is None:
            self.interrupt, self.exit_code = run.interrupted, run.exit_code
        if self.pack:
            run.item.stash[finished_run_key] = run
            try:
                run.item.ihook.pytest_runtest_protocol(item=run.item, nextitem=run.nextitem)
            finally:
                del run.item.stash[finished_run_key]
            self._stopping(run.item.session)  # -x: a failure logged just now starts nothing more

    def dispatch(self, pool: AgentPool, agent: int, event: str, payload: dict[str, Any]) -> None:
        """Route one event from ``agent`` to its ``on_<event>`` handler, with the rank it has in its test."""
        if event not in AGENT_EVENTS:
            raise ValueError(f"unexpected event from rank agent {agent}: {event!r}")
        if event == "agent_ready":  # it connected: tests may start on it
            unseen = {
                k: v for k, v in payload.get("collect_errors", {}).items() if k not in self.collect_errors
            }
            if unseen:  # the rank collects other code than this process: shown with the others', then stop
                self.differing.note(agent, unseen)
                return
            if self.scheduler is not None and not self.scheduler.stopped:
                self.scheduler.join(pool.slot(agent))
            return
        if event == "launch_failed":  # with the collection errors gathered so far: one failure, not two
            gathered = f"{self.differing.take()}\n" if self.differing.first is not None else ""
            self.on_launch_failed(pool, gathered + payload["detail"])
            return
        if event == "child_exited":
            pool.ports[agent] = payload["next_port"]  # whichever run it ends, the port is the agent's newest
        if event == "agent_lost":
            pool.broken = pool.broken or f"the connection to rank agent {agent} {payload['detail']}"
            run = self.running.get(self.on_agent.get(agent, -1))
        else:
            run = self.running.get(payload.get("run_id", -1))
        if run is None or agent not in run.agents:
            return  # a late event of a test already finished
        getattr(self.events, f"on_{event}")(pool, run, run.agents.index(agent), payload)

    def on_launch_failed(self, pool: AgentPool, detail: str) -> None:
        """The world cannot be completed: nothing more starts on it, the tests in flight finish, the first
        test waiting for agents fails with why, and the session stops (as when the launch itself fails)."""
        pool.broken = pool.broken or detail
        scheduler = self.scheduler
        if scheduler is not None and scheduler.pending:
            self._launch_failed(self.queued[scheduler.pending[0]], LaunchError(detail))
            return
        session = next(iter(self.items.values())).session
        session.shouldstop = session.shouldstop or _launch_failure_line(LaunchError(detail))
        if scheduler is not None:
            scheduler.stop()

    def lend_terminal(self) -> None:
        """Serve the ranks' debuggers; the time they held the loop counts against no test's timeout or grace."""
        lent = self.debug.serve()
        for run in self.running.values():
            run.held += lent.seconds
            if run.first_failure is not None:
                run.first_failure += lent.seconds
            for rank in run.aborted:
                run.aborted[rank] += lent.seconds
            if run.run_id in lent.quit:
                run.interrupted = run.interrupted or "Quitting debugger"

    # -- logging (pytest_sprite.launch.reporting) ------------------------------------------------

    def log(self, run: _Run) -> None:
        """Log ``run``'s merged reports under its own id, as pytest logs a test it ran."""
        log_run(self.config, run)

    def log_warnings(self, run: _Run) -> None:
        """Hand the ranks' warnings to pytest's warnings summary, one per warning, naming its ranks."""
        log_warnings(self.config, run)

    def merge(self, run: _Run) -> list[pytest.TestReport]:
        return merge_run(run)

    def shutdown(self) -> None:
        """Stop the agents (a lost pool, or the end of the session); tests still counted end now."""
        self.close_early()
        self.debug.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
            self.use.close(monotonic())
        self.scheduler = None


def _launch_failure_line(exc: Exception) -> str:
    """Why the session stops after a failed launch, in one line: the command and its output are shown once,
    with the failed test (its rank 0)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for tail in (" Its output:", " Launcher output:"):
        first = first.removesuffix(tail)
    return f"pytest-sprite could not start the rank agents: {first.rstrip(':')}"
