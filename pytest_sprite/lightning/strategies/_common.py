"""What XPUDDPStrategy and FSDP2Strategy share: backend choice, launch checks, leaving the process as found."""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.environments.lightning import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy

from pytest_sprite.env.device import default_backend
from pytest_sprite.env.rank_variables import optional_rank_env
from pytest_sprite.errors import RankEnvError, SpriteUsageError
from pytest_sprite.lightning.environment import PALSEnvironment

__all__ = [
    "LaunchScoped",
    "ProcessScope",
    "check_launch",
    "default_cluster_environment",
    "prepare_launch",
    "process_group_backend",
]

# Set by Lightning's launcher (`_SubprocessScriptLauncher`) and `_init_dist_connection` in this process.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def process_group_backend(device: torch.device, requested: str | None) -> str:
    """``requested``, else gloo on CPU and xccl on XPU (Lightning 2.6 would pick gloo for any non-CUDA device).

    torch maps xpu to xccl, which CPU builds lack; CPU runs therefore always get gloo.
    """
    if requested is not None:
        return requested
    backend = default_backend(device.type)
    if backend is None:
        raise SpriteUsageError(
            f"no default process group backend for device type {device.type!r}; pass "
            f"process_group_backend= to the strategy (gloo for cpu, xccl for xpu, nccl for cuda)."
        )
    if backend == "xccl" and not dist.is_xccl_available():
        raise RuntimeError(
            f"the root device is {device} but this torch build ({torch.__version__}) has no xccl backend; use "
            f"a torch build with XPU support (on Aurora: `module load frameworks`), or accelerator='cpu'."
        )
    return backend


def default_cluster_environment(given: ClusterEnvironment | None) -> ClusterEnvironment | None:
    """``given``, else :class:`PALSEnvironment` in a process PALS mpiexec started, else Lightning's choice."""
    if given is not None:
        return given
    return PALSEnvironment() if PALSEnvironment.detect() else None


def check_launch(
    strategy: str, environment: ClusterEnvironment, *, num_processes: int, num_nodes: int, global_rank: int
) -> None:
    """Under an external launcher, require devices x num_nodes processes and this rank inside them.

    Lightning validates the process count only under torchelastic; elsewhere a Trainer with ``devices=2`` in
    a 4-process launch indexes past its device list or trains a world that disagrees with the process group.
    """
    if not environment.creates_processes_externally:
        return
    expected = num_processes * num_nodes
    launched, source = _launched_world(environment)
    if launched is not None and launched != expected:
        raise SpriteUsageError(
            f"{strategy}: Trainer(devices={num_processes}, num_nodes={num_nodes}) expects {num_processes} x "
            f"{num_nodes} = {expected} processes, but {launched} were launched ({source}). Set devices to the "
            f"processes per node and num_nodes to the node count, or launch {expected} processes."
        )
    local_rank = environment.local_rank()
    if not 0 <= local_rank < num_processes:
        raise SpriteUsageError(
            f"{strategy}: this process has local rank {local_rank} ({type(environment).__name__}), but "
            f"Trainer(devices={num_processes}) gives each node only devices 0..{num_processes - 1}. Set "
            f"devices to the number of processes the launcher starts per node."
        )
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != global_rank:
        raise RankEnvError(
            f"{strategy}: the initialized process group has this process as rank {dist.get_rank()}, but "
            f"Lightning computes rank {global_rank} (node rank {environment.node_rank()} x {num_processes} "
            f"devices + local rank {local_rank}, from {type(environment).__name__}). Export NODE_RANK and "
            f"LOCAL_RANK that match the process group, or launch ranks in node-major order."
        )


class _LaunchedStrategy(Protocol):
    """What :func:`prepare_launch` reads from XPUDDPStrategy and FSDP2Strategy."""

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def global_rank(self) -> int: ...


def prepare_launch(strategy: _LaunchedStrategy, scope: ProcessScope) -> None:
    """What both strategies do before Lightning's launcher runs: remember the launch variables, check the launch."""
    environment = strategy.cluster_environment
    name = type(strategy).__name__
    if environment is None:
        raise RuntimeError(f"{name} has no cluster environment; build it through lightning.Trainer")
    scope.remember_environment()
    check_launch(
        name,
        environment,
        num_processes=strategy.num_processes,
        num_nodes=strategy.num_nodes,
        global_rank=strategy.global_rank,
    )


def _launched_world(environment: ClusterEnvironment) -> tuple[int | None, str]:
    """How many processes the launch started, and who says so; (None, ...) when nobody knows."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "size of the already initialized default process group"
    if not isinstance(environment, LightningEnvironment):
        return environment.world_size(), type(environment).__name__
    # LightningEnvironment's world size is whatever Lightning told it; ask the launcher variables instead.
    try:
        info = optional_rank_env(use_mpi4py=False)
    except RankEnvError:
        return None, "launcher variables incomplete"
    if info is None:
        return None, "no launcher variables"
    return info.world_size, ", ".join(info.sources)


class ProcessScope:
    """Leave the process as found: restore the launch variables and destroy a process group we created.

    After an in-process fit Lightning leaves MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK in
    ``os.environ`` and the default process group initialized; a later Trainer in the same process then
    believes it was launched externally and reuses a group of the wrong size. A group that existed before
    (a launcher's, or the test harness's) is left alone.
    """

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}
        self._owns_process_group = False

    def remember_environment(self) -> None:
        """Record the launch variables; called when the Trainer is built, before Lightning's launcher runs."""
        self._saved = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}

    def before_process_group_init(self) -> None:
        """Note whether the default process group already exists (then it is not ours to destroy)."""
        self._owns_process_group = not (dist.is_available() and dist.is_initialized())

    def restore(self) -> None:
        """Destroy the process group if we created it, and put the launch variables back."""
        if self._owns_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class LaunchScoped(ParallelStrategy):
    """What XPUDDPStrategy and FSDP2Strategy do around Lightning's launch, in one place.

    Check the launch before Lightning's launcher runs, pick the process group backend from the root device,
    and leave the process as found after the fit. Listed before the Lightning strategy in the bases, so
    ``super()`` reaches DDPStrategy's or ModelParallelStrategy's own methods.
    """

    _scope: ProcessScope
    _process_group_backend: str | None

    def _configure_launcher(self) -> None:
        prepare_launch(self, self._scope)  # type: ignore[arg-type]  # the concrete strategies have the sizes
        super()._configure_launcher()

    def setup_environment(self) -> None:
        self._scope.before_process_group_init()
        super().setup_environment()

    def _get_process_group_backend(self) -> str:
        return process_group_backend(self.root_device, self._process_group_backend)

    def teardown(self) -> None:
        super().teardown()
        self._scope.restore()
