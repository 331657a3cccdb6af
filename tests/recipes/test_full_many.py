"""``full_many`` knows each rank's share of a ``Shard(0)`` tensor without asking: ``torch.chunk``'s split."""

from __future__ import annotations

import pytest
import torch

from pytest_sprite.recipes.fit_kit import _chunk_numel

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 8, 11])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
def test_a_ranks_share_follows_torch_chunk(rows: int, size: int) -> None:
    chunks = list(torch.chunk(torch.zeros(rows, 3), size)) if rows else []
    for rank in range(size):
        want = chunks[rank].numel() if rank < len(chunks) else 0
        assert _chunk_numel((rows, 3), size, rank) == want


@pytest.mark.ranks(3)
def test_whole_values_of_unevenly_sharded_tensors(world: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pytest_sprite.recipes.fit_kit import full_many

    mesh = init_device_mesh("cpu", (3,))
    whole = [torch.arange(float(n * 2)).reshape(n, 2) for n in (1, 2, 4, 5)] + [torch.arange(3.0)]
    sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in whole]
    got = full_many([*sharded, torch.ones(2)])
    assert all(g.equal(w) for g, w in zip(got, [*whole, torch.ones(2)], strict=True))
