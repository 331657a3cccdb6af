"""``--launcher=local``: the agents are forks of the controller, made after collection.

Nothing is imported or collected twice: each agent already holds the session's items. This is the
only module of the controller side that reaches the rank side, and only inside the forked agent.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import warnings
from typing import TYPE_CHECKING, NoReturn

from ...errors import LaunchError
from ...glue.options import settings_key
from ...plumbing.capacity import local_world_shortfall
from ...plumbing.output import tail_of_file
from ...plumbing.process import (
    collapse_heap_once,
    computing_before_fork,
    die_with_parent,
    one_thread_after_fork,
    preimport_torch,
    tests_ran_here,
    wait_for_exits,
)
from ...plumbing.timing import monotonic, sleep
from ..item_runs import world_size_key
from .base import LaunchHandle, LaunchRequest

if TYPE_CHECKING:
    import pytest

__all__ = ["LocalLauncher", "check_local_world"]


class _ForkedAgents:
    def __init__(self, pids: list[int], request: LaunchRequest) -> None:
        self.pids = pids
        self.request = request
        self.status: dict[int, int] = {}

    def _reap(self) -> None:
        for pid in self.pids:
            if pid in self.status:
                continue
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                self.status[pid] = 0
                continue
            if done:
                self.status[pid] = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        self._reap()
        failed = [code for code in self.status.values() if code != 0]
        if failed:
            return failed[0]
        return 0 if len(self.status) == len(self.pids) else None

    def wait(self, timeout: float) -> int | None:
        self._reap()
        wait_for_exits([pid for pid in self.pids if pid not in self.status], timeout)
        return self.poll()

    def output_tail(self, lines: int = 40) -> str:
        return tail_of_file(self.request.log_path, lines, window=64 * 1024)

    def exit_of(self, pid: int, within: float) -> int | None:
        """How the forked agent ``pid`` ended (an exit code, or minus the signal that killed it), waiting
        at most ``within`` seconds for it to end; None while it runs. Optional in a launch handle: a
        launcher's own processes are the only ones whose end it can read."""
        self._reap()
        if pid in self.pids and pid not in self.status:
            wait_for_exits([pid], within)
            self._reap()
        return self.status.get(pid)

    def terminate(self, grace: float = 5.0) -> None:
        self._reap()
        live = [pid for pid in self.pids if pid not in self.status]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for pid in live:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = monotonic() + wait
            while live and monotonic() < deadline:
                self._reap()
                live = [pid for pid in live if pid not in self.status]
                if live:
                    sleep(0.02)
            if not live:
                break


def check_local_world(config: pytest.Config, world_size: int, *, where: str = "") -> None:
    """Refuse a local world this machine cannot hold (``--world-check``), naming the figures and the way out."""
    if not config.stash[settings_key].world_check:
        return
    why = local_world_shortfall(world_size)
    if why is not None:
        raise LaunchError(
            f"{where + ': ' if where else ''}{why}. Ask for fewer ranks, raise the limit, or pass "
            "--world-check=off (SPRITE_WORLD_CHECK=off) to start it anyway"
        )


def _agent_main(request: LaunchRequest, rank: int, one_thread: bool) -> NoReturn:
    """Body of the forked agent of ``rank``: close the controller's descriptors, then serve; never returns.

    ``one_thread``: the controller ran tests before this launch (a pool replaced after a lost agent, or a
    launch that failed at collection's end), so it may hold OpenMP's thread pool, which a fork cannot use:
    this agent and everything it forks run torch's CPU ops on one thread (see ``computing_before_fork``).
    """
    for fd in request.close_in_agent:
        os.close(fd)
    if one_thread:
        one_thread_after_fork()
    from ...rank.main import forked_agent_main

    assert request.config is not None
    controller = (request.controller_host, request.controller_port, request.token)
    forked_agent_main(
        config=request.config,
        items=request.items,
        rank=rank,
        world_size=request.world_size,
        controller=controller,
        log_path=request.log_path,
    )


class LocalLauncher:
    """Forks W agents of this very process (one host, no external launcher)."""

    name = "local"
    spans_nodes = False

    def check(self) -> None:
        """Always available on POSIX."""

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        if request.config is None:
            raise ValueError(
                "the local launcher needs LaunchRequest.config: its agents are forks of this session"
            )
        request.log_path.parent.mkdir(parents=True, exist_ok=True)
        preimport_torch()
        check_local_world(request.config, request.world_size)
        # What many tests need alike, loaded once here: every agent, test child and zygote copies it.
        config = request.config
        for item in request.items.values():
            # pytest works out an item's location (relative path, line) on first use, in each process
            # that reports it: once here, and the controller and every test child reuse it.
            # An item whose location fails is left to fail in its own test's report, as it would anyway.
            with contextlib.suppress(Exception):
                item.location  # noqa: B018
        with computing_before_fork():
            config.hook.pytest_sprite_before_fork(config=config, items=list(request.items.values()))
        # Freeze the collected heap (torch's included) out of the cyclic collector: agents and their
        # children then share it copy-on-write instead of copying every page a collection touches,
        # and the controller's own end-of-session collections skip it.
        gc.freeze()
        # Every agent, spare and zygote forks from its huge pages: one test child per rank of each ranks test.
        collapse_heap_once(forks=sum(item.stash.get(world_size_key, 0) for item in request.items.values()))
        one_thread = tests_ran_here()
        pids = []
        controller = os.getpid()
        for rank in range(request.world_size):
            with warnings.catch_warnings():
                # Python 3.12+ warns when a process with threads forks (a CUDA build of torch starts
                # some at import). An agent touches none of the state those threads guard: it only
                # serves its socket and forks test children, which initialize devices themselves.
                warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                try:
                    # Dies with the controller: a signal that ends it at any moment of this loop ends every
                    # agent forked so far (one that lost its parent before prctl took effect leaves at once).
                    if die_with_parent() and os.getppid() != controller:
                        os._exit(1)
                    os.setpgid(0, 0)  # the terminal's Ctrl-C reaches the controller, which ends the agents
                    _agent_main(request, rank, one_thread)
                finally:
                    os._exit(1)
            pids.append(pid)
        return _ForkedAgents(pids, request)
