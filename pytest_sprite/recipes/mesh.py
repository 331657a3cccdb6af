"""The data-parallel DeviceMesh over a test's ranks, on the ranks' own device type.

Shared by the ``xpu_mesh`` fixture and the fsdp arm (when its strategy brings no mesh of its own), so both
shard over the same ranks with the same dimension name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_sprite.errors import SpriteUsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pytest_sprite.world import World

__all__ = ["DATA_PARALLEL", "data_parallel_mesh"]

DATA_PARALLEL = "data_parallel"
"""Name of the mesh dimension every data-parallel arm shards over (Lightning's ModelParallelStrategy name)."""


def data_parallel_mesh(world: World) -> DeviceMesh:
    """A 1-D mesh named ``data_parallel`` over every rank of ``world``, on ``world.device``'s type.

    Needs the default process group of a ranks test; a world of one has none, and the ``xpu_mesh``
    fixture gives it a private one-rank group instead (see ``recipes.fixtures``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise SpriteUsageError(
            "data_parallel_mesh needs torch.distributed's default process group, which only a test marked "
            "@pytest.mark.ranks(n) has; without the marker use the xpu_mesh fixture (a one-rank mesh)"
        )
    if dist.get_world_size() != world.size:
        raise SpriteUsageError(
            f"the default process group has {dist.get_world_size()} ranks but the test's world has {world.size}; "
            "the mesh must span exactly the test's ranks"
        )
    return init_device_mesh(world.device.type, (world.size,), mesh_dim_names=(DATA_PARALLEL,))
