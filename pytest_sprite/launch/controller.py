"""Controller: the pytest plugin of the process the user started, and its one event loop.

It starts the agent pool once per session (lazily, at the first ranks test), sends each ranks test
to agents 0..n-1, consumes their events from the pool's queue (the only consumer), enforces the
timeout and the grace period after a failed rank, and logs one merged result per phase.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest.reports import TestReport

from .._collected import store_collected
from .._markers import PARAM_NAME, item_ranks_spec, ranks_spec_key
from .._pytest_internals import teardown_controller_state
from .._ranges import fold_ranks
from .._settings import Settings
from .._timing import monotonic
from ..errors import LaunchError, SpriteUsageError
from ..protocol import (
    AGENT_EVENTS,
    AgentError,
    AgentLost,
    ChildExited,
    Collected,
    Interrupted,
    Output,
    Report,
    RunSpec,
)
from .merge import RankEnd, merge_rank_reports
from .pool import AgentPool

__all__ = ["Controller", "item_world_size", "world_size_key"]

world_size_key = pytest.StashKey[int]()
"""The number of ranks an item runs on (absent: an ordinary test)."""
beyond_world_key = pytest.StashKey[str]()
"""Set when the item needs more ranks than the world: the skip reason."""


def item_world_size(item: pytest.Item) -> int | None:
    """How many ranks ``item`` runs on, or None for an ordinary test."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and PARAM_NAME in callspec.params:
        return int(callspec.params[PARAM_NAME])
    spec = item_ranks_spec(item)
    return spec.sizes[0] if spec is not None else None


@dataclass
class _Run:
    """One ranks test in flight."""

    run_id: int
    item: pytest.Item
    n: int
    timeout: float
    timeout_source: str
    started: float
    reports: dict[int, list[TestReport]] = field(default_factory=dict)
    ends: dict[int, RankEnd] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)
    first_failure: float | None = None
    aborted: dict[int, float] = field(default_factory=dict)
    interrupted: str | None = None

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.n) if r not in self.ends]

    def note_failure(self, rank: int) -> None:
        if rank not in self.failed:
            self.failed.append(rank)
        if self.first_failure is None:
            self.first_failure = monotonic()


