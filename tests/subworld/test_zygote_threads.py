"""A zygote that computed before it forked leaves its sub-world ranks free to compute on threads (GNU OpenMP)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_sprite import run_subworld

pytestmark = pytest.mark.cpu


def threaded_matmuls(world: Any, n: int) -> int:
    """A 1-rank role's shape: Lightning gives its only process every core, and a matmul runs on them."""
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(n):
        a = (a @ a).tanh()
    return world.rank


def copy_a_large_model(n: int) -> None:
    """What a role's preparation does in the zygote: copy a cached model, parallel on the zygote's threads."""
    x = torch.randn(4096, 1024)
    torch.empty_like(x).copy_(x)
    _ = x @ x.T


threaded_matmuls.subworld_prepare = copy_a_large_model  # type: ignore[attr-defined]


@pytest.mark.ranks(2)
def test_ranks_forked_after_the_zygote_prepared_can_use_threads(world: Any) -> None:
    # Without the preparation on one thread, the rank's first parallel matmul waits forever for OpenMP
    # threads its fork did not copy, and the sub-world times out.
    result = run_subworld(threaded_matmuls, args=(20,), ranks=1, timeout=60)
    assert result.values() == [0], result.report()
