"""The six BF16 arms of criterion v2 through real Lightning fits, recording every step on every rank.

Loaded only when a BF16 arm runs (imports torch and Lightning at the top). ref32 and ref train the full
global batch on one device (FP32 with TF32 off, and BF16 autocast); ddp and fsdp run the code-under-test
strategies with automatic optimization, as users do. The split arms run on one device with manual
optimization: each of the N strided DistributedSampler shards, in rank order, is a separate forward with
its unscaled mean loss and a backward outside autocast; the FP32 shard gradients are summed in rank order
and divided once by N (``split``) or each multiplied by 1/N before the sum (``split_premul``, as DDP's
reducer does). No loss/N accumulation: that changes BF16 backward rounding. Clipping goes through the
precision plugin's ``clip_gradients``, as automatic optimization's does.

What is specific to the recipe comes in from ``Recipe.run``: its loss and FSDP2 units as an ``ArmRecipe``,
and its model's Linear sites, backbone module and adapter tensor (local-adapter) as a :class:`Bf16Sites`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.dependency_internals import (
    ddp_comm_hook_names,
    ddp_logging_data,
    fsdp_mixed_precision,
)
from pytest_sprite.recipes._planted import PlantedModule, arm_strategy, check_steps, fit_planted, planted_at
from pytest_sprite.recipes.fit_kit import (
    ArmRecipe,
    HookedSGD,
    arm_record_fields,
    check_loss,
    data_parallel_part,
    frozen,
    full_many,
    norm_of,
    share_from_rank0,
    strategy_name,
    trainable,
)
from pytest_sprite.recipes.mesh import data_parallel_mesh
from pytest_sprite.records import (
    BF16_SINGLE_DEVICE_ARMS,
    Bf16ArmRecord,
    Bf16StepRecord,
    CommConfig,
    LinearCall,
    RankStep,
    RecipeIdentity,
    tensor_digest,
)
from pytest_sprite.world import World

__all__ = ["Bf16Fit", "Bf16Plan", "Bf16Sites", "run_bf16_distributed", "run_bf16_single"]


@dataclass(frozen=True, kw_only=True)
class Bf16Sites:
    """What the BF16 arms need to know about the recipe's model (module and parameter names under it)."""

    linear: Mapping[str, str]
    """Every Linear site: module name to ``backbone``, ``lora_A``, ``lora_B`` or ``head``."""
    backbone: str
    """Module a planter's ``forward_context`` wraps (the fp32-backbone fault runs it without autocast)."""
    adapters: tuple[str, ...]
    """Adapter tensors (trainable names) a planter may leave out of gradient synchronization (local-adapter)."""


@dataclass(frozen=True, kw_only=True)
class Bf16Plan:
    """One BF16 arm: validated by the recipe before anything trains."""

    arm: str
    identity: RecipeIdentity
    precision: str
    fault: str | None
    shards: int
    """N: the test's world size, which ddp/fsdp run on and the split arms emulate."""


@dataclass(frozen=True, kw_only=True)
class Bf16Fit:
    """One BF16 arm's fit on this rank: the plan, the recipe's calls, a fresh model, the rows, the world."""

    plan: Bf16Plan
    recipe: ArmRecipe
    net: torch.nn.Module
    rows: Any
    world: World
    sites: Bf16Sites
    strategy: Any = None
    """A Lightning strategy instance that replaces ddp's or fsdp's own (None: the arm's)."""


@dataclass(kw_only=True)
class _Trace:
    """What one rank saw (mutable while the fit runs)."""

    trainable_names: tuple[str, ...] = ()
    frozen_names: tuple[str, ...] = ()
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    initial_digests: dict[str, str] = field(default_factory=dict)
    comm: CommConfig = field(default_factory=lambda: CommConfig(strategy="none"))
    strategy: str = ""
    tf32: bool = False
    rows: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    ranks: list[RankStep] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    pending: dict[str, Any] = field(default_factory=dict)
    linear: dict[tuple[str, str, str, str, bool, str | None], int] = field(default_factory=dict)


