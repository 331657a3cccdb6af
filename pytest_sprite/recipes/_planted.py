"""The LightningModule both arm kits start from: a recipe's model, its rows and the fault planted into it.

Loaded only with ``_arm`` and ``_bf16_arm`` (it imports Lightning at the top).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from pytest_sprite.faults import Planter, PlantSite
from pytest_sprite.recipes.fit_kit import ArmRecipe, IndexedRows, collate_indexed, shard_batches

__all__ = ["PlantedModule"]


class PlantedModule(pl.LightningModule):
    """``net`` trained on ``rows`` by one arm of ``world_size`` ranks, with ``planter``'s fault at ``site``."""

    def __init__(
        self,
        *,
        recipe: ArmRecipe,
        net: torch.nn.Module,
        rows: Any,
        world_size: int,
        planter: Planter,
        site: PlantSite,
    ) -> None:
        super().__init__()
        self.net = net
        self._recipe = recipe
        self._rows = rows
        self._world_size = world_size
        self._planter = planter
        self._site = site

    def sampler_place(self) -> tuple[int, int]:
        """``(replicas, rank)`` of this rank as the strategy's distributed sampler counts them."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def row_loader(self, *, replicas: int, rank: int, micro_batch: int) -> DataLoader[Any]:
        """The rows as :func:`shard_batches` deals them to ``rank`` of ``replicas``: indexed, in order."""
        batches = shard_batches(
            total_rows=len(self._rows), num_replicas=replicas, rank=rank, micro_batch=micro_batch
        )
        return DataLoader(
            IndexedRows(self._rows), batch_sampler=batches, collate_fn=collate_indexed, num_workers=0
        )
