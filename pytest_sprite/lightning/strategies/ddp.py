"""DDP without CUDA: gloo on CPU, xccl on XPU.

Lightning 2.6's ``DDPStrategy._setup_model`` wraps the model inside ``torch.cuda.stream(torch.cuda.Stream())``
whenever ``device_ids`` is set (``ddp.py:194``), and it sets them for every non-CPU device (lines 290-293):
on XPU that raises, because the build has no CUDA. It also picks gloo for every non-CUDA device.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from pytest_sprite.lightning._internals import ddp_constructor_kwargs
from pytest_sprite.lightning.strategies._common import (
    LaunchScoped,
    ProcessScope,
    default_cluster_environment,
)

__all__ = ["XPUDDPStrategy"]


class XPUDDPStrategy(LaunchScoped, DDPStrategy):
    """Lightning's DDPStrategy with no ``torch.cuda`` call, the right backend per device, and launch checks.

    Under an external launcher (PALS, torchrun, an already initialized process group) it checks that the
    launch started devices x num_nodes processes; it picks :class:`PALSEnvironment` automatically when PALS
    started the process; after the fit it leaves the process's launch variables as it found them.
    """

    strategy_name = "xpu_ddp"

    def __init__(self, *, cluster_environment: ClusterEnvironment | None = None, **kwargs: Any) -> None:
        super().__init__(cluster_environment=default_cluster_environment(cluster_environment), **kwargs)
        self._scope = ProcessScope()

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        """Wrap in DDP on the root device; no CUDA side stream (XPU and CPU builds have no ``torch.cuda``)."""
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(module=model, device_ids=device_ids, **ddp_constructor_kwargs(self))
