"""Collectives on the ranks' devices: the process group the harness builds works at every world size."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from pytest_sprite.world import World  # noqa: E402

SIZES = [1, 2, 3, 4, 8, 12, 24, 48, "world"]  # "world": --ranks, whatever it is


@pytest.mark.ranks(SIZES)
def test_all_reduce_all_gather_broadcast(world: World) -> None:
    n, r = world.size, world.rank
    t = torch.full((1000,), float(r + 1), device=world.device)
    dist.all_reduce(t)
    assert t.device.type == world.device.type
    assert torch.equal(t.cpu(), torch.full((1000,), n * (n + 1) / 2))
    gathered = world.gather(torch.arange(r + 1, device=world.device))
    assert [g.cpu().tolist() for g in gathered] == [list(range(k + 1)) for k in range(n)]
    assert world.broadcast_object({"from": r}, src=n - 1) == {"from": n - 1}
    world.barrier()
