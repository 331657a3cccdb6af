"""The LightningModule the arm runner starts from: a recipe's model, its rows and the fault planted into it.

Every arm, FP32 or BF16, calls each :class:`~pytest_sprite.faults.Planter` hook at its point of the step;
the hooks that act on the module itself (which trainables gradient sync leaves out) live here, once.
Loaded only with ``_arm`` (it imports Lightning at the top).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from pytest_sprite.faults import Planter, PlantSite, plant
from pytest_sprite.plumbing.dependency_internals import ddp_ignore_parameters
from pytest_sprite.recipes.fit_kit import (
    ArmRecipe,
    IndexedRows,
    collate_indexed,
    fit_numerics,
    lightning_kwargs,
    make_trainer,
    shard_batches,
)
from pytest_sprite.world import World

__all__ = ["PlantedModule", "arm_strategy", "check_steps", "fit_planted", "planted_at"]


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

    def leave_unsynchronized(self, candidates: Sequence[str], *, ddp: bool) -> None:
        """The planter's ``unsynchronized`` hook, called by every arm before the strategy wraps the model: the
        trainables it names (of ``candidates``) are left out of a ddp arm's gradient synchronization, so they
        keep their local gradients (the bug local-adapter plants); other arms have no sync to leave."""
        unsynchronized = self._planter.unsynchronized(candidates, self._site)
        if unsynchronized and ddp:
            ddp_ignore_parameters(self, [f"net.{name}" for name in unsynchronized])


def planted_at(
    fault: str | None, *, arm: str, rank: int, world_size: int, accumulate: int, precision: str
) -> tuple[Planter, PlantSite]:
    """The planter an arm calls at its hooks, and the site it acts at (the registry refuses a wrong arm)."""
    site = PlantSite(arm=arm, rank=rank, world_size=world_size, accumulate=accumulate, precision=precision)
    return plant(fault, site), site


def arm_strategy(kind: str, world: World, precision: str, strategy: Any) -> dict[str, Any]:
    """The Trainer's strategy arguments for an arm of ``kind``; ``strategy`` (the user's instance) replaces its own."""
    kwargs = lightning_kwargs(kind, world, precision)
    if strategy is not None:
        kwargs["strategy"] = strategy
    return kwargs


def fit_planted(
    module: PlantedModule, strategy: dict[str, Any], *, steps: int, clip: float | None, accumulate: int = 1
) -> None:
    """The one fit of every arm, FP32 or BF16: ``module`` through Lightning for ``steps`` optimizer steps, in a
    scratch directory, under the package's fit numerics (``clip`` None: the module clips for itself)."""
    with tempfile.TemporaryDirectory(prefix="sprite-arm-") as root, fit_numerics():
        trainer = make_trainer(
            strategy, root=root, max_epochs=1, max_steps=steps, clip=clip, accumulate=accumulate
        )
        trainer.fit(module)


def check_steps(
    arm: str, rank: int, *, took: int, steps: int, complete: bool = True, detail: str = ""
) -> None:
    """Refuse a fit whose strategy skipped or added optimizer steps (``complete``: whatever else the arm
    recorded per step lines up too), as the records would not line up."""
    if took != steps or not complete:
        raise RuntimeError(
            f"arm {arm!r} on rank {rank} took {took} optimizer steps{detail}, the recipe asks for {steps}; "
            "the strategy skipped or added optimizer steps"
        )
