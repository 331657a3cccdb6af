"""One arm of a recipe through a real Lightning fit, and the record of what it did on every rank.

Loaded only when ``Recipe.run`` (or ``LoraQwen.run``) is called (it imports torch and Lightning at the top). The fit uses the
code-under-test strategies from ``pytest_sprite.lightning.trainer_kwargs`` (or the user's strategy) with
Lightning's automatic optimization, accumulation and clipping, so what is checked is what users run.
Only the data order is taken out of Lightning's hands: Lightning replaces the training sampler with a
shuffling DistributedSampler (the lightning-sprite procedure's first pitfall), so the arm passes ``use_distributed_sampler=False``
and shards rows itself, strided by the rank and replica count the strategy reports, exactly as an
unshuffled DistributedSampler would. A strategy that reports the wrong ranks therefore shows up in the rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from pytest_sprite.recipes._planted import PlantedModule, arm_strategy, check_steps, fit_planted, planted_at
from pytest_sprite.recipes.fit_kit import (
    ArmRecipe,
    HookedSGD,
    arm_record_fields,
    check_loss,
    data_parallel_part,
    frozen,
    full_many,
    global_norm,
    share_from_rank0,
    strategy_name,
    trainable,
)
from pytest_sprite.recipes.mesh import data_parallel_mesh
from pytest_sprite.records import ArmRecord, RecipeIdentity, tensor_digest
from pytest_sprite.world import World

__all__ = ["ArmFit", "ArmPlan", "run_distributed", "run_single"]


@dataclass(frozen=True, kw_only=True)
class ArmPlan:
    """What one arm trains: validated by ``Recipe.run`` before any process starts training."""

    arm: str
    identity: RecipeIdentity
    precision: str
    accumulate: int
    fault: str | None


@dataclass(frozen=True, kw_only=True)
class ArmFit:
    """One arm's fit on this rank: the plan, the recipe's calls, a fresh model, the rows and the world."""

    plan: ArmPlan
    recipe: ArmRecipe
    model: torch.nn.Module
    rows: Sequence[Any]
    world: World
    strategy: Any = None
    """A Lightning strategy instance that replaces the arm's own (None: the arm's)."""


@dataclass(kw_only=True)
class _Trace:
    """What one rank saw during its fit (mutable while the fit runs)."""

    pre: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    rows: dict[int, list[int]] = field(default_factory=dict)
    trainable_names: tuple[str, ...] = ()
    frozen_names: tuple[str, ...] = ()
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen_initial: dict[str, str] = field(default_factory=dict)
    frozen_final: dict[str, str] = field(default_factory=dict)
    final_digest: str = ""
    strategy: str = ""


class _ArmModule(PlantedModule):
    """The recipe as a LightningModule that writes what it sees into a :class:`_Trace`."""

    def __init__(
        self,
        *,
        plan: ArmPlan,
        micro_batch: int,
        shard: bool,
        mesh_factory: Callable[[], Any],
        **planted: Any,
    ) -> None:
        super().__init__(**planted)
        self.trace = _Trace()
        self._plan = plan
        self._micro_batch = micro_batch
        self._shard = shard
        self._mesh_factory = mesh_factory

    def configure_model(self) -> None:
        self.leave_unsynchronized(tuple(n for n, _ in trainable(self.net)), ddp=self._plan.arm == "ddp")
        if not self._shard:
            return
        mesh = self.device_mesh if self.device_mesh is not None else self._mesh_factory()
        self._recipe.shard(self.net, data_parallel_part(mesh, require=True))

    def train_dataloader(self) -> DataLoader[Any]:
        replicas, rank = self.sampler_place()
        return self.row_loader(replicas=replicas, rank=rank, micro_batch=self._micro_batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return HookedSGD(
            [p for _, p in trainable(self.net)], lr=self._plan.identity.lr, before=self._before_update
        )

    def _before_update(self) -> bool:
        """Record the post-clip norm the update steps with; False when a planted fault skips the update."""
        self.trace.post.append(global_norm([p for _, p in trainable(self.net)]))
        return not self._planter.skip_step(self.trainer.global_step, self._plan.identity.steps, self._site)

    def on_train_start(self) -> None:
        trainables, frozen_params = trainable(self.net), frozen(self.net)
        self.trace.trainable_names = tuple(n for n, _ in trainables)
        self.trace.frozen_names = tuple(n for n, _ in frozen_params)
        self.trace.initial, self.trace.frozen_initial = _snapshot(trainables, frozen_params)
        self.trace.strategy = strategy_name(self.trainer)

    def training_step(self, batch: tuple[list[int], Any], batch_idx: int) -> torch.Tensor:
        ids, data = batch
        self.trace.rows.setdefault(self.trainer.global_step, []).extend(int(i) for i in ids)
        with self._planter.forward_context(self._site, self.device.type):
            loss = self._recipe.loss(self.net, data)
        check_loss(self._recipe, loss, len(ids))
        return self._planter.loss(loss, self._site)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls this after backward (gradients synchronized) and before clipping.
        trainables = trainable(self.net)
        self._planter.gradients(trainables, self._site)
        self.trace.pre.append(global_norm([p for _, p in trainables]))

    def on_train_end(self) -> None:
        self.trace.final, self.trace.frozen_final = _snapshot(trainable(self.net), frozen(self.net))
        h = hashlib.sha256()
        for n in self.trace.trainable_names:
            h.update(tensor_digest(self.trace.final[n]).encode())
        self.trace.final_digest = h.hexdigest()


def _snapshot(
    trainables: list[tuple[str, torch.nn.Parameter]], frozen_params: list[tuple[str, torch.nn.Parameter]]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Whole CPU copies of the trainables and digests of the frozen tensors, in one gather of sharded state."""
    values = full_many([p.detach() for _, p in trainables + frozen_params])
    copies = {n: v.to("cpu", copy=True) for (n, _), v in zip(trainables, values, strict=False)}
    digests = {
        n: tensor_digest(v) for (n, _), v in zip(frozen_params, values[len(trainables) :], strict=True)
    }
    return copies, digests


