"""The one arm runner: any arm of a recipe, FP32 parity or criterion v2's BF16, through a real Lightning fit.

Loaded only when ``Recipe.run`` (or ``LoraQwen.run``) is called (it imports torch and Lightning at the top).
Every arm runs the same LightningModule, fit and record path; what its precision changes (dtype policy,
what is watched, which record it becomes) comes in as data, an :class:`~._arm_precision.ArmPrecision`.

single, ref32 and ref train the full global batch on one device; ddp and fsdp run the code-under-test
strategies from ``pytest_sprite.lightning.trainer_kwargs`` (or the user's strategy) with Lightning's automatic
optimization, accumulation and clipping, as users do. The split arms run on one device with manual
optimization: each of the N strided DistributedSampler shards, in rank order, is a separate forward with its
unscaled mean loss and a backward outside autocast; the FP32 shard gradients are summed in rank order and
divided once by N (``split``) or each multiplied by 1/N before the sum (``split_premul``, as DDP's reducer
does). No loss/N accumulation: that changes BF16 backward rounding. They clip through the precision plugin's
``clip_gradients``, as automatic optimization does.

Only the data order is taken out of Lightning's hands: Lightning replaces the training sampler with a
shuffling DistributedSampler (the lightning-sprite procedure's first pitfall), so the fit passes
``use_distributed_sampler=False`` and shards rows itself, strided by the rank and replica count the strategy
reports, exactly as an unshuffled DistributedSampler would. A strategy that reports the wrong ranks therefore
shows up in the rows.

Every arm calls each :class:`~pytest_sprite.planted_faults.Planter` hook at its point of the step, every whole value
of sharded state comes from one gather (``full_many``) and every norm from one function (``norm_of``).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, default_collate

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.planted_faults import Planter, PlantSite, plant
from pytest_sprite.plumbing.dependency_internals import (
    ddp_comm_hook_names,
    ddp_ignore_parameters,
    ddp_logging_data,
    fsdp_mixed_precision,
)
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.recipes._arm_precision import (
    SHARED_FROM_RANK0,
    SPLIT_ARMS,
    ArmPlan,
    ArmSites,
    RankTrace,
    StepTrace,
    Trace,
)
from pytest_sprite.recipes.fit_kit import (
    ArmRecipe,
    HookedSGD,
    IndexedRows,
    arm_record_fields,
    check_loss,
    collate_indexed,
    data_parallel_part,
    fit_numerics,
    frozen,
    full_many,
    lightning_kwargs,
    make_trainer,
    norm_of,
    shard_batches,
    share_from_rank0,
    strategy_name,
    trainable,
)
from pytest_sprite.recipes.mesh import data_parallel_mesh
from pytest_sprite.records import ArmRecord, Bf16ArmRecord, CommConfig, LinearCall, tensor_digest
from pytest_sprite.world import World

__all__ = ["ArmFit", "run_distributed", "run_single"]

_LinearKey = tuple[str, str, str, str, bool, str | None]
"""One Linear call as watched: site, kind, output dtype, weight dtype, autocast on, autocast dtype."""


@dataclass(frozen=True, kw_only=True)
class ArmFit:
    """One arm's fit on this rank: the plan, the recipe's calls and sites, a fresh model, the rows and the world."""

    plan: ArmPlan
    recipe: ArmRecipe
    model: torch.nn.Module
    rows: Sequence[Any]
    world: World
    sites: ArmSites
    strategy: Any = None
    """A Lightning strategy instance that replaces the arm's own (None: the arm's)."""


class _ArmModule(pl.LightningModule):
    """Any arm as a LightningModule: ``fit``'s model trained on its rows by ``world_size`` ranks, with
    ``planter``'s fault at ``site``, writing what this rank sees into a :class:`Trace`."""

    def __init__(
        self,
        *,
        fit: ArmFit,
        kind: str,
        rank: int,
        world_size: int,
        micro_batch: int,
        planter: Planter,
        site: PlantSite,
    ) -> None:
        super().__init__()
        self.net = fit.model
        self.trace = Trace()
        self._recipe = fit.recipe
        self._rows = fit.rows
        self._plan = fit.plan
        self._sites = fit.sites
        self._world = fit.world
        self._kind = kind
        self._rank = rank
        self._world_size = world_size
        self._micro_batch = micro_batch
        self._planter = planter
        self._site = site
        self._watch = fit.plan.family.watches_steps
        self._step = StepTrace()
        self._linear: dict[_LinearKey, int] = {}
        self._handles: list[Any] = []
        self.automatic_optimization = kind not in SPLIT_ARMS

    # --- setup ---------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # The planter's unsynchronized hook, before the strategy wraps the model: the trainables it names are
        # left out of a ddp arm's gradient sync, so they keep their local gradients (the bug local-adapter
        # plants); other arms have no sync to leave.
        unsynchronized = self._planter.unsynchronized(self._sites.adapters, self._site)
        if unsynchronized and self._kind == "ddp":
            ddp_ignore_parameters(self, [f"net.{name}" for name in unsynchronized])
        if self._kind != "fsdp":
            return
        mesh = self.device_mesh if self.device_mesh is not None else data_parallel_mesh(self._world)
        self._recipe.shard(self.net, data_parallel_part(mesh, require=True))

    def train_dataloader(self) -> DataLoader[Any]:
        """This rank's rows as :func:`shard_batches` deals them to the rank and replica count the strategy's
        distributed sampler reports: indexed, in order."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        batches = shard_batches(
            total_rows=len(self._rows),
            num_replicas=int(kwargs.get("num_replicas", 1)),
            rank=int(kwargs.get("rank", 0)),
            micro_batch=self._micro_batch,
        )
        return DataLoader(
            IndexedRows(self._rows), batch_sampler=batches, collate_fn=collate_indexed, num_workers=0
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return HookedSGD(
            [p for _, p in trainable(self.net)],
            lr=self._plan.identity.lr,
            before=self._before_update,
            after=self._after_update,
        )

    def on_train_start(self) -> None:
        trainables, frozen_params = trainable(self.net), frozen(self.net)
        t = self.trace
        t.trainable_names = tuple(n for n, _ in trainables)
        t.frozen_names = tuple(n for n, _ in frozen_params)
        values = full_many([p.detach() for _, p in trainables + frozen_params])
        if self._rank == 0:
            t.initial = {n: v.to("cpu", copy=True) for (n, _), v in zip(trainables, values, strict=False)}
        t.mine.initial_digests = {
            n: tensor_digest(v) for (n, _), v in zip(trainables + frozen_params, values, strict=True)
        }
        t.strategy = strategy_name(self.trainer)
        t.tf32 = (
            bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
        )
        if self._watch:
            t.mine.comm = self._comm_config()
            self._watch_linear_sites()
        if "forward_context" in self._planter.hooks():
            self._plant_forward_context()

    def on_train_end(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        trainables, frozen_params = trainable(self.net), frozen(self.net)
        values = full_many([p.detach() for _, p in trainables + frozen_params])
        final = dict(zip((n for n, _ in trainables), values, strict=False))
        h = hashlib.sha256()
        for n in self.trace.trainable_names:
            h.update(tensor_digest(final[n]).encode())
        self.trace.mine.final_digest = h.hexdigest()
        self.trace.mine.frozen_final = {
            n: tensor_digest(v) for (n, _), v in zip(frozen_params, values[len(trainables) :], strict=True)
        }
        if self._rank == 0:
            self.trace.final = {n: v.to("cpu", copy=True) for n, v in final.items()}

    def _comm_config(self) -> CommConfig:
        """The communication configuration this rank's strategy actually runs with."""
        if self._kind == "ddp":
            ddp: Any = self.trainer.strategy.model
            data = ddp_logging_data(ddp)
            dtypes = {_ddp_dtype(d) for d in str(data.get("dtypes", "")).split(",") if d}
            mp = getattr(ddp, "mixed_precision", None)
            if mp is not None and getattr(mp, "reduce_dtype", None) is not None:
                dtypes = {str(mp.reduce_dtype)}
            hooks = ddp_comm_hook_names(ddp)
            hook = data.get("comm_hook") or (hooks[0] if hooks else None)
            return CommConfig(
                strategy="ddp",
                reducer_dtype=",".join(sorted(dtypes)) if dtypes else None,
                comm_hook=str(hook) if hook else None,
            )
        if self._kind == "fsdp":
            mp = fsdp_mixed_precision(self.net)
            return CommConfig(
                strategy="fsdp",
                param_dtype=None if mp is None or mp.param_dtype is None else str(mp.param_dtype),
                reduce_dtype=None if mp is None or mp.reduce_dtype is None else str(mp.reduce_dtype),
            )
        return CommConfig(strategy="none")

    def _watch_linear_sites(self) -> None:
        """Count every call of the recipe's Linear sites by output and weight dtype and autocast state."""
        modules = dict(self.net.named_modules())
        missing = [s for s in self._sites.linear if s not in modules]
        if missing:
            raise SpriteUsageError(f"the recipe names Linear sites its model lacks: {', '.join(missing[:4])}")
        device_type = self.device.type
        for site, kind in self._sites.linear.items():

            def hook(mod: torch.nn.Module, args: Any, out: Any, site: str = site, kind: str = kind) -> None:
                weight = getattr(mod, "weight", None)
                on = torch.is_autocast_enabled(device_type)
                key = (
                    site,
                    kind,
                    str(out.dtype),
                    str(weight.dtype) if weight is not None else "none",
                    on,
                    str(torch.get_autocast_dtype(device_type)) if on else None,
                )
                self._linear[key] = self._linear.get(key, 0) + 1

            self._handles.append(modules[site].register_forward_hook(hook))

    def _plant_forward_context(self) -> None:
        """The planter's ``forward_context`` around every forward of the recipe's backbone (or whole model)."""
        backbone = dict(self.net.named_modules())[self._sites.backbone]
        device_type = self.device.type
        contexts: list[Any] = []

        def enter(mod: torch.nn.Module, args: Any) -> Any:
            was_on = torch.is_autocast_enabled(device_type)
            ctx: Any = self._planter.forward_context(self._site, device_type)
            ctx.__enter__()
            contexts.append(ctx)
            # A backbone that receives activations (not token ids, as in lora_qwen) gets them in BF16 from the
            # layers before it; once the context leaves autocast, run it in FP32 as autocast's own
            # custom_fwd(cast_inputs=torch.float32) would, instead of failing on mixed dtypes.
            if was_on and not torch.is_autocast_enabled(device_type):
                return tuple(
                    a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
                )
            return None

        def leave(mod: torch.nn.Module, args: Any, out: Any) -> None:
            contexts.pop().__exit__(None, None, None)

        self._handles.append(backbone.register_forward_pre_hook(enter))
        self._handles.append(backbone.register_forward_hook(leave))

    # --- the step -------------------------------------------------------------------------------------

    def _loss(self, batch: Any, rows: int) -> torch.Tensor:
        """This rank's (or emulated shard's) mean loss, as the planter changes it before backward."""
        loss = self._recipe.loss(self.net, batch)
        check_loss(self._recipe, loss, rows)
        return self._planter.loss(loss, self._site)

    def training_step(self, batch: tuple[list[int], Any], batch_idx: int) -> torch.Tensor | None:
        ids, data = batch
        rows = tuple(int(i) for i in ids)
        if not self.automatic_optimization:
            self._split_step(rows)
            return None
        self._step.rows = (self._step.rows[0] + rows,) if self._step.rows else (rows,)
        return self._loss(data, len(rows))

    def _shard_batch(self, shard: tuple[int, ...]) -> Any:
        """One emulated rank's batch: its rows collated as its DataLoader would, on this arm's device."""
        return self.trainer.strategy.batch_to_device(default_collate([self._rows[i] for i in shard]))

    def _split_step(self, rows: tuple[int, ...]) -> None:
        n = self._plan.shards
        trainables = [p for _, p in trainable(self.net)]
        shards = tuple(rows[r::n] for r in range(n))
        self._step.rows = shards
        total: list[torch.Tensor] | None = None
        for r in range(n):
            loss = self._loss(self._shard_batch(shards[r]), len(shards[r]))
            with torch.autocast(device_type=self.device.type, enabled=False):
                self.manual_backward(loss)
            grads = [
                p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in trainables
            ]
            for p in trainables:
                p.grad = None
            if self._kind == "split_premul":
                grads = [g * (1.0 / n) for g in grads]
            total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
        assert total is not None
        if self._kind == "split":
            total = [t / n for t in total]
        for p, g in zip(trainables, total, strict=True):
            p.grad = g
        self._synchronized()
        opt: Any = self.optimizers()
        self.clip_gradients(opt, gradient_clip_val=self._plan.identity.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls this after backward (gradients synchronized) and before clipping; the split arms
        # clip in their step, so they call _synchronized there instead.
        if self.automatic_optimization:
            self._synchronized()

    def _synchronized(self) -> None:
        """The synchronized gradients, before clipping: the planter's ``gradients`` hook, then what is seen."""
        trainables = trainable(self.net)
        self._planter.gradients(trainables, self._site)
        present = [(n, p) for n, p in trainables if p.grad is not None]
        values = full_many([p.grad.detach() for _, p in present])  # type: ignore[union-attr]
        self._step.pre = norm_of(values)
        if self._watch:
            self._watch_gradients(trainables, present, values)

    def _watch_gradients(
        self,
        trainables: list[tuple[str, torch.nn.Parameter]],
        present: list[tuple[str, torch.nn.Parameter]],
        values: list[torch.Tensor],
    ) -> None:
        """Each gradient's dtype, finiteness and digest (whole values on rank 0), and FSDP2's sharding."""
        from torch.distributed.tensor import DTensor, Shard

        step = self._step
        whole: dict[str, torch.Tensor] = {}
        for (n, p), full in zip(present, values, strict=True):
            step.grad_dtypes[n] = str(p.grad.dtype)  # type: ignore[union-attr]
            if not bool(torch.isfinite(full).all()):
                step.grad_nonfinite += (n,)
            step.grad_digests[n] = tensor_digest(full)
            if self._rank == 0:
                whole[n] = full.to("cpu", copy=True)
        if self._kind == "fsdp":

            def sharded(t: Any) -> bool:
                return isinstance(t, DTensor) and any(isinstance(pl_, Shard) for pl_ in t.placements)

            step.param_sharded = {n: sharded(p) for n, p in trainables}
            step.grad_sharded = {n: sharded(p.grad) for n, p in trainables}
        self.trace.grads.append(whole)

    def _before_update(self) -> bool:
        """Record the post-clip norm the update steps with; False when a planted fault skips the update."""
        grads = [p.grad.detach() for _, p in trainable(self.net) if p.grad is not None]
        self._step.post = norm_of(full_many(grads))
        done = len(self.trace.mine.steps)
        return not self._planter.skip_step(done, self._plan.identity.steps, self._site)

    def _after_update(self) -> None:
        step, self._step = self._step, StepTrace()
        if self._watch:
            self._watch_parameters(step)
        self.trace.mine.steps.append(step)

    def _watch_parameters(self, step: StepTrace) -> None:
        """Digests of every tensor after the update (whole trainables on rank 0) and the step's Linear calls."""
        trainables, frozen_params = trainable(self.net), frozen(self.net)
        values = full_many([p.detach() for _, p in trainables + frozen_params])
        full = {n: v for (n, _), v in zip(trainables, values, strict=False)}
        step.frozen_digests = {
            n: tensor_digest(v) for (n, _), v in zip(frozen_params, values[len(trainables) :], strict=True)
        }
        step.param_digests = {n: tensor_digest(v) for n, v in full.items()}
        self.trace.params.append(
            {n: v.to("cpu", copy=True) for n, v in full.items()} if self._rank == 0 else {}
        )
        linear, self._linear = self._linear, {}
        step.linear = tuple(
            LinearCall(
                site=site,
                kind=kind,
                output_dtype=out,
                param_dtype=param,
                autocast=on,
                autocast_dtype=ac,
                calls=n,
            )
            for (site, kind, out, param, on, ac), n in linear.items()
        )


def _ddp_dtype(name: str) -> str:
    """DDP's logging names ("float", "c10::BFloat16", "double") as torch dtype strings."""
    table = {"float": "torch.float32", "double": "torch.float64", "c10::Half": "torch.float16"}
    table["c10::BFloat16"] = "torch.bfloat16"
    return table.get(name.strip(), name.strip())


def _fit(fit: ArmFit) -> Trace:
    """This rank's fit of the arm, refused if the strategy took another number of optimizer steps."""
    plan, world = fit.plan, fit.world
    ident = plan.identity
    kind = plan.arm if plan.arm in ("ddp", "fsdp", *SPLIT_ARMS) else "single"
    distributed = kind in ("ddp", "fsdp")
    world_size, rank = (world.size, world.rank) if distributed else (1, 0)
    site = PlantSite(
        arm=plan.arm, rank=rank, world_size=world_size, accumulate=plan.accumulate, precision=plan.precision
    )
    module = _ArmModule(
        fit=fit,
        kind=kind,
        rank=rank,
        world_size=world_size,
        micro_batch=ident.global_batch // (world_size * plan.accumulate),
        planter=plant(plan.fault, site),  # the registry refuses a wrong arm
        site=site,
    )
    strategy = lightning_kwargs(kind if distributed else "single", world, plan.precision)
    if fit.strategy is not None:
        strategy["strategy"] = fit.strategy
    # manual optimization (the split arms) clips in the step, through the precision plugin
    clip = ident.clip if module.automatic_optimization else None
    with tempfile.TemporaryDirectory(prefix="sprite-arm-") as root, fit_numerics():
        trainer = make_trainer(
            strategy, root=root, max_epochs=1, max_steps=ident.steps, clip=clip, accumulate=plan.accumulate
        )
        with phase("fit setup"):
            trainer.fit(module)
    _check_steps(plan.arm, world.rank, module.trace.mine.steps, ident.steps)
    return module.trace


def _check_steps(arm: str, rank: int, steps: list[StepTrace], want: int) -> None:
    """Refuse a fit whose strategy skipped or added optimizer steps, or one whose steps lack their rows or
    pre-clip norm: the records would not line up."""
    missing = [s for s, step in enumerate(steps) if not step.rows or step.pre is None]
    if len(steps) != want or missing:
        detail = f" (steps {missing} without their rows or pre-clip norm)" if missing else ""
        raise RuntimeError(
            f"arm {arm!r} on rank {rank} took {len(steps)} optimizer steps{detail}, the recipe asks for {want}; "
            "the strategy skipped or added optimizer steps"
        )


def _record(fit: ArmFit, trace: Trace, per_rank: list[RankTrace]) -> ArmRecord | Bf16ArmRecord:
    """The arm's record, built alike on every rank from rank 0's trace and every rank's own."""
    common = arm_record_fields(fit.plan, trace, ranks=len(per_rank), device_type=fit.world.device.type)
    record: ArmRecord | Bf16ArmRecord = fit.plan.family.record(fit.plan, trace, per_rank, fit.sites, common)
    return record


def run_single(fit: ArmFit) -> ArmRecord | Bf16ArmRecord:
    """single, ref32, ref, split or split_premul on this rank's one device (the caller runs it on one rank)."""
    trace = _fit(fit)
    return _record(fit, trace, [trace.mine])


def run_distributed(fit: ArmFit) -> ArmRecord | Bf16ArmRecord:
    """ddp or fsdp on every rank (or ``strategy``); every rank returns the same record (rank 0's tensors)."""
    trace = _fit(fit)
    per_rank, shared = share_from_rank0(fit.world, trace, own=trace.mine, shared=SHARED_FROM_RANK0)
    return _record(fit, shared, per_rank)