class _Bf16Module(PlantedModule):
    """One BF16 arm as a LightningModule that writes every step's observations into a :class:`_Trace`."""

    def __init__(self, *, plan: Bf16Plan, sites: Bf16Sites, kind: str, rank: int, **planted: Any) -> None:
        super().__init__(**planted)
        self.trace = _Trace()
        self._plan = plan
        self._sites = sites
        self._kind = kind
        self._rank = rank
        self._handles: list[Any] = []
        self.automatic_optimization = kind not in ("split", "split_premul")

    # --- setup ---------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        self.leave_unsynchronized(self._sites.adapters, ddp=self._kind == "ddp")
        if self._kind != "fsdp":
            return
        mesh = self.device_mesh if self.device_mesh is not None else data_parallel_mesh(self._world())
        self._recipe.shard(self.net, data_parallel_part(mesh))

    def _world(self) -> World:
        from pytest_sprite.world import current_world

        world = current_world()
        if world is None:
            raise RuntimeError("the fsdp arm needs the test's world")
        return world

    def train_dataloader(self) -> DataLoader[Any]:
        ident = self._plan.identity
        if self._kind in ("ddp", "fsdp"):
            replicas, rank = self.sampler_place()
            micro = ident.global_batch // self._plan.shards
        else:  # one device reads each step's whole global batch in order; split arms cut it into shards
            replicas, rank, micro = 1, 0, ident.global_batch
        return self.row_loader(replicas=replicas, rank=rank, micro_batch=micro)

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
        full = {n: v.to("cpu", copy=True) for (n, _), v in zip(trainables, values, strict=False)}
        t.initial = full if self._rank == 0 else {}
        t.initial_digests = {
            n: tensor_digest(v) for (n, _), v in zip(trainables + frozen_params, values, strict=True)
        }
        t.strategy = strategy_name(self.trainer)
        t.comm = self._comm_config()
        t.tf32 = (
            bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
        )
        self._install_hooks()

    def on_train_end(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _comm_config(self) -> CommConfig:
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

    def _install_hooks(self) -> None:
        modules = dict(self.net.named_modules())
        missing = [s for s in self._sites.linear if s not in modules]
        if missing:
            raise SpriteUsageError(f"the recipe names Linear sites its model lacks: {', '.join(missing[:4])}")
        device_type = self.device.type
        for site, kind in self._sites.linear.items():
            module = modules[site]

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
                self.trace.linear[key] = self.trace.linear.get(key, 0) + 1

            self._handles.append(module.register_forward_hook(hook))
        if "forward_context" in self._planter.hooks():
            backbone = modules[self._sites.backbone]
            contexts: list[Any] = []

            def enter(mod: torch.nn.Module, args: Any) -> Any:
                ctx: Any = self._planter.forward_context(self._site, device_type)
                ctx.__enter__()
                contexts.append(ctx)
                # Outside autocast a backbone that receives activations (not token ids, as in lora_qwen)
                # gets them in BF16 from the layers before it; run it in FP32 as autocast's own
                # custom_fwd(cast_inputs=torch.float32) would, instead of failing on mixed dtypes.
                if not torch.is_autocast_enabled(device_type):
                    return tuple(
                        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                        for a in args
                    )
                return None

            def leave(mod: torch.nn.Module, args: Any, out: Any) -> None:
                contexts.pop().__exit__(None, None, None)

            self._handles.append(backbone.register_forward_pre_hook(enter))
            self._handles.append(backbone.register_forward_hook(leave))

    # --- the step -------------------------------------------------------------------------------------

    def _loss(self, batch: Any, rows: int) -> torch.Tensor:
        loss = self._recipe.loss(self.net, batch)
        check_loss(self._recipe, loss, rows)
        return loss

    def training_step(self, batch: tuple[list[int], Any], batch_idx: int) -> torch.Tensor | None:
        ids, data = batch
        rows = tuple(int(i) for i in ids)
        if self.automatic_optimization:
            self.trace.pending["rows"] = rows
            loss = self._loss(data, len(rows))
            return self._planter.loss(loss, self._site)
        self._split_step(rows)
        return None

    def _shard_batch(self, shard: tuple[int, ...]) -> Any:
        """One emulated rank's batch: its rows collated as its DataLoader would, on this arm's device."""
        return self.trainer.strategy.batch_to_device(default_collate([self._rows[i] for i in shard]))

    def _split_step(self, rows: tuple[int, ...]) -> None:
        n = self._plan.shards
        trainables = [p for _, p in trainable(self.net)]
        shards = tuple(rows[r::n] for r in range(n))
        self.trace.pending["shards"] = shards
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
        self._record_grads()
        opt: Any = self.optimizers()
        self.clip_gradients(opt, gradient_clip_val=self._plan.identity.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.automatic_optimization:
            return  # split arms record before they clip
        self._planter.gradients(trainable(self.net), self._site)  # synchronized, not yet clipped
        self._record_grads()

    def _record_grads(self) -> None:
        from torch.distributed.tensor import DTensor, Shard

        trainables = trainable(self.net)
        pending = self.trace.pending
        dtypes: dict[str, str] = {}
        nonfinite: list[str] = []
        digests: dict[str, str] = {}
        full_grads: dict[str, torch.Tensor] = {}
        present = [(n, p) for n, p in trainables if p.grad is not None]
        values = full_many([p.grad.detach() for _, p in present])  # type: ignore[union-attr]
        for (n, p), full in zip(present, values, strict=True):
            dtypes[n] = str(p.grad.dtype)  # type: ignore[union-attr]
            if not bool(torch.isfinite(full).all()):
                nonfinite.append(n)
            digests[n] = tensor_digest(full)
            if self._rank == 0:
                full_grads[n] = full.to("cpu", copy=True)
        pending.update(
            pre=norm_of(values), grad_dtypes=dtypes, grad_nonfinite=tuple(nonfinite), grad_digests=digests
        )
        if self._kind == "fsdp":

            def sharded(t: Any) -> bool:
                return isinstance(t, DTensor) and any(isinstance(pl_, Shard) for pl_ in t.placements)

            pending["param_sharded"] = {n: sharded(p) for n, p in trainables}
            pending["grad_sharded"] = {n: sharded(p.grad) for n, p in trainables}
        self.trace.grads.append(full_grads)

    def _before_update(self) -> bool:
        grads = [p.grad.detach() for _, p in trainable(self.net) if p.grad is not None]
        self.trace.pending["post"] = norm_of(full_many(grads))
        return not self._planter.skip_step(len(self.trace.ranks), self._plan.identity.steps, self._site)

    def _after_update(self) -> None:
        t = self.trace
        trainables, frozen_params = trainable(self.net), frozen(self.net)
        values = full_many([p.detach() for _, p in trainables + frozen_params])
        full = {n: v for (n, _), v in zip(trainables, values, strict=False)}
        frozen_digests = {
            n: tensor_digest(v) for (n, _), v in zip(frozen_params, values[len(trainables) :], strict=True)
        }
        pending, t.pending = t.pending, {}
        linear, t.linear = t.linear, {}
        t.params.append({n: v.to("cpu", copy=True) for n, v in full.items()} if self._rank == 0 else {})
        t.rows.append(pending.get("shards") or (pending.get("rows", ()),))
        t.ranks.append(
            RankStep(
                pre_clip_norm=float(pending.get("pre", float("nan"))),
                post_clip_norm=float(pending.get("post", float("nan"))),
                grad_dtypes=pending.get("grad_dtypes", {}),
                grad_nonfinite=pending.get("grad_nonfinite", ()),
                grad_digests=pending.get("grad_digests", {}),
                param_digests={n: tensor_digest(v) for n, v in full.items()},
                frozen_digests=frozen_digests,
                param_sharded=pending.get("param_sharded"),
                grad_sharded=pending.get("grad_sharded"),
                linear=tuple(
                    LinearCall(
                        site=site,
                        kind=kind,
                        output_dtype=out,
                        param_dtype=param,
                        autocast=on,
                        autocast_dtype=ac,
                        calls=count,
                    )
                    for (site, kind, out, param, on, ac), count in linear.items()
                ),
            )
        )


def _ddp_dtype(name: str) -> str:
    """DDP's logging names ("float", "c10::BFloat16", "double") as torch dtype strings."""
    table = {"float": "torch.float32", "double": "torch.float64", "c10::Half": "torch.float16"}
    table["c10::BFloat16"] = "torch.bfloat16"
    return table.get(name.strip(), name.strip())


def _fit(fit: Bf16Fit) -> _Trace:
    plan, world = fit.plan, fit.world
    ident = plan.identity
    kind = plan.arm if plan.arm in ("ddp", "fsdp", "split", "split_premul") else "single"
    distributed = kind in ("ddp", "fsdp")
    world_size = world.size if distributed else 1
    rank = world.rank if distributed else 0
    strategy = arm_strategy(kind if distributed else "single", world, plan.precision, fit.strategy)
    planter, site = planted_at(
        plan.fault, arm=plan.arm, rank=rank, world_size=world_size, accumulate=1, precision=plan.precision
    )
    module = _Bf16Module(
        recipe=fit.recipe,
        net=fit.net,
        rows=fit.rows,
        plan=plan,
        sites=fit.sites,
        kind=kind,
        rank=rank,
        world_size=world_size,
        planter=planter,
        site=site,
    )
    # manual optimization (the split arms) clips in the step, through the precision plugin
    clip = ident.clip if module.automatic_optimization else None
    fit_planted(module, strategy, steps=ident.steps, clip=clip)
    trace = module.trace
    check_steps(plan.arm, world.rank, took=len(trace.ranks), steps=ident.steps)
    return trace


def _record(
    plan: Bf16Plan, trace: _Trace, per_rank: list[dict[str, Any]], device_type: str, sites: Bf16Sites
) -> Bf16ArmRecord:
    steps = []
    for s in range(len(trace.ranks)):
        rows = (
            trace.rows[s] if plan.arm in BF16_SINGLE_DEVICE_ARMS else tuple(r["rows"][s][0] for r in per_rank)
        )
        steps.append(
            Bf16StepRecord(
                rows=rows,
                grads=trace.grads[s],
                params=trace.params[s],
                ranks=tuple(r["ranks"][s] for r in per_rank),
            )
        )
    return Bf16ArmRecord(
        **arm_record_fields(plan, trace, ranks=len(per_rank), device_type=device_type),
        shards=plan.shards,
        tf32=trace.tf32,
        linear_sites=tuple(sites.linear),
        initial_trainable=trace.initial,
        initial_digests=tuple(r["initial_digests"] for r in per_rank),
        comm=tuple(r["comm"] for r in per_rank),
        steps=tuple(steps),
    )


def _summary(trace: _Trace) -> dict[str, Any]:
    return {
        "rows": trace.rows,
        "ranks": trace.ranks,
        "initial_digests": trace.initial_digests,
        "comm": trace.comm,
    }


def run_bf16_single(fit: Bf16Fit) -> Bf16ArmRecord:
    """ref32, ref, split or split_premul on this rank's one device (the caller runs it on one rank)."""
    trace = _fit(fit)
    return _record(fit.plan, trace, [_summary(trace)], fit.world.device.type, fit.sites)


def run_bf16_distributed(fit: Bf16Fit) -> Bf16ArmRecord:
    """ddp or fsdp on every rank (or ``strategy``); every rank returns the same record (rank 0's tensors)."""
    trace = _fit(fit)
    per_rank, trace = share_from_rank0(
        fit.world,
        trace,
        summary=_summary(trace),
        shared=("trainable_names", "frozen_names", "initial", "grads", "params", "strategy", "tf32"),
    )
    return _record(fit.plan, trace, per_rank, fit.world.device.type, fit.sites)
