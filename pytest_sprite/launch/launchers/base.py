"""The one launcher interface: how W rank agents are started and watched.

Every launcher starts the same rank agents; only the command differs. Agents connect back to the
controller's address and identify themselves with the session token.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ...plumbing.output import tail_of_file
from ...plumbing.process import wait_for_exits
from ...plumbing.timing import monotonic, sleep

if TYPE_CHECKING:
    import pytest

__all__ = ["LaunchHandle", "LaunchRequest", "Launcher", "SubprocessLaunch"]


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    """Everything a launcher needs to start one session's agents."""

    world_size: int
    """Number of rank agents to start (``--ranks``)."""
    controller_host: str
    """Host name or address the agents connect back to."""
    controller_port: int
    """Port of the controller's listening socket."""
    token: str
    """Secret each agent presents when it connects (``SPRITE_TOKEN`` for launched agents)."""
    agent_argv: tuple[str, ...]
    """Command that starts one agent on a remote node: python -m pytest <the user's args> --sprite-agent=..."""
    ppn: int | None = None
    """Ranks per node (``--ppn``); None lets the launcher pick from the allocation."""
    launcher_args: tuple[str, ...] = ()
    """Extra words passed to the launcher command (``--launcher-args``)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every agent (merged over the controller's environment)."""
    log_path: Path
    """File that receives the launcher's own stdout and stderr."""
    cwd: Path | None = None
    """Directory the agents start in (the controller's invocation directory: test paths are relative to it)."""
    config: pytest.Config | None = None
    """For the local launcher, whose agents are forks of the controller: the session's config."""
    items: Mapping[str, pytest.Item] = field(default_factory=dict)
    """For the local launcher: the collected items by node id, which forked agents already hold."""
    close_in_agent: tuple[int, ...] = ()
    """For the local launcher: the controller's descriptors (its listening socket) a forked agent closes first."""


@runtime_checkable
class LaunchHandle(Protocol):
    """A running launch: poll it, read its output, end it."""

    def poll(self) -> int | None:
        """The launch's exit status once it has ended (negative: killed by that signal), else None."""

    def wait(self, timeout: float) -> int | None:
        """:meth:`poll` once the launch has ended, waiting at most ``timeout`` seconds for it; else None."""

    def output_tail(self, lines: int = 40) -> str:
        """The last lines the launcher (or the agents, before they connected) printed."""

    def terminate(self, grace: float = 5.0) -> None:
        """End the launch and every agent it started: SIGTERM, then SIGKILL after ``grace`` seconds."""


class Launcher(Protocol):
    """Starts W rank agents. Implementations live one per module in this package."""

    name: str
    """The ``--launcher`` value."""
    spans_nodes: bool
    """True when agents may run on other hosts, so the controller must listen on a routable address."""

    def check(self) -> None:
        """Raise :class:`~pytest_sprite.errors.LaunchError` if this launcher cannot run here (say how to fix)."""

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        """Start ``request.world_size`` agents and return at once; they connect back by themselves."""


class SubprocessLaunch:
    """A launcher command running in its own process group, output to a log file."""

    def __init__(
        self, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, cwd: Path | None = None
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        full_env = dict(os.environ)
        full_env.update(env)
        self.proc = subprocess.Popen(
            self.argv,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        wait_for_exits([self.proc.pid], timeout)
        return self.proc.poll()

    def output_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return tail_of_file(self.log_path, lines, window=64 * 1024)

    def terminate(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            deadline = monotonic() + grace
            while self.proc.poll() is None and monotonic() < deadline:
                sleep(0.05)
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
