"""Tensors that ranks sent with ``world.collect``, kept with the test's item in the controller."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

__all__ = ["collected", "collected_key", "store_collected"]

collected_key = pytest.StashKey[dict[str, dict[int, Any]]]()
"""name -> rank -> tensor, or its base64 ``torch.save`` bytes until first read."""


def store_collected(item: pytest.Item, name: str, rank: int, value: Any) -> None:
    """Keep one rank's collected value under ``name`` (later ranks never overwrite earlier ones)."""
    item.stash.setdefault(collected_key, {}).setdefault(name, {})[rank] = value


def collected(item: pytest.Item) -> dict[str, list[torch.Tensor]]:
    """The tensors every rank collected during ``item``, by name, in rank order."""
    out: dict[str, list[Any]] = {}
    for name, per_rank in item.stash.get(collected_key, {}).items():
        for rank in sorted(per_rank):
            value = per_rank[rank]
            if isinstance(value, str):
                import torch

                value = torch.load(io.BytesIO(base64.b64decode(value)), weights_only=True)
                per_rank[rank] = value
            out.setdefault(name, []).append(value)
    return out
