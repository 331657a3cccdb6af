"""Why the ranks cannot inherit DTensor's sharding cache from one warm parent, reproduced with torch alone.

A parent that runs an FSDP2 fit before forking its ranks hands them DTensor's per-process sharding cache
filled: their own first fit then skips most of its set-up. The cache's keys hold the ``DeviceMesh`` compared
by value (its ranks, layout, device type and dimension names), which leaves out which rank the process is;
its cached output specs hold the mesh object of the process that filled it. A rank forked from a parent
that warmed as rank 0 gets back rank 0's mesh on every output of a cache hit, and with it rank 0's
coordinate: DTensor's distributed-checkpoint planning then places every rank's shard at rank 0's offset.
The parent warms on torch's own fake process group (``torch.testing``'s, what torch's tests use); the ranks
run on gloo.

    python bench/upstream_inherited_sharding_cache.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

WORLD = 2


def fit() -> None:
    """A few FSDP2 steps of a small stack of linears over the whole world, and the probe's op."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32 + i, 33 + i) for i in range(8)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]) + 1


def rank(r: int, init: str) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=r, world_size=WORLD)
    start = time.perf_counter()
    fit()
    seconds = time.perf_counter() - start
    mesh = init_device_mesh("cpu", (WORLD,))
    out: Any = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]) + 1
    dist.destroy_process_group()
    return (
        f"  rank {r}: first fit {seconds:.2f} s; its mesh's coordinate {mesh.get_coordinate()}, "
        f"an op's output's {out.device_mesh.get_coordinate()}"
    )


def main(warm: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # a parent that computed on threads leaves its forks' OpenMP unusable
    if warm:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        fit()
        dist.destroy_process_group()
    folder = tempfile.mkdtemp()
    pids = []
    for r in range(WORLD):
        pid = os.fork()
        if pid == 0:
            line = rank(r, f"file://{folder}/store")
            with open(f"{folder}/rank{r}", "w") as out:
                out.write(line)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    for r in range(WORLD):
        with open(f"{folder}/rank{r}") as lines:
            print(lines.read())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1] == "warm")
    else:
        import subprocess

        for mode in ("cold", "warm"):
            print(f"parent {mode}:", flush=True)
            subprocess.run([sys.executable, __file__, mode], check=True)
