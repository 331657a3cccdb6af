"""A cost torch pays in every fresh process that runs DTensor, reproduced without pytest-sprite.

DTensor caches each operator's sharding propagation per process. On a miss (the first ``add_`` of each new
shape, every Adam step's ops on each new parameter shape) it computes the output's metadata under a new
``FakeTensorMode``, and ``FakeTensorMode.__init__`` keeps ``traceback.extract_stack()`` of its caller:
the whole Python stack, source lines read, however deep. Under pytest and a Lightning fit that stack is
100-200 frames, so each miss costs milliseconds, paid again by every fresh process (each rank of each fit
that must start clean: a resume check's restores). This prints both costs at a shallow and a deep stack, on
a world of one rank (gloo), with public API only.

    python bench/upstream_fake_tensor_stack.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

DEPTHS = (5, 150)
SHAPES = 60


def at_depth(depth: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` called ``depth`` Python frames below here."""
    return fn() if depth == 0 else at_depth(depth - 1, fn)


def fake_mode_seconds(depth: int, repeat: int = 200) -> float:
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    for _ in range(repeat):
        at_depth(depth, FakeTensorMode)
    return (time.perf_counter() - start) / repeat


def first_ops_seconds(depth: int, offset: int) -> float:
    """Seconds per first ``add_`` of a new shape on a DTensor (a sharding-propagation cache miss)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    tensors = [distribute_tensor(torch.zeros(offset + i, 3), mesh, [Shard(0)]) for i in range(SHAPES)]
    start = time.perf_counter()
    for t in tensors:
        at_depth(depth, lambda t=t: t.add_(1.0))
    return (time.perf_counter() - start) / SHAPES


def main() -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        fake_mode_seconds(0, repeat=5)  # first use imports and warms; not timed
        first_ops_seconds(0, offset=10_000)
        print(f"torch {torch.__version__}")
        print(f"{'stack depth':>12}  {'FakeTensorMode()':>18}  {'DTensor op, cache miss':>24}")
        for k, depth in enumerate(DEPTHS):
            fake = fake_mode_seconds(depth)
            miss = first_ops_seconds(depth, offset=1 + k * SHAPES)  # shapes not seen before
            print(f"{depth:>12}  {fake * 1e3:>15.3f} ms  {miss * 1e3:>21.3f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
