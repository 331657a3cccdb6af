"""Cluster environment for processes started by PALS ``mpiexec`` (Aurora), read through the one rank reader.

Without mpi4py Lightning's ``MPIEnvironment`` is off (``mpi.py:73-74``), ``LightningEnvironment`` sees no
``LOCAL_RANK`` and DDP spawns its own workers: ``mpiexec -n 2`` with ``devices=2`` becomes two independent
2-process jobs. :class:`PALSEnvironment` says the processes were created externally and takes rank, local rank,
world size, node and rendezvous from :mod:`pytest_sprite.env.rank_variables`, so every launcher variable that is set
must agree (a stale ``RANK=0`` from an outer launcher raises instead of making every rank rank 0).
"""

from __future__ import annotations

import logging
import os

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

from pytest_sprite.env.rank_variables import (
    SHARED_PORT_VARIABLES,
    RankInfo,
    read_rank_env,
    rendezvous_host,
    rendezvous_port,
)
from pytest_sprite.errors import RankEnvError, SpriteUsageError

__all__ = ["PALSEnvironment"]

_log = logging.getLogger(__name__)

# Where rendezvous_port finds a port all ranks agree on without communicating.
_PORT_SOURCES = SHARED_PORT_VARIABLES


class PALSEnvironment(ClusterEnvironment):
    """Rank, world and rendezvous of a PALS (or any MPI-style) launch, fixed when the environment is created.

    The world size comes from the launcher variables (``mpiexec --env WORLD_SIZE=<ranks>``), else mpi4py's
    ``COMM_WORLD``; the rendezvous host is MASTER_ADDR, else the first host of PBS_NODEFILE; the port is
    MASTER_PORT, else derived from PBS_JOBID, so all nodes agree without communicating.
    """

    def __init__(self) -> None:
        super().__init__()
        self._info: RankInfo = read_rank_env()
        self._main_address: str | None = None
        self._main_port: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        if self._main_address is None:
            self._main_address = rendezvous_host()
        return self._main_address

    @property
    def main_port(self) -> int:
        if self._main_port is None:
            if self.world_size() > 1 and not any(os.environ.get(name, "").strip() for name in _PORT_SOURCES):
                # rendezvous_port's last resort is a port this process finds free: every rank would pick
                # its own and the rendezvous would hang until its timeout.
                raise RankEnvError(
                    f"no rendezvous port for {self.world_size()} ranks: none of {', '.join(_PORT_SOURCES)} is "
                    f"set, and a free port chosen by each rank alone differs between ranks. Run inside a PBS "
                    f"job (PBS_JOBID derives the port) or launch with `mpiexec --env MASTER_PORT=<port> ...`."
                )
            self._main_port = rendezvous_port()
        return self._main_port

    @staticmethod
    def detect() -> bool:
        """True in a process started by PALS mpiexec (it sets PALS_RANKID)."""
        return bool(os.environ.get("PALS_RANKID", "").strip())

    def world_size(self) -> int:
        return self._info.world_size

    def set_world_size(self, size: int) -> None:
        # The launch fixes the world; validate_settings reports a Trainer that disagrees with it.
        _log.debug(
            "PALSEnvironment.set_world_size(%s) ignored: the launcher fixed %s", size, self.world_size()
        )

    def global_rank(self) -> int:
        return self._info.rank

    def set_global_rank(self, rank: int) -> None:
        _log.debug(
            "PALSEnvironment.set_global_rank(%s) ignored: the launcher fixed %s", rank, self.global_rank()
        )

    def local_rank(self) -> int:
        return self._info.local_rank

    def node_rank(self) -> int:
        info = self._info
        if info.node_rank is not None:
            return info.node_rank
        if info.local_world_size:
            return info.rank // info.local_world_size
        return 0

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise when the Trainer's devices x num_nodes is not the number of processes the launcher started."""
        if num_devices * num_nodes != self.world_size():
            raise SpriteUsageError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) expects {num_devices} x {num_nodes} = "
                f"{num_devices * num_nodes} processes, but the launcher started {self.world_size()} (from "
                f"{', '.join(self._info.sources)}). Launch `mpiexec -n {num_devices * num_nodes} --ppn "
                f"{num_devices}`, or set devices to the ranks per node and num_nodes to the node count."
            )
