"""Agent entry points: a fork of the local controller, or a pytest session started by a launcher.

Launched agents run ``python -m pytest <the user's arguments> --sprite-agent=HOST:PORT`` on every
rank: they collect the same tests, read their rank from the launcher's variables, connect back
and serve instead of running the test loop.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import pytest

from ..errors import SpriteError
from ..plumbing.process import computing_before_fork, name_process, preimport_torch, redirect_output
from .agent import Agent, connect_to_controller

__all__ = ["AgentSessionPlugin", "forked_agent_main"]


def _preimport_hypothesis(items: Mapping[str, pytest.Item]) -> None:
    """With @given tests, import what hypothesis' report of a failure imports, once per agent.

    Hypothesis imports its patch writer (libcst) while it makes a failure's report: seconds in every
    failing child, long enough for the grace after a failed rank (--rank-grace) to end the ranks and
    add a teardown error to the test.
    """
    if "hypothesis" not in sys.modules:
        return
    from hypothesis import is_hypothesis_test

    if any(is_hypothesis_test(getattr(item, "obj", None)) for item in items.values()):
        from ..plumbing.dependency_internals import prewarm_hypothesis_patching

        prewarm_hypothesis_patching()


def forked_agent_main(
    *,
    config: pytest.Config,
    items: Mapping[str, pytest.Item],
    rank: int,
    world_size: int,
    controller: tuple[str, int, str],
    log_path: Path,
) -> NoReturn:
    """Body of a locally forked agent; never returns. ``controller``: where it listens, and the session's token."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        name_process("agent")
        redirect_output(log_path)
        preimport_torch()
        _preimport_hypothesis(items)
        host, port, token = controller
        sock = connect_to_controller(host, port)
        agent = Agent(config=config, items=items, rank=rank, sock=sock, rendezvous_bind="127.0.0.1")
        agent.say_ready(token=token, local_rank=rank, world_size=world_size)
        agent.serve()
    except SpriteError as exc:
        print(f"pytest-sprite rank agent {rank}: {exc}", file=sys.stderr)
        code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


class AgentSessionPlugin:
    """Turns a pytest session started by a launcher into a rank agent."""

    def __init__(self, config: pytest.Config, address: str) -> None:
        self.config = config
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise pytest.UsageError(f"--sprite-agent={address!r}: expected HOST:PORT (set by the controller)")
        self.host, self.port = host, int(port)
        self.items: dict[str, pytest.Item] = {}
        self.collect_errors: dict[str, str] = {}
        """This agent's collection errors (node id -> text): the controller shows those it did not see."""
        # An agent writes no result files of its own; the controller writes them.
        config.option.xmlpath = None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Any:
        # Before any deselection: the controller may ask for any collected test.
        self.items.update((item.nodeid, item) for item in items)
        return (yield)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = report.longreprtext

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        from ..env.rank_variables import read_rank_env

        world = os.environ.get("SPRITE_WORLD_SIZE")
        try:
            info = read_rank_env(world_size=int(world) if world else None)
        except SpriteError as exc:  # the reader's explanation, not a traceback, in the launch log's tail
            print(f"pytest-sprite rank agent: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
        name_process("agent")
        preimport_torch()
        _preimport_hypothesis(self.items)
        with computing_before_fork():
            self.config.hook.pytest_sprite_before_fork(config=self.config, items=list(self.items.values()))
        sock = connect_to_controller(self.host, self.port)
        agent = Agent(config=self.config, items=self.items, rank=info.rank, sock=sock)
        agent.say_ready(
            token=os.environ.get("SPRITE_TOKEN", ""),
            local_rank=info.local_rank,
            world_size=info.world_size,
            node=info.node_rank,
            collect_errors=self.collect_errors,
        )
        agent.serve()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