class Controller:
    """Pytest plugin object of the controlling process (registered as ``sprite-controller``)."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.world_size: int | None = settings.world_size
        self.pool: AgentPool | None = None
        self.items: dict[str, pytest.Item] = {}
        self._run_ids = 0

    # -- hooks (each hands off to a method) ---------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.plan(items)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        n = item.stash.get(world_size_key, None)
        if n is None or beyond_world_key in item.stash:
            return None
        self.run_and_log(item, n)
        self.teardown_for(item, nextitem)
        return True

    def pytest_sessionfinish(self) -> None:
        self.shutdown()

    # -- planning ----------------------------------------------------------------------------

    def plan(self, items: list[pytest.Item]) -> None:
        """Record each item's world size and skip those that need more ranks than the world."""
        sizes = {}
        for item in items:
            n = item_world_size(item)
            if n is not None:
                sizes[item] = n
                item.stash[world_size_key] = n
        if self.world_size is None and sizes:
            self.world_size = max(sizes.values())
        self.items = {item.nodeid: item for item in items}
        for item, n in sizes.items():
            assert self.world_size is not None
            if n > self.world_size:
                reason = (
                    f"needs {n} ranks, the world has {self.world_size} "
                    f"(--ranks={self.world_size}); run with --ranks={n} or more to include it"
                )
                item.stash[beyond_world_key] = reason
                item.add_marker(pytest.mark.skip(reason=reason))

    # -- running -----------------------------------------------------------------------------

    def run_and_log(self, item: pytest.Item, n: int) -> None:
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        run = self.run(item, n)
        for report in self.merge(run):
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        if run.interrupted:
            pytest.exit(run.interrupted, returncode=pytest.ExitCode.INTERRUPTED)

    def teardown_for(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Tear down the controller's own fixtures that ``nextitem`` does not share (see _pytest_internals)."""
        teardown_controller_state(item, nextitem)

    def _timeout_for(self, item: pytest.Item) -> tuple[float, str]:
        spec = item.stash.get(ranks_spec_key, None)
        if spec is not None and spec.timeout is not None:
            return spec.timeout, "@pytest.mark.ranks(timeout=...)"
        return self.settings.timeout, self.settings.timeout_source

    def ensure_pool(self) -> AgentPool:
        if self.pool is not None and self.pool.broken:
            self.pool.close()
            self.pool = None
        if self.pool is None:
            assert self.world_size is not None
            pool = AgentPool(self.config, self.settings, self.world_size, self.items)
            try:
                pool.start()
            except BaseException:
                pool.close()
                raise
            self.pool = pool
        return self.pool

    def run(self, item: pytest.Item, n: int) -> _Run:
        """Run ``item`` on ranks 0..n-1 and wait until every child has ended."""
        timeout, source = self._timeout_for(item)
        self._run_ids += 1
        run = _Run(
            run_id=self._run_ids, item=item, n=n, timeout=timeout, timeout_source=source, started=monotonic()
        )
        try:
            pool = self.ensure_pool()
            master = "127.0.0.1" if self.settings.launcher == "local" else pool.agents[0].host
            port = pool.next_port
            if port is None:
                raise LaunchError(
                    f"rank agent 0 holds no rendezvous port for the next test. {pool.output_tail()}"
                )
        except (LaunchError, SpriteUsageError) as exc:
            message = f"pytest-sprite could not start the rank agents: {exc}"
            item.session.shouldstop = message
            for rank in range(n):
                run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=str(exc))
            return run
        run.started = monotonic()
        placement = pool.placement(n)
        for rank in range(n):
            where = placement[rank]
            spec = RunSpec(
                run_id=run.run_id,
                nodeid=item.nodeid,
                rank=rank,
                world_size=n,
                local_rank=where.local_rank,
                local_size=where.local_size,
                node=where.node,
                master_addr=master,
                master_port=port,
                device=self.settings.device,
                timeout=timeout,
            )
            pool.send(rank, "run", spec)
        try:
            while run.live:
                self._step(pool, run)
        except KeyboardInterrupt:
            self.shutdown()
            raise
        if pool.broken:
            pool.close()
            self.pool = None
        return run

    def _step(self, pool: AgentPool, run: _Run) -> None:
        try:
            rank, event, payload = pool.events.get(timeout=0.1)
        except queue.Empty:
            pass
        else:
            self.dispatch(pool, run, rank, event, payload)
        self._check_deadlines(pool, run)

    def dispatch(self, pool: AgentPool, run: _Run, rank: int, event: str, payload: dict[str, Any]) -> None:
        """Route one event to its ``on_<event>`` handler; unknown names are a protocol bug."""
        if event not in AGENT_EVENTS or event == "agent_ready":
            raise ValueError(f"unexpected event from rank {rank}: {event!r}")
        if event == "child_exited" and rank == 0:
            pool.next_port = payload["next_port"]  # whichever run it ends, the port is agent 0's newest
        if event != "agent_lost" and payload.get("run_id") != run.run_id:
            return  # a late event of an earlier test
        getattr(self, f"on_{event}")(pool, run, rank, payload)

    def on_report(self, pool: AgentPool, run: _Run, rank: int, payload: Report) -> None:
        """Emitted by a child for each phase (setup, call, teardown) as soon as it is made."""
        report = self.config.hook.pytest_report_from_serializable(config=self.config, data=payload["report"])
        run.reports.setdefault(rank, []).append(report)
        if report.failed:
            run.note_failure(rank)

    def on_collected(self, pool: AgentPool, run: _Run, rank: int, payload: Collected) -> None:
        """Emitted by a child's ``world.collect(name, tensor)``."""
        store_collected(run.item, payload["name"], rank, payload["tensor"])

    def on_output(self, pool: AgentPool, run: _Run, rank: int, payload: Output) -> None:
        """Emitted by a child under ``-s``: show what the rank printed, each line marked with its rank."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        reporter.ensure_newline()
        for line in payload["text"].rstrip("\n").splitlines():
            reporter.write_line(f"[rank {rank}] {line}")

    def on_interrupted(self, pool: AgentPool, run: _Run, rank: int, payload: Interrupted) -> None:
        """Emitted by a child that got KeyboardInterrupt: the session ends after this test."""
        run.interrupted = payload["message"]
        run.note_failure(rank)

    def on_agent_error(self, pool: AgentPool, run: _Run, rank: int, payload: AgentError) -> None:
        """Emitted by an agent that could not start the child (e.g. it did not collect the test)."""
        run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=payload["message"])
        run.note_failure(rank)

    def on_child_exited(self, pool: AgentPool, run: _Run, rank: int, payload: ChildExited) -> None:
        """Emitted by an agent when the child ended, on its own or by ``abort``."""
        end = RankEnd(
            rank=rank,
            exitcode=payload["exitcode"],
            signal=payload["signal"],
            ended_by=payload["ended_by"],
            detail=payload["detail"],
            output_tail=payload["output_tail"],
            stacks=payload["stacks"],
        )
        run.ends[rank] = end
        reported = run.reports.get(rank, [])
        if not (reported and reported[-1].when == "teardown"):
            run.note_failure(rank)

    def on_agent_lost(self, pool: AgentPool, run: _Run, rank: int, payload: AgentLost) -> None:
        """Posted by a reader thread when an agent's connection closed.

        Only that rank ends here; the others finish or are ended after the grace period like peers of
        any failed rank, so their own tracebacks and stacks still reach the report. The pool is then
        replaced before the next ranks test.
        """
        pool.broken = pool.broken or f"rank agent {rank} was lost"
        if rank in run.live:
            tail = pool.output_tail()
            run.ends[rank] = RankEnd(
                rank=rank,
                ended_by="agent_lost",
                detail=f"the connection to rank agent {rank} closed",
                output_tail=tail,
            )
            run.note_failure(rank)

    def _check_deadlines(self, pool: AgentPool, run: _Run) -> None:
        now = monotonic()
        if now - run.started > run.timeout:
            self._abort(
                pool, run, "timeout", f"after the {run.timeout:g}s timeout (from {run.timeout_source})"
            )
        elif run.first_failure is not None and now - run.first_failure > self.settings.grace:
            self._abort(
                pool,
                run,
                "peer_failed",
                f"{self.settings.grace:g}s after {fold_ranks(run.failed)} failed (--rank-grace)",
            )
        for rank, when in list(run.aborted.items()):
            if rank in run.live and now - when > 20.0:
                pool.broken = f"rank agent {rank} did not end its child within 20s of an abort"
                run.ends[rank] = RankEnd(rank=rank, ended_by="agent_lost", detail=pool.broken)

    def _abort(self, pool: AgentPool, run: _Run, reason: str, detail: str) -> None:
        for rank in run.live:
            if rank not in run.aborted:
                run.aborted[rank] = monotonic()
                pool.send(rank, "abort", {"run_id": run.run_id, "reason": reason, "detail": detail})

    def merge(self, run: _Run) -> list[TestReport]:
        item = run.item
        return merge_rank_reports(
            nodeid=item.nodeid,
            location=item.location,
            keywords={k: 1 for k in item.keywords},
            per_rank=run.reports,
            ends=run.ends,
            world_size=run.n,
            failure_order=run.failed,
        )

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
