"""Join a world: the one way a fresh rank process gets its variables, device, store and default process group.

A test child (``rank/child.py``) and a sub-world rank (``subworld/rank_body.py``) both start as a fresh fork with
no device and no process group; each becomes one rank of its world the same way. They differ only
in who hosts the rendezvous store (the test's rank 0, or the process that started the sub-world) and in where
the world's collected tensors go. A rank of a test that makes its own groups (``ranks(n, init=False)``, and
torch's ``MultiProcessTestCase`` tests run on ranks) joins without a store or a default group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_sprite.env.device import select_device
from pytest_sprite.env.rank_variables import become_rank, torchrun_variables
from pytest_sprite.plumbing.placement import Placement
from pytest_sprite.world import World, _set_current

if TYPE_CHECKING:
    import torch

__all__ = ["Seat", "join_world", "store_listener", "tcp_store"]


@dataclass(frozen=True, kw_only=True)
class Seat(Placement):
    """Where one rank sits in the world it joins: its placement on the world's nodes, and the world's rendezvous."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str
    """The device kind asked for (``auto``, ``cpu``, ``cuda``, ``xpu``)."""
    timeout: float
    """Seconds the rank may run; the store and the process group wait a minute longer."""

    def export_env(self) -> None:
        """torchrun's variables for this rank, so that a Lightning ``Trainer(devices=n)`` uses this world."""
        become_rank(
            torchrun_variables(
                rank=self.rank,
                local_rank=self.local_rank,
                world_size=self.world_size,
                local_world_size=self.local_size,
                node=self.node,
                master_addr=self.master_addr,
                master_port=self.master_port,
            )
        )


def store_listener(bind: str) -> socket.socket:
    """An IPv4 socket listening on ``bind`` (``""``: every interface), for a TCPStore to serve (``listen_fd``).

    Listening before anyone connects, so no client is refused or waits out TCPStore's reconnect backoff,
    and before the processes that connect are forked. IPv4, so the store names each local peer from
    /etc/hosts: torch's own server listens on ``::``, sees ``::ffff:127.0.0.1``, and asks DNS to name it.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((bind, 0))
    listener.listen(1024)
    return listener


def tcp_store(
    host: str,
    port: int,
    *,
    is_master: bool,
    timeout: timedelta | None = None,
    world_size: int | None = None,
    listen_fd: int | None = None,
) -> Any:
    """A TCPStore (torch exports the class without a type stub); ``listen_fd`` is an already listening socket."""
    import torch.distributed as dist

    make: Any = getattr(dist, "TCPStore")  # noqa: B009
    extra = {} if world_size is None and listen_fd is None else {"world_size": world_size}
    if listen_fd is not None:
        extra["master_listen_fd"] = listen_fd
    return make(
        host,
        port,
        is_master=is_master,
        timeout=timeout or timedelta(seconds=300),
        wait_for_workers=False,
        **extra,
    )


def _check_collectives() -> None:
    """Wrap every group in torch's fingerprint check; the environment variable carries it into the
    processes the test starts (Lightning, sub-worlds)."""
    import torch.distributed as dist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # type: ignore[attr-defined]


def join_world(
    seat: Seat,
    *,
    connect: Callable[[timedelta], Any] | None,
    sink: Callable[[str, int, torch.Tensor], None],
    group_prefix: str | None = None,
    collective_check: bool = False,
    test_dir: Callable[[], Path] | None = None,
    group_backend: Callable[[str], str] | None = None,
) -> tuple[World, Any]:
    """Device and default process group of this rank, on the store ``connect(timeout)`` returns.

    The World made is this process's current world. ``group_prefix`` keeps the group's keys apart from
    what else uses the store; ``collective_check`` wraps every group in torch's fingerprint check;
    ``group_backend`` maps the device's backend to the one the default group is made with (``--sprite-mutate``'s
    recording and mutating wrapper).
    Returns the world and the store. Raises when this process already has a default process group: a fresh
    rank never does, and a group inherited through a fork must not be reused.

    ``connect=None`` joins without a store and without a default process group: the device is chosen and
    the World made as usual, and the code the rank runs makes its own groups; the store
    returned is None.
    """
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // seat.local_size))
    device, backend = select_device(seat.device, seat.device_index, seat.local_size)
    if collective_check:
        _check_collectives()
    if dist.is_initialized():
        raise RuntimeError(f"rank {seat.rank} started with a process group already initialized")
    store = None
    if connect is not None:
        timeout = timedelta(seconds=seat.timeout + 60)
        store = connect(timeout)
        prefix_store: Any = getattr(dist, "PrefixStore")  # noqa: B009 (torch exports it without a stub)
        dist.init_process_group(
            backend=backend if group_backend is None else group_backend(backend),
            store=store if group_prefix is None else prefix_store(group_prefix, store),
            rank=seat.rank,
            world_size=seat.world_size,
            timeout=timeout,
        )
    world = World(
        rank=seat.rank,
        size=seat.world_size,
        local_rank=seat.local_rank,
        local_size=seat.local_size,
        local_devices=seat.local_devices,
        node=seat.node,
        device=device,
        backend=backend,
        _sink=sink,
        _test_dir=test_dir,
    )
    _set_current(world)
    return world, store
