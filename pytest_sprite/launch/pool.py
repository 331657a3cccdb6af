"""The agent pool: the W rank agents of one launch, their sockets, and the reader threads that feed the event queue.

The controller's sibling, as xdist's ``workermanage.py`` is ``dsession.py``'s: it starts, addresses
and stops agents, and never consumes the event queue (only the controller's loop does). It knows
nothing of the rank side: the local launcher alone forks agents.
"""

from __future__ import annotations

import queue
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..errors import LaunchError
from ..glue.options import Settings
from ..plumbing.coverage import agent_launch
from ..plumbing.placement import Placement, place
from ..plumbing.protocol import (
    AGENT_FAILED,
    FIRST_FRAME_MAX,
    AgentReady,
    FrameTooLarge,
    recv_frame,
    send_frame,
)
from ..plumbing.timing import monotonic
from .early_failures import SETTLE, agents_failed
from .launchers import get_launcher
from .launchers.base import LaunchHandle, LaunchRequest
from .schedule import Slot

__all__ = ["AgentPool", "Event", "Placement", "place"]

_AGENT_END_WAIT = 2.0
"""Seconds a lost forked agent's end is waited for: its connection closes as it dies."""

Event = tuple[int, str, dict[str, Any]]
"""(rank, event name, payload) as the reader threads enqueue it."""


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
        self.events: queue.Queue[Event] = queue.Queue()
        """Every agent's frames in arrival order; filled by reader threads, consumed by the controller's loop only."""
        self.agents: dict[int, _Agent] = {}
        self.broken: str | None = None
        self.ports: dict[int, int | None] = {}
        """Each agent's listening rendezvous port for the next test whose rank 0 it runs (from agent_ready,
        then each child_exited); None once a test took it, until that agent reports the next one."""
        self.handle: LaunchHandle | None = None
        self.tmpdir = Path(tempfile.mkdtemp(prefix="sprite-controller-"))
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._token = ""
        self.launched_at = 0.0
        """When :meth:`launch` started the agents (the controller's monotonic clock)."""
        self.address = ("127.0.0.1", "127.0.0.1")
        """Where this side listens for what the agents' hosts connect to, and the host name they use for it."""
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()
        """Held while an agent registers and while closing starts, so no agent joins a closed pool."""
        self._closing = False
        self._nodes: list[tuple[str, int | None]] = []
        """Each node's key (host, launcher node id) in the order its first agent arrived."""

    # -- start ------------------------------------------------------------------------------

    @property
    def launched(self) -> bool:
        """True once :meth:`launch` has started the agents (they may still be starting up)."""
        return self.handle is not None

    def launch(self) -> None:
        """Start the agents and return at once; they connect back by themselves (see :meth:`connect`).

        Launched agents (every launcher but local) start a pytest session of their own and collect the
        tests themselves, so the controller may launch them before its own collection and let the two
        overlap (``Controller.pytest_collection``).
        """
        launcher = get_launcher(self.config, self.settings.launcher)
        launcher.check()
        spans = launcher.spans_nodes
        bind_host = "0.0.0.0" if spans else "127.0.0.1"
        advertised = self.settings.controller_host or (socket.gethostname() if spans else "127.0.0.1")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, 0))
        listener.listen(max(16, self.world_size))
        self._listener, self.address = listener, (bind_host, advertised)
        port = listener.getsockname()[1]
        token = secrets.token_hex(16)
        log_path = self.tmpdir / "launch.log"
        config, world = self.config, self.world_size
        coverage_args, coverage_env = agent_launch(config.option)
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
                *coverage_args,
                f"--sprite-agent={advertised}:{port}",
            ),
            ppn=self.settings.ppn,
            launcher_args=self.settings.launcher_args,
            env={"SPRITE_TOKEN": token, "SPRITE_WORLD_SIZE": str(world), **coverage_env},
            log_path=log_path,
            cwd=Path(config.invocation_params.dir),
            config=config,
            items=self.items,
            close_in_agent=(listener.fileno(),),
        )
        self._token, self.launched_at = token, monotonic()
        self.handle = launcher.launch(request)

    def connect(self) -> None:
        """Accept the agents in a thread as they connect; each one posts ``agent_ready`` on :attr:`events`.

        Tests can start on the agents that have connected while the others still start (a straggler
        delays only the tests that need it). When the world cannot be completed (the launch ended,
        ``--connect-timeout`` passed since the launch, an agent reports a rank that does not fit), the
        thread posts ``launch_failed`` instead and stops.
        """
        assert self._listener is not None and self.handle is not None
        self._acceptor = threading.Thread(target=self._accept_all, name="sprite-accept", daemon=True)
        self._acceptor.start()

    @property
    def complete(self) -> bool:
        """True once every agent of the world has connected."""
        return len(self.agents) == self.world_size

    def _accept_all(self) -> None:
        """Accepting thread: any way it ends before the world is complete reaches the controller's queue."""
        try:
            self._accept_until_complete()
        except LaunchError as exc:
            self.events.put((-1, "launch_failed", {"detail": str(exc)}))
        except OSError as exc:
            if not self._closing:
                detail = f"the controller stopped accepting agents: {_described(exc)}"
                self.events.put((-1, "launch_failed", {"detail": detail}))
        except BaseException as exc:  # a bug here must fail the launch, not leave the controller waiting
            detail = f"the controller's accepting thread failed: {_described(exc)}"
            self.events.put((-1, "launch_failed", {"detail": detail}))

    def _accept_until_complete(self) -> None:
        assert self._listener is not None and self.handle is not None
        token = self._token
        deadline = self.launched_at + self.settings.connect_timeout
        self._listener.settimeout(0.2)
        # Rank -> why its agent failed before it could join: shown together (``early_failures``).
        failed: dict[int | None, str] = {}
        first_failure = 0.0
        while not self.complete and not self._closing:
            if failed and (
                len(self.agents) + len(failed) >= self.world_size or monotonic() - first_failure > SETTLE
            ):
                raise LaunchError(agents_failed(failed))
            status = self.handle.poll()
            if status is not None:
                failed.update(self._agent_failures_waiting(token))  # an agent's own words beat the launcher's
                if failed:
                    raise LaunchError(agents_failed(failed))
                raise LaunchError(
                    f"--launcher={self.settings.launcher}: the launch ended with status {status} before all "
                    f"{self.world_size} agents connected ({len(self.agents)} did). Its output:\n{self.handle.output_tail()}"
                )
            try:
                conn, _ = self._listener.accept()
            except ConnectionAbortedError:
                continue  # a connection reset before it was taken: not an agent that connected
            except TimeoutError:
                # Checked only when no agent is waiting: agents that connected while this process was
                # still collecting (an early launch) are accepted however long that took.
                if monotonic() > deadline:
                    raise LaunchError(
                        f"--launcher={self.settings.launcher}: only {len(self.agents)} of {self.world_size} agents "
                        f"connected within {self.settings.connect_timeout:g}s (--connect-timeout); connected ranks: "
                        f"{sorted(self.agents) or 'none'}. Launcher output:\n{self.handle.output_tail()}"
                    ) from None
                continue
            hello = self._first_frame(conn)
            if hello is not None and hello[0] == AGENT_FAILED and hello[1].get("token") == token:
                conn.close()
                first_failure = first_failure or monotonic()
                failed[hello[1].get("rank")] = str(hello[1].get("detail", ""))
                continue
            if hello is None or hello[0] != "agent_ready" or hello[1].get("token") != token:
                conn.close()  # not one of ours
                continue
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                try:
                    agent = self._register(conn, hello[1])  # type: ignore[arg-type]
                except LaunchError:
                    conn.close()
                    raise
            self.events.put((agent.rank, "agent_ready", dict(hello[1])))
            self._start_reader(agent)

    def _start_reader(self, agent: _Agent) -> None:
        thread = threading.Thread(
            target=self._read_agent, args=(agent,), name=f"sprite-rank{agent.rank}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _agent_failures_waiting(self, token: str) -> dict[int | None, str]:
        """The ``agent_failed`` frames among the connections already waiting, once the launch has ended: the
        agents that failed ended it (torchrun ends the others), and their tracebacks say why."""
        assert self._listener is not None
        self._listener.settimeout(0.0)
        failed: dict[int | None, str] = {}
        try:
            while True:
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    return failed
                hello = self._first_frame(conn)
                conn.close()
                if hello is not None and hello[0] == AGENT_FAILED and hello[1].get("token") == token:
                    failed[hello[1].get("rank")] = str(hello[1].get("detail", ""))
        finally:
            self._listener.settimeout(0.2)

    @staticmethod
    def _first_frame(conn: socket.socket) -> tuple[str, dict[str, Any]] | None:
        """A connection's first frame, read before its token is checked: at most FIRST_FRAME_MAX bytes.

        Anything larger, malformed or slow is not one of our agents; the caller drops the connection
        without having allocated what a stranger announced.
        """
        conn.settimeout(30.0)
        try:
            return recv_frame(conn, max_size=FIRST_FRAME_MAX)
        except (FrameTooLarge, ValueError, OSError):
            return None
        finally:
            try:
                conn.settimeout(None)
            except OSError:
                pass

    def _register(self, conn: socket.socket, hello: AgentReady) -> _Agent:
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
        node = hello["node"]
        self.ports[rank] = hello["next_port"]
        agent = _Agent(
            rank=rank,
            sock=conn,
            host=str(hello["host"]),
            local_rank=int(hello["local_rank"]),
            node=(str(hello["host"]), None if node is None else int(node)),
            pid=int(hello["pid"]),
        )
        if agent.node not in self._nodes:
            self._nodes.append(agent.node)
        self.agents[rank] = agent
        return agent

    def _read_agent(self, agent: _Agent) -> None:
        """Reader thread: enqueue every frame; never raise, never block the controller.

        However it ends (the agent closed the connection, the connection broke, a frame could not be read),
        its last event is ``agent_lost`` saying why: a reader that died silently would leave the
        controller waiting for that agent's events until the test's timeout.
        """
        detail = "closed"
        try:
            while True:
                frame = recv_frame(agent.sock)
                if frame is None:
                    break
                self.events.put((agent.rank, frame[0], frame[1]))
        except ConnectionResetError:
            pass  # an agent that died with a command unread resets its connection: it closed all the same
        except OSError as exc:
            detail = f"broke ({exc})"
        except BaseException as exc:
            detail = f"sent a frame that could not be read ({_described(exc)})"
        self.events.put((agent.rank, "agent_lost", {"detail": detail}))

    # -- use -------------------------------------------------------------------------------

    def send(self, to: int, command: str, payload: Mapping[str, Any]) -> None:
        """Send a command to the agent of rank ``to``; a dead connection marks the pool broken."""
        try:
            send_frame(self.agents[to].sock, command, payload)
        except OSError as exc:
            detail = f"took no command ({exc})"
            self.broken = f"the connection to rank agent {to} {detail}"
            self.events.put((to, "agent_lost", {"detail": detail}))

    def slot(self, rank: int) -> Slot:
        """The agent of ``rank`` as the scheduler sees it; nodes are numbered in the order agents arrived."""
        return Slot(rank=rank, node=self._nodes.index(self.agents[rank].node))

    def placement(self, agents: Sequence[int]) -> list[Placement]:
        """Where each rank of a test on ``agents`` sits (test rank r runs on ``agents[r]``); see :func:`place`."""
        return place([(self.agents[agent].node, self.agents[agent].local_rank) for agent in agents])

    def how_agent_ended(self, rank: int) -> str:
        """``was killed by signal 9 (SIGKILL)`` for a lost agent whose end the launch can read (a forked
        agent, waited for a moment), else empty."""
        agent = self.agents.get(rank)
        exit_of = getattr(self.handle, "exit_of", None)
        code = exit_of(agent.pid, _AGENT_END_WAIT) if agent is not None and exit_of is not None else None
        if code is None:
            return ""
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by signal {-code} ({name})"
        return f"exited with status {code}"

    def output_tail(self) -> str:
        """The launch log's last lines (empty before the launch)."""
        return self.handle.output_tail() if self.handle is not None else ""

    def close(self) -> None:
        """Stop every agent and the launch; safe to call twice."""
        with self._lock:
            self._closing = True  # the accepting thread registers no agent from now on
        if self._listener is not None:
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=1.0)
        for rank in list(self.agents):
            self.send(rank, "shutdown", {})
        if self.handle is not None:
            # Agents that never connected got no shutdown: end the launch at once rather than wait for it.
            # Woken by their exit; what arrives on the controller's queue now stays there, unread.
            self.handle.wait(5.0 if len(self.agents) == self.world_size else 0.0)
            self.handle.terminate(grace=2.0)
        for agent in self.agents.values():
            agent.sock.close()
        self.agents.clear()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _described(exc: BaseException) -> str:
    """An exception as its type and message, for a line that says why a thread ended."""
    return f"{type(exc).__name__}: {exc}"
