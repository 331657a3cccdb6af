"""Lightning on Intel XPU: the code under test that the plugin's parity and checkpoint checks exercise.

Lightning 2.6 has no XPU accelerator, autocasts custom accelerators for "cuda", wraps DDP in a CUDA stream,
shards nothing with ModelParallelStrategy's "auto" mesh on one node, and self-spawns under mpiexec without
mpi4py. This package fills those gaps; importing it registers the "xpu" accelerator with Lightning.

This package never imports the pytest plugin: it is what the plugin tests.
"""

from __future__ import annotations

from pytest_sprite.lightning._kwargs import trainer_kwargs
from pytest_sprite.lightning.accelerator import XPUAccelerator, _register
from pytest_sprite.lightning.environment import PALSEnvironment
from pytest_sprite.lightning.precision import XPUMixedPrecision
from pytest_sprite.lightning.sharding import shard_model
from pytest_sprite.lightning.strategies import FSDP2Strategy, XPUDDPStrategy

__all__ = [
    "FSDP2Strategy",
    "PALSEnvironment",
    "XPUAccelerator",
    "XPUDDPStrategy",
    "XPUMixedPrecision",
    "shard_model",
    "trainer_kwargs",
]

_register()