def _fit(fit: ArmFit, *, distributed: bool) -> _Trace:
    plan, world = fit.plan, fit.world
    kind, world_size = (plan.arm, world.size) if distributed else ("single", 1)
    ident = plan.identity
    strategy = arm_strategy(kind, world, plan.precision, fit.strategy)
    planter, site = planted_at(
        plan.fault,
        arm=plan.arm,
        rank=world.rank,
        world_size=world_size,
        accumulate=plan.accumulate,
        precision=plan.precision,
    )
    module = _ArmModule(
        recipe=fit.recipe,
        net=fit.model,
        rows=fit.rows,
        plan=plan,
        world_size=world_size,
        micro_batch=ident.global_batch // (world_size * plan.accumulate),
        planter=planter,
        site=site,
        shard=kind == "fsdp",
        mesh_factory=lambda: data_parallel_mesh(world),
    )
    fit_planted(module, strategy, steps=ident.steps, clip=ident.clip, accumulate=plan.accumulate)
    trace = module.trace
    rows = sorted(trace.rows)
    check_steps(
        plan.arm,
        world.rank,
        took=len(trace.post),
        steps=ident.steps,
        complete=len(trace.pre) == ident.steps and rows == list(range(ident.steps)),
        detail=f" (pre-clip norms for {len(trace.pre)}, rows for steps {rows})",
    )
    return trace


def _record(plan: ArmPlan, *, trace: _Trace, per_rank: list[dict[str, Any]], device_type: str) -> ArmRecord:
    steps = plan.identity.steps
    return ArmRecord(
        **arm_record_fields(plan, trace, ranks=len(per_rank), device_type=device_type),
        accumulate=plan.accumulate,
        pre_clip_norms=tuple(tuple(r["pre"][s] for r in per_rank) for s in range(steps)),
        post_clip_norms=tuple(tuple(r["post"][s] for r in per_rank) for s in range(steps)),
        rows_seen=tuple(tuple(tuple(r["rows"][s]) for r in per_rank) for s in range(steps)),
        initial_trainable=trace.initial,
        final_trainable=trace.final,
        final_trainable_digests=tuple(r["final_digest"] for r in per_rank),
        frozen_initial=trace.frozen_initial,
        frozen_final=tuple(r["frozen_final"] for r in per_rank),
    )


def _summary(trace: _Trace) -> dict[str, Any]:
    return {
        "pre": trace.pre,
        "post": trace.post,
        "rows": trace.rows,
        "final_digest": trace.final_digest,
        "frozen_final": trace.frozen_final,
    }


def run_single(fit: ArmFit) -> ArmRecord:
    """The reference: the full global batch on this rank's one device, no collectives."""
    trace = _fit(fit, distributed=False)
    return _record(fit.plan, trace=trace, per_rank=[_summary(trace)], device_type=fit.world.device.type)


def run_distributed(fit: ArmFit) -> ArmRecord:
    """A ddp or fsdp arm on every rank of the test; every rank returns the same record (rank 0's tensors)."""
    trace = _fit(fit, distributed=True)
    per_rank, shared = share_from_rank0(
        fit.world,
        trace,
        summary=_summary(trace),
        shared=("trainable_names", "frozen_names", "initial", "final", "frozen_initial", "strategy"),
    )
    return _record(fit.plan, trace=shared, per_rank=per_rank, device_type=fit.world.device.type)
