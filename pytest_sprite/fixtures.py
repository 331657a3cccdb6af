"""In-rank fixtures: ``world`` (and the recipe fixtures, registered beside it)."""

from __future__ import annotations

import pytest

from .glue.collected import store_collected
from .glue.options import settings_key
from .world import World, current_world

__all__ = ["world"]


@pytest.fixture
def world(request: pytest.FixtureRequest) -> World:
    """This rank's World: rank, size, device, backend, collectives and ``collect``.

    Outside a ranks test it is a world of one with no process group; ``collect`` then keeps the
    tensor with the test's item directly.
    """
    current = current_world()
    if current is not None:
        return current
    from .env.device import select_device

    device, _ = select_device(request.config.stash[settings_key].device, 0, 1, bind=False)
    item = request.node
    return World.alone(
        device,
        sink=lambda name, rank, tensor: store_collected(item, name, rank, tensor),
        test_dir=lambda: request.getfixturevalue("tmp_path"),
    )
