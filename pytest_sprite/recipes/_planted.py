"""The LightningModule both arm kits start from: a recipe's model, its rows and the fault planted into it.

Loaded only with ``_arm`` and ``_bf16_arm`` (it imports Lightning at the top).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from pytest_sprite.faults import Planter, PlantSite
from pytest_sprite.recipes.fit_kit import ArmRecipe

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
