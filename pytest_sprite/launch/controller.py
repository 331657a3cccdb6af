"""Controller: the pytest process the user started.

It starts the rank agents once per session (lazily, at the first ranks test), sends each ranks
test to agents 0..n-1, consumes their events from one queue, enforces the timeout and the grace
period after a failed rank, and logs one merged result per phase. Reader threads only enqueue.
"""

from __future__ import annotations

import queue
import secrets
import shutil
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _pytest.reports import TestReport

from .._collected import store_collected
from .._markers import PARAM_NAME, RanksSpec, parse_ranks_marker
from .._settings import Settings
from .._timing import monotonic
from .._wire import AGENT_EVENTS, recv_frame, send_frame
from ..errors import LaunchError, SpriteUsageError
from .launchers import get_launcher
from .launchers.base import LaunchHandle, LaunchRequest
from .merge import RankEnd, fold_ranks, merge_rank_reports

__all__ = ["Controller", "item_world_size", "world_size_key"]

world_size_key = pytest.StashKey[int]()
"""The number of ranks an item runs on (absent: an ordinary test)."""
beyond_world_key = pytest.StashKey[str]()
"""Set when the item needs more ranks than the world: the skip reason."""


def ranks_spec(node: Any) -> RanksSpec | None:
    """The validated ``ranks`` marker of a test function or item, None without one."""
    mark = node.get_closest_marker("ranks")
    if mark is None:
        return None
    return parse_ranks_marker(
        mark.args, dict(mark.kwargs), getattr(node, "nodeid", getattr(node, "name", "?"))
    )


def item_world_size(item: pytest.Item) -> int | None:
    """How many ranks ``item`` runs on, or None for an ordinary test."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and PARAM_NAME in callspec.params:
        return int(callspec.params[PARAM_NAME])
    spec = ranks_spec(item)
    return spec.sizes[0] if spec is not None else None


@dataclass
class _Agent:
    rank: int
    sock: socket.socket
    host: str
    local_rank: int
    """The launcher's local rank for this agent: the device index its children use."""
    node: tuple[str, int | None]
    """Which node the agent is on: its host, and the launcher's node id where it gives one."""
    pid: int


