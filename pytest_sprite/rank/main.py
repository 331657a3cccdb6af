"""Agent entry points: a fork of the local controller, or a pytest session started by a launcher.

Launched agents run ``python -m pytest <the user's arguments> --sprite-agent=HOST:PORT`` on every
rank: they collect the same tests, read their rank from the launcher's variables, connect back
and serve instead of running the test loop.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .._wire import send_frame
from ..errors import SpriteError
from .agent import Agent, connect_to_controller

__all__ = ["AgentSessionPlugin", "forked_agent_main"]


def _preimport_torch() -> None:
    """Import torch.distributed once per agent, so each forked child starts warm (no device touched)."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        pass


def _hello(
    sock: socket.socket, *, token: str, rank: int, local_rank: int, world_size: int, node: int | None = None
) -> None:
    """Tell the controller who this agent is: its rank and where the launcher placed it."""
    send_frame(
        sock,
        "agent_ready",
        token=token,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        node=node,
        host=socket.gethostname(),
        pid=os.getpid(),
    )


def forked_agent_main(
    *,
    config: pytest.Config,
    items: Mapping[str, pytest.Item],
    rank: int,
    world_size: int,
    host: str,
    port: int,
    token: str,
    log_path: Path,
) -> NoReturn:
    """Body of a locally forked agent; never returns."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        _preimport_torch()
        sock = connect_to_controller(host, port)
        _hello(sock, token=token, rank=rank, local_rank=rank, world_size=world_size)
        Agent(config=config, items=items, rank=rank, sock=sock).serve()
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
        # An agent writes no result files of its own; the controller writes them.
        config.option.xmlpath = None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Any:
        # Before any deselection: the controller may ask for any collected test.
        self.items.update((item.nodeid, item) for item in items)
        return (yield)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        from .._rankenv import read_rank_env

        world = os.environ.get("SPRITE_WORLD_SIZE")
        try:
            info = read_rank_env(world_size=int(world) if world else None)
        except SpriteError as exc:  # the reader's explanation, not a traceback, in the launch log's tail
            print(f"pytest-sprite rank agent: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
        _preimport_torch()
        sock = connect_to_controller(self.host, self.port)
        _hello(
            sock,
            token=os.environ.get("SPRITE_TOKEN", ""),
            rank=info.rank,
            local_rank=info.local_rank,
            world_size=info.world_size,
            node=info.node_rank,
        )
        Agent(config=self.config, items=self.items, rank=info.rank, sock=sock).serve()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