class AgentPool:
    """The W rank agents of one launch, their sockets, and the one event queue."""

    def __init__(
        self, config: pytest.Config, settings: Settings, world_size: int, items: dict[str, pytest.Item]
    ) -> None:
        self.config = config
        self.settings = settings
        self.world_size = world_size
        self.items = items
        self.events: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
        self.agents: dict[int, _Agent] = {}
        self.broken: str | None = None
        self.handle: LaunchHandle | None = None
        self.tmpdir = Path(tempfile.mkdtemp(prefix="sprite-controller-"))
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the agents and wait until every one of them has connected and said who it is."""
        launcher = get_launcher(self.settings.launcher)
        launcher.check()
        spans = launcher.spans_nodes
        bind_host = "0.0.0.0" if spans else "127.0.0.1"
        advertised = self.settings.controller_host or (socket.gethostname() if spans else "127.0.0.1")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, 0))
        listener.listen(max(16, self.world_size))
        self._listener = listener
        port = listener.getsockname()[1]
        token = secrets.token_hex(16)
        log_path = self.tmpdir / "launch.log"
        config, items, world = self.config, self.items, self.world_size

        def fork_agent(rank: int) -> Any:
            listener.close()
            from ..rank.main import forked_agent_main

            forked_agent_main(
                config=config,
                items=items,
                rank=rank,
                world_size=world,
                host=advertised,
                port=port,
                token=token,
                log_path=log_path,
            )

        request = LaunchRequest(
            world_size=world,
            controller_host=advertised,
            controller_port=port,
            token=token,
            agent_argv=(
                sys.executable,
                "-m",
                "pytest",
                *config.invocation_params.args,
                f"--sprite-agent={advertised}:{port}",
            ),
            ppn=self.settings.ppn,
            launcher_args=self.settings.launcher_args,
            env={"SPRITE_TOKEN": token, "SPRITE_WORLD_SIZE": str(world)},
            log_path=log_path,
            cwd=Path(config.invocation_params.dir),
            fork_agent=fork_agent,
        )
        self.handle = launcher.launch(request)
        self._accept_all(token)

    def _accept_all(self, token: str) -> None:
        assert self._listener is not None and self.handle is not None
        deadline = monotonic() + self.settings.connect_timeout
        self._listener.settimeout(0.2)
        while len(self.agents) < self.world_size:
            status = self.handle.poll()
            if status is not None and len(self.agents) < self.world_size:
                raise LaunchError(
                    f"--launcher={self.settings.launcher}: the launch ended with status {status} before all "
                    f"{self.world_size} agents connected ({len(self.agents)} did). Its output:\n{self.handle.output_tail()}"
                )
            if monotonic() > deadline:
                raise LaunchError(
                    f"--launcher={self.settings.launcher}: only {len(self.agents)} of {self.world_size} agents connected "
                    f"within {self.settings.connect_timeout:g}s (--connect-timeout); connected ranks: "
                    f"{sorted(self.agents) or 'none'}. Launcher output:\n{self.handle.output_tail()}"
                )
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(30.0)
            hello = recv_frame(conn)
            conn.settimeout(None)
            if hello is None or hello[0] != "agent_ready" or hello[1].get("token") != token:
                conn.close()  # not one of ours
                continue
            self._register(conn, hello[1])
        for agent in self.agents.values():
            thread = threading.Thread(
                target=self._read_agent, args=(agent,), name=f"sprite-rank{agent.rank}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _register(self, conn: socket.socket, hello: dict[str, Any]) -> None:
        rank, world = int(hello["rank"]), int(hello["world_size"])
        if world != self.world_size or not 0 <= rank < self.world_size:
            raise LaunchError(
                f"an agent reports rank {rank} of a world of {world}, but the controller launched {self.world_size} "
                f"(--ranks); check the launcher's rank variables (RANK, PMI_RANK, PALS_RANKID, SLURM_PROCID)"
            )
        if rank in self.agents:
            raise LaunchError(
                f"two agents report rank {rank} (pids {self.agents[rank].pid} on {self.agents[rank].host} and "
                f"{hello['pid']} on {hello['host']}): the launcher's rank variables are not per process"
            )
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node = hello.get("node")
        self.agents[rank] = _Agent(
            rank=rank,
            sock=conn,
            host=str(hello["host"]),
            local_rank=int(hello["local_rank"]),
            node=(str(hello["host"]), None if node is None else int(node)),
            pid=int(hello["pid"]),
        )

    def _read_agent(self, agent: _Agent) -> None:
        """Reader thread: enqueue every frame; never raise, never block the controller."""
        try:
            while True:
                frame = recv_frame(agent.sock)
                if frame is None:
                    break
                self.events.put((agent.rank, frame[0], frame[1]))
        except OSError:
            pass
        self.events.put((agent.rank, "agent_lost", {}))

    # -- use -------------------------------------------------------------------------------

    def send(self, to: int, command: str, **payload: Any) -> None:
        """Send a command to the agent of rank ``to``; a dead connection marks the pool broken."""
        try:
            send_frame(self.agents[to].sock, command, **payload)
        except OSError as exc:
            self.broken = f"lost the connection to rank agent {to}: {exc}"
            self.events.put((to, "agent_lost", {}))

    def placement(self, n: int) -> dict[int, dict[str, Any]]:
        """Local rank, local size and node index of ranks 0..n-1 of a test.

        The local rank is the launcher's (it picks the rank's device); ranks share a node when their
        agents share a host and launcher node id; nodes are numbered in order of their first rank.
        """
        nodes: list[tuple[str, int | None]] = []
        counts: dict[tuple[str, int | None], int] = {}
        for rank in range(n):
            node = self.agents[rank].node
            if node not in nodes:
                nodes.append(node)
            counts[node] = counts.get(node, 0) + 1
        return {
            rank: {
                "local_rank": self.agents[rank].local_rank,
                "local_size": counts[self.agents[rank].node],
                "node": nodes.index(self.agents[rank].node),
            }
            for rank in range(n)
        }

    def reserve_port(self, host: str) -> int:
        """Ask agent 0 for a free port on its host: rank 0's child hosts the rendezvous store there."""
        self.send(0, "reserve_port", host=host)
        deadline = monotonic() + 30.0
        while monotonic() < deadline:
            try:
                rank, event, payload = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if event == "port_reserved":
                return int(payload["port"])
            if event == "agent_lost":
                self.broken = f"rank agent {rank} was lost"
                raise LaunchError(
                    f"rank agent {rank} was lost while reserving a rendezvous port. {self._tail()}"
                )
        raise LaunchError(f"rank agent 0 did not answer a port reservation within 30s. {self._tail()}")

    def _tail(self) -> str:
        return f"Launcher output:\n{self.handle.output_tail()}" if self.handle else ""

    def close(self) -> None:
        """Stop every agent and the launch; safe to call twice."""
        for rank in list(self.agents):
            self.send(rank, "shutdown")
        if self.handle is not None:
            deadline = monotonic() + 5.0
            while self.handle.poll() is None and monotonic() < deadline:
                try:
                    self.events.get(timeout=0.05)
                except queue.Empty:
                    pass
            self.handle.terminate(grace=2.0)
        for agent in self.agents.values():
            agent.sock.close()
        if self._listener is not None:
            self._listener.close()
        self.agents.clear()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


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
        """Tear down the controller's own fixtures that ``nextitem`` does not share.

        A ranks test runs in its children, never in the controller, but pytest's setup state here still
        holds the module of an earlier in-process test; without this, the next module's first in-process
        test finds it "not torn down properly".
        """
        if item.session.shouldfail or item.session.shouldstop:
            nextitem = None
        item.session._setupstate.teardown_exact(nextitem)  # type: ignore[attr-defined]

    def _timeout_for(self, item: pytest.Item) -> tuple[float, str]:
        spec = ranks_spec(item)
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
            port = pool.reserve_port(master)
        except (LaunchError, SpriteUsageError) as exc:
            message = f"pytest-sprite could not start the rank agents: {exc}"
            item.session.shouldstop = message
            for rank in range(n):
                run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=str(exc))
            return run
        run.started = monotonic()
        placement = pool.placement(n)
        for rank in range(n):
            pool.send(
                rank,
                "run",
                run_id=run.run_id,
                nodeid=item.nodeid,
                rank=rank,
                world_size=n,
                master_addr=master,
                master_port=port,
                device=self.settings.device,
                timeout=timeout,
                **placement[rank],
            )
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
        if event != "agent_lost" and event not in AGENT_EVENTS:
            raise ValueError(f"unknown event from rank {rank}: {event!r}")
        if event != "agent_lost" and payload.get("run_id") != run.run_id:
            return  # a late event of an earlier test
        getattr(self, f"on_{event}")(pool, run, rank, payload)

    def on_agent_ready(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Agents say hello only while the pool starts."""

    def on_port_reserved(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Consumed by AgentPool.reserve_port; a late duplicate is ignored."""

    def on_child_started(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Emitted by an agent after forking the test child."""

    def on_report(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Emitted by a child for each phase (setup, call, teardown) as soon as it is made."""
        report = self.config.hook.pytest_report_from_serializable(config=self.config, data=payload["report"])
        run.reports.setdefault(rank, []).append(report)
        if report.failed:
            run.note_failure(rank)

    def on_collected(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Emitted by a child's ``world.collect(name, tensor)``."""
        store_collected(run.item, payload["name"], rank, payload["tensor"])

    def on_output(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Emitted by a child under ``-s``: show what the rank printed, each line marked with its rank."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        reporter.ensure_newline()
        for line in payload["text"].rstrip("\n").splitlines():
            reporter.write_line(f"[rank {rank}] {line}")

    def on_interrupted(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Emitted by a child that got KeyboardInterrupt: the session ends after this test."""
        run.interrupted = payload["message"]
        run.note_failure(rank)

    def on_agent_error(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Emitted by an agent that could not start the child (e.g. it did not collect the test)."""
        run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=payload["message"])
        run.note_failure(rank)

    def on_child_exited(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
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

    def on_agent_lost(self, pool: AgentPool, run: _Run, rank: int, payload: dict[str, Any]) -> None:
        """Posted by a reader thread when an agent's connection closed.

        Only that rank ends here; the others finish or are ended after the grace period like peers of
        any failed rank, so their own tracebacks and stacks still reach the report. The pool is then
        replaced before the next ranks test.
        """
        pool.broken = pool.broken or f"rank agent {rank} was lost"
        if rank in run.live:
            tail = pool.handle.output_tail() if pool.handle else ""
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
                pool.send(rank, "abort", run_id=run.run_id, reason=reason, detail=detail)

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
