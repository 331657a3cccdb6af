"""``Recipe``: the model an arm trains, so a project checks the model it trains, not only the shipped one.

A recipe is a model factory, deterministic rows and a mean loss (issue 15), plus optional answers to what
some checks must know about the model: how FSDP2 shards it, which Linear sites criterion v2 watches, which
module is the backbone (``fp32-backbone``) and which tensor the ``local-adapter`` fault leaves unsynchronized.
``recipe.run(arm, ...)`` trains one arm with a real Lightning fit and returns an :class:`ArmRecord`, the same
on every rank; ``lora_qwen`` is one recipe (the shipped one) run through the same code.

Importing this module imports no torch: a recipe is usually built at a test module's top level, which the
controller imports at collection. The model is built and the rows drawn only when an arm runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, overload

from pytest_sprite._results import progress
from pytest_sprite._timing import perf_counter
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.faults import PlantSite, get_fault
from pytest_sprite.recipes._shard import default_shard
from pytest_sprite.recipes.constants import DEFAULT_CLIP, DEFAULT_LR, DEFAULT_STEPS
from pytest_sprite.records import (
    ARMS,
    BF16_ARMS,
    BF16_PRECISION,
    BF16_SINGLE_DEVICE_ARMS,
    DISTRIBUTED_ARMS,
    FP32_PRECISION,
    ArmRecord,
    Bf16ArmRecord,
    RecipeIdentity,
    ResumeRun,
)

if TYPE_CHECKING:
    import torch
    from lightning.pytorch.strategies import Strategy
    from torch.distributed.device_mesh import DeviceMesh

    from pytest_sprite.recipes._arm import ArmRecipe
    from pytest_sprite.recipes._bf16_arm import Bf16Sites
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.world import World

__all__ = ["FAULT_NEEDS", "Recipe", "RecipeData", "default_shard", "run_recipe"]

FAULT_NEEDS: Final[Mapping[str, str]] = {"fp32-backbone": "backbone"}
"""Faults that need something only the recipe can name: fault -> the :class:`Recipe` field it reads.

``local-adapter`` needs a tensor too, but every model has one to offer: without ``adapter=`` it is the
first trainable tensor, as the issue asks; ``fp32-backbone`` has no such default and is refused by name.
"""

_USED_STRATEGIES: weakref.WeakSet[Any] = weakref.WeakSet()
"""Strategy objects an arm has run with: Lightning strategies keep state from their fit."""


def _describe(value: object) -> str:
    """What was given, for error messages: ``<function rows>``, ``<class MLP>``, ``3 (int)``."""
    if isinstance(value, type):
        return f"<class {value.__qualname__}>"
    if callable(value):
        return f"<{type(value).__name__} {getattr(value, '__qualname__', repr(value))}>"
    return f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True, kw_only=True, eq=False)
class Recipe:
    """What an arm trains: ``model`` built after the harness seeds torch, ``rows(n)``, and ``loss(model, batch)``.

    ``Recipe(name="mlp", model=MLP, rows=rows, loss=loss).run("ddp")`` inside a ranks test trains the
    ``ddp`` arm on every rank and returns its :class:`ArmRecord`. A batch is
    ``torch.utils.data.default_collate`` of the rows it holds; the loss must be the mean over those rows,
    so that averaging over ranks and micro-batches gives the full batch's loss. Parameters with
    ``requires_grad=False`` are the frozen ones, which every arm must leave unchanged.

    For the resume and crash checks, which run roles in fresh processes, the callables must be picklable:
    functions and classes defined at a module's top level, not lambdas.
    """

    name: str
    """Short name, shown in the record's model identity (``mlp:<structure digest>``)."""
    model: Callable[[], torch.nn.Module]
    """Builds the model (an ``nn.Module``), called after ``torch.manual_seed(seed)``, identically everywhere."""
    rows: Callable[[int], Sequence[Any]]
    """``rows(n)``: n rows, the same on every call and every rank (draw them from a seeded generator)."""
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    """``loss(model, batch)``: a scalar tensor, the mean over the batch's rows."""
    shard: Callable[[torch.nn.Module, DeviceMesh], Any] | None = None
    """FSDP2 units: ``shard(model, mesh)``; None shards as :func:`default_shard` does."""
    linear_sites: Sequence[str] | None = None
    """Module names whose output dtype criterion v2 checks; None means every ``nn.Linear``."""
    backbone: str | None = None
    """Module name the ``fp32-backbone`` fault runs outside autocast; None refuses that fault."""
    adapter: str | None = None
    """Parameter name the ``local-adapter`` fault leaves out of DDP's sync; None: the first trainable tensor."""
    seed: int = 0
    """Seed the harness sets before building the model."""
    lr: float = DEFAULT_LR
    """SGD learning rate of the parity arms."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.name, str) or not self.name.strip():
            problems.append(f"name must be a non-empty str, got {_describe(self.name)}")
        for field_name, what in (
            ("model", "a callable that builds an nn.Module (e.g. the module's class)"),
            ("rows", "a callable rows(n) returning n rows"),
            ("loss", "a callable loss(model, batch) returning a scalar tensor"),
        ):
            value = getattr(self, field_name)
            if not callable(value):
                problems.append(f"{field_name} must be {what}, got {_describe(value)}")
            elif field_name == "model" and not isinstance(value, type) and hasattr(value, "named_parameters"):
                # A module instance is callable too, but every arm must train a fresh copy built after seeding.
                problems.append(
                    f"model must be {what}, got a built {type(value).__name__} instance; pass its class "
                    f"(model={type(value).__name__}) or a function that builds one"
                )
        if self.shard is not None and not callable(self.shard):
            problems.append(
                f"shard must be a callable shard(model, mesh) or None, got {_describe(self.shard)}"
            )
        if self.linear_sites is not None and (
            isinstance(self.linear_sites, str)
            or not isinstance(self.linear_sites, Sequence)
            or not all(isinstance(s, str) and s for s in self.linear_sites)
        ):
            problems.append(
                f"linear_sites must be a sequence of module names (e.g. ('fc1', 'head')) or None, "
                f"got {_describe(self.linear_sites)}"
            )
        for field_name in ("backbone", "adapter"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                problems.append(f"{field_name} must be a non-empty name or None, got {_describe(value)}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            problems.append(f"seed must be a non-negative int, got {_describe(self.seed)}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            problems.append(f"lr must be a positive number, got {_describe(self.lr)}")
        if problems:
            raise SpriteUsageError("Recipe(...): " + "; ".join(problems))

    @overload
    def run(
        self,
        arm: Literal["single"],
        *,
        precision: str = ...,
        steps: int = ...,
        clip: float = ...,
        global_batch: int | None = ...,
        accumulate: int = ...,
        fault: str | None = ...,
        strategy: Strategy | None = ...,
    ) -> ArmRecord: ...

    @overload
    def run(
        self,
        arm: Literal["ref32", "ref", "split", "split_premul"],
        *,
        precision: str = ...,
        steps: int = ...,
        clip: float = ...,
        global_batch: int | None = ...,
        accumulate: int = ...,
        fault: str | None = ...,
        strategy: Strategy | None = ...,
    ) -> Bf16ArmRecord: ...

    @overload
    def run(
        self,
        arm: str,
        *,
        precision: str = ...,
        steps: int = ...,
        clip: float = ...,
        global_batch: int | None = ...,
        accumulate: int = ...,
        fault: str | None = ...,
        strategy: Strategy | None = ...,
    ) -> ArmRecord | Bf16ArmRecord: ...

    def run(
        self,
        arm: str,
        *,
        precision: str = FP32_PRECISION,
        steps: int = DEFAULT_STEPS,
        clip: float = DEFAULT_CLIP,
        global_batch: int | None = None,
        accumulate: int = 1,
        fault: str | None = None,
        strategy: Strategy | None = None,
    ) -> ArmRecord | Bf16ArmRecord:
        """Train one arm of this recipe on the current test's ranks; the record is the same on every rank.

        The arguments are ``lora_qwen.run``'s. FP32 parity (``precision="32-true"``, an :class:`ArmRecord`):
        ``single`` trains the whole global batch on one device (rank 0), ``ddp`` and ``fsdp`` run the
        code-under-test strategies (or ``strategy``, a fresh Lightning strategy object per call) on every
        rank; the default global batch is 2 x the world size. BF16 criterion v2 (``precision="bf16-mixed"``,
        a :class:`Bf16ArmRecord`): ``ref32``, ``ref``, ``split`` and ``split_premul`` on one device, ``ddp``
        and ``fsdp`` on every rank.
        """
        from pytest_sprite.world import current_world

        world = current_world()
        if world is None:
            world = _world_of_one()
        return run_recipe(
            self,
            world=world,
            arm=arm,
            precision=precision,
            steps=steps,
            clip=clip,
            global_batch=global_batch,
            accumulate=accumulate,
            fault=fault,
            strategy=strategy,
        )

    def resume_roles(
        self,
        *,
        strategy: str,
        precision: str = FP32_PRECISION,
        reshard: bool = False,
        export: bool | None = None,
        fault: str | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> ResumeRun:
        """Every role of the checkpoint resume check on this recipe, each in its own sub-world.

        What ``assert_resume_bitexact(recipe, ...)`` calls: the seed's Checkpoints recipe (AdamW, a per-step
        LR schedule, global-norm clipping, 2 epochs of 3 steps, global batch 2 x the test's ranks) trained
        on this recipe's model, rows and loss. Call it on every rank. The roles run in fresh processes, so
        the recipe must pickle: its callables must be top-level functions or classes, not lambdas. Rank 0
        stores the run (``resume-run.pt``) under the test's ``--sprite-artifacts`` directory, else beside
        the checkpoints.
        """
        import pickle

        from pytest_sprite.recipes.resume import resume_roles
        from pytest_sprite.world import current_world

        world = current_world()
        try:
            pickle.dumps(self)
        except Exception as exc:
            raise SpriteUsageError(
                f"recipe {self.name!r}: the resume check runs its roles in fresh processes, so the recipe must "
                f"pickle, and it does not ({type(exc).__name__}: {exc}); define model, rows and loss as "
                "top-level functions or classes of a module, not lambdas or nested functions"
            ) from exc
        size = world.size if world is not None else 1
        # The same refusals as an arm's, before any role starts: the roles train 3 steps of 2 x ranks rows.
        draw_rows(self, 3 * 2 * size, world if world is not None else _world_of_one())
        build_model(self)
        return resume_roles(
            self,
            strategy=strategy,
            precision=precision,
            reshard=reshard,
            export=export,
            fault=fault,
            directory=directory,
            world=world,
            source=self,
            artifacts=_test_artifacts(),
        )


def _test_artifacts() -> ArtifactDir | None:
    """The running test's ``--sprite-artifacts`` directory (where a resume check stores its run), if any."""
    from pytest_sprite._results import running_item
    from pytest_sprite.recipes.artifacts import test_artifacts

    item = running_item()
    return test_artifacts(item) if item is not None else None


def _world_of_one() -> World:
    """The world of a test that runs without the ranks marker (and did not ask for the world fixture)."""
    from pytest_sprite._device import select_device
    from pytest_sprite.world import World

    device, _ = select_device("auto", 0, 1, bind=False)
    return World.alone(device)


# -------------------------------------------------------------------------------------------------------
# what the arms need from a recipe, resolved against a built model


@dataclass(frozen=True, kw_only=True, eq=False)
class RecipeData:
    """One run's rows (a sequence of rows) and their digest, checked deterministic and equal on every rank."""

    rows: Sequence[Any]
    """The run's rows, row ``i`` trained at step ``i // global_batch``."""
    digest: str
    """SHA-256 over every tensor of ``default_collate(rows)``, in order."""


def rows_digest(rows: Sequence[Any]) -> str:
    """SHA-256 over the bytes of every leaf of ``default_collate(rows)``: equal digests, equal rows.

    For ``lora_qwen`` (rows of ``input_ids`` and ``labels``) it is the digest its rows always had.
    """
    from torch.utils.data import default_collate

    h = hashlib.sha256()
    _hash_leaves(h, default_collate(list(rows)))
    return h.hexdigest()


def _hash_leaves(h: Any, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in value:
            _hash_leaves(h, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _hash_leaves(h, item)
    else:
        h.update(repr(value).encode())


def draw_rows(recipe: Recipe, n: int, world: World) -> RecipeData:
    """``recipe.rows(n)``, refused unless a second call gives the same rows and every rank has them too.

    Both calls run back to back with the global RNG as the test left it (restored afterwards), so rows
    drawn from the global RNG, which differ on a second call, are refused instead of silently reseeded.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        first = _call_rows(recipe, n)
        second = _call_rows(recipe, n)
    digest, again = rows_digest(first), rows_digest(second)
    if digest != again:
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: rows({n}) is not deterministic: a second call returned different rows "
            f"(digest {digest[:12]} then {again[:12]}). Every arm and rank must train the same rows: draw them "
            "from a seeded torch.Generator (torch.Generator().manual_seed(7)), not from the global RNG"
        )
    if world.distributed:
        digests = world.gather_object(digest)
        if len(set(digests)) > 1:
            raise SpriteUsageError(
                f"recipe {recipe.name!r}: rows({n}) differs between ranks (digests by rank: "
                f"{', '.join(d[:12] for d in digests)}); rows must not depend on the rank or the process"
            )
    return RecipeData(rows=first, digest=digest)


def _call_rows(recipe: Recipe, n: int) -> Sequence[Any]:
    rows = recipe.rows(n)
    if not isinstance(rows, Sequence) and not (hasattr(rows, "__len__") and hasattr(rows, "__getitem__")):
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: rows({n}) must return a sequence of {n} rows, got {_describe(rows)}"
        )
    if len(rows) != n:
        raise SpriteUsageError(f"recipe {recipe.name!r}: rows({n}) returned {len(rows)} rows, not {n}")
    return rows


def build_model(recipe: Recipe) -> torch.nn.Module:
    """``recipe.model()`` after ``torch.manual_seed(recipe.seed)``, the global RNG restored afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = recipe.model()
    if not isinstance(model, torch.nn.Module):
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: model() must return a torch.nn.Module, got {_describe(model)}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: model() built a {type(model).__name__} without a trainable parameter; "
            "every parameter has requires_grad=False, so no arm would train anything"
        )
    model.train()
    return model


def model_identity(recipe: Recipe, model: torch.nn.Module) -> str:
    """``<name>:<digest>`` of the model's class and parameter names, shapes and dtypes (its structure)."""
    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return f"{recipe.name}:{h.hexdigest()[:16]}"


def check_same_model_everywhere(recipe: Recipe, model: torch.nn.Module, world: World) -> None:
    """Refuse a model whose initial weights differ between ranks (it drew from something not seeded)."""
    if not world.distributed:
        return
    from pytest_sprite.records import tensor_digest

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tensor_digest(p.detach())};".encode())
    digests = world.gather_object(h.hexdigest())
    if len(set(digests)) > 1:
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: model() built different initial weights on different ranks (digests "
            f"by rank: {', '.join(d[:12] for d in digests)}); the harness seeds torch before calling it, so "
            "draw every initial weight from torch's RNG (or a seeded generator), never from the process or rank"
        )


def linear_sites(recipe: Recipe, model: torch.nn.Module) -> dict[str, str]:
    """Module name -> kind of every Linear site criterion v2 watches.

    The kind is what the site is to the recipe: ``lora_A`` / ``lora_B`` inside a LoRA adapter, ``backbone``
    under the recipe's backbone module, ``head`` elsewhere when there is a backbone, else ``linear``.
    """
    import torch

    modules = dict(model.named_modules())
    if recipe.linear_sites is None:
        names = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    else:
        missing = [s for s in recipe.linear_sites if s not in modules]
        if missing:
            raise SpriteUsageError(
                f"recipe {recipe.name!r}: linear_sites names modules its model lacks: {', '.join(missing[:4])}; "
                f"its Linear modules: {', '.join(n for n, m in modules.items() if isinstance(m, torch.nn.Linear))}"
            )
        names = list(recipe.linear_sites)
    return {n: _site_kind(n, recipe.backbone) for n in names}


def _site_kind(name: str, backbone: str | None) -> str:
    parts = name.split(".")
    for kind in ("lora_A", "lora_B"):
        if kind in parts:
            return kind
    if backbone is None:
        return "linear"
    return "backbone" if name == backbone or name.startswith(backbone + ".") else "head"


def backbone_module(recipe: Recipe, model: torch.nn.Module, fault: str) -> str:
    """The module ``fault`` runs outside autocast; refused by name when the recipe names none or a wrong one."""
    if recipe.backbone is None:
        raise SpriteUsageError(
            f"fault {fault!r} runs the recipe's backbone outside autocast, but recipe {recipe.name!r} names no "
            "backbone; pass Recipe(backbone='<module name>'), e.g. backbone='encoder'"
        )
    modules = dict(model.named_modules())
    if recipe.backbone not in modules:
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: backbone={recipe.backbone!r} is not a module of its model; modules: "
            f"{', '.join(n for n in modules if n and '.' not in n)}"
        )
    return recipe.backbone


def adapter_tensor(recipe: Recipe, model: torch.nn.Module) -> str:
    """The trainable tensor ``local-adapter`` leaves unsynchronized: ``adapter`` or the first trainable one."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if recipe.adapter is None:
        return trainable[0]
    if recipe.adapter not in trainable:
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: adapter={recipe.adapter!r} is not a trainable parameter of its model; "
            f"trainable parameters: {', '.join(trainable[:8])}{', ...' if len(trainable) > 8 else ''}"
        )
    return recipe.adapter


# -------------------------------------------------------------------------------------------------------
# one arm


def run_recipe(
    recipe: Recipe,
    *,
    world: World,
    arm: str,
    precision: str = FP32_PRECISION,
    steps: int = DEFAULT_STEPS,
    clip: float = DEFAULT_CLIP,
    global_batch: int | None = None,
    accumulate: int = 1,
    fault: str | None = None,
    strategy: Strategy | None = None,
    artifacts: ArtifactDir | None = None,
    model_id: str | None = None,
    seq_len: int = 0,
) -> ArmRecord | Bf16ArmRecord:
    """Train one arm of ``recipe`` on ``world`` and return its record, identical on every rank.

    FP32 parity arms (single, ddp, fsdp at ``32-true``) give an :class:`ArmRecord`; criterion v2's arms
    (ref32, ref, split, split_premul, and ddp/fsdp at ``bf16-mixed``) a :class:`Bf16ArmRecord`.
    ``model_id`` and ``seq_len`` name the model and the row length in the record's identity (``lora_qwen``
    gives its backbone's identity and its token count; a plain recipe gets its structure digest and 0).
    With ``artifacts`` rank 0 writes the record under it.
    """
    bf16 = arm in BF16_ARMS and (arm in BF16_SINGLE_DEVICE_ARMS or is_bf16(precision))
    if bf16:
        global_batch = check_bf16_run(
            recipe, world, arm, precision, steps, clip, global_batch, accumulate, fault, strategy
        )
    else:
        global_batch = check_run(
            recipe, world, arm, steps, clip, global_batch, accumulate, fault, strategy, precision
        )
    data = draw_rows(recipe, steps * global_batch, world)
    probe = build_model(recipe)
    check_same_model_everywhere(recipe, probe, world)
    if fault is not None and fault in FAULT_NEEDS:
        backbone_module(recipe, probe, fault)
    identity = RecipeIdentity(
        model=model_id if model_id is not None else model_identity(recipe, probe),
        seed=recipe.seed,
        rows=steps * global_batch,
        rows_digest=data.digest,
        seq_len=seq_len,
        steps=steps,
        global_batch=global_batch,
        lr=float(recipe.lr),
        clip=float(clip),
    )
    from pytest_sprite.recipes import _arm

    calls = _arm.ArmRecipe(
        name=recipe.name, loss=recipe.loss, shard=recipe.shard if recipe.shard is not None else default_shard
    )
    if bf16:
        sites = _bf16_sites(recipe, probe)
    del probe
    target = None
    if artifacts is not None:
        target = world.run_on_rank(0, artifacts.next_arm_dir, arm=arm, accumulate=accumulate, fault=fault)
    progress(
        f"arm {arm}, {precision}"
        + (f", accumulate {accumulate}" if accumulate != 1 else "")
        + (f", fault {fault}" if fault else "")
    )
    start = perf_counter()
    record: ArmRecord | Bf16ArmRecord
    if bf16:
        record = _run_bf16(recipe, calls, sites, world, arm, precision, identity, fault, strategy, data.rows)
    else:
        plan = _arm.ArmPlan(
            arm=arm, identity=identity, precision=precision, accumulate=accumulate, fault=fault
        )
        if arm == "single":
            record = world.run_on_rank(
                0,
                lambda: _arm.run_single(
                    plan,
                    recipe=calls,
                    model=build_model(recipe),
                    rows=data.rows,
                    world=world,
                    strategy=strategy,
                ),
            )
        else:
            record = _arm.run_distributed(
                plan, recipe=calls, model=build_model(recipe), rows=data.rows, world=world, strategy=strategy
            )
    # Rank 0's wall time, so the record stays identical on every rank.
    elapsed = world.broadcast_object(perf_counter() - start)
    record = dataclasses.replace(record, wall_s=elapsed)
    if artifacts is not None and target is not None:
        world.run_on_rank(0, artifacts.write, target, record)
        record = dataclasses.replace(record, source=str(target))
    return record


def _bf16_sites(recipe: Recipe, model: torch.nn.Module) -> Bf16Sites:
    """What criterion v2's arms need to know about the model, from the recipe (the backbone only if named)."""
    from pytest_sprite.recipes._bf16_arm import Bf16Sites

    return Bf16Sites(
        linear=linear_sites(recipe, model),
        backbone=recipe.backbone or "",
        adapters=(adapter_tensor(recipe, model),),
    )


def _run_bf16(
    recipe: Recipe,
    calls: ArmRecipe,
    sites: Bf16Sites,
    world: World,
    arm: str,
    precision: str,
    identity: RecipeIdentity,
    fault: str | None,
    strategy: Strategy | None,
    rows: Sequence[Any],
) -> Bf16ArmRecord:
    from pytest_sprite.recipes import _bf16_arm

    ran = FP32_PRECISION if arm == "ref32" else BF16_PRECISION
    plan = _bf16_arm.Bf16Plan(arm=arm, identity=identity, precision=ran, fault=fault, shards=world.size)
    if arm in DISTRIBUTED_ARMS:
        return _bf16_arm.run_bf16_distributed(
            plan,
            recipe=calls,
            net=build_model(recipe),
            rows=rows,
            world=world,
            sites=sites,
            strategy=strategy,
        )
    return world.run_on_rank(
        0,
        lambda: _bf16_arm.run_bf16_single(
            plan, recipe=calls, net=build_model(recipe), rows=rows, world=world, sites=sites
        ),
    )


def is_bf16(precision: object) -> bool:
    """Whether ``precision`` names bf16-mixed, in any of Lightning's spellings ("bf16-mixed", "bf16")."""
    return isinstance(precision, str) and precision.strip().lower() in ("bf16-mixed", "bf16")


def check_run(
    recipe: Recipe,
    world: World,
    arm: str,
    steps: int,
    clip: float,
    global_batch: int | None,
    accumulate: int,
    fault: str | None,
    strategy: Strategy | None,
    precision: str,
) -> int:
    """Refuse bad ``run`` arguments before anything trains; return the global batch to use."""
    if arm not in ARMS:
        raise SpriteUsageError(
            f"unknown arm {arm!r}; arms: {', '.join(ARMS)} (FP32 parity) and {', '.join(BF16_ARMS)} "
            "(BF16 criterion v2, precision='bf16-mixed')"
        )
    for name, value in (("steps", steps), ("accumulate", accumulate)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpriteUsageError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(clip, (int, float)) or not clip > 0:
        raise SpriteUsageError(
            f"clip must be a positive number, got {clip!r}; the recipe needs an active global-norm clip"
        )
    if global_batch is None:
        global_batch = 2 * world.size
    ranks = 1 if arm == "single" else world.size
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % (ranks * accumulate):
        raise SpriteUsageError(
            f"global_batch={global_batch!r} must be a positive multiple of ranks x accumulate = "
            f"{ranks} x {accumulate} = {ranks * accumulate} for arm {arm!r}"
        )
    if fault is not None:
        site = PlantSite(
            arm=arm, rank=world.rank, world_size=ranks, accumulate=accumulate, precision=precision
        )
        _check_fault(recipe, fault, site)
    if arm in DISTRIBUTED_ARMS and not world.distributed:
        raise SpriteUsageError(
            f"arm {arm!r} needs the ranks of a test marked @pytest.mark.ranks(n); this test runs on one "
            "process without a process group"
        )
    if strategy is not None:
        from lightning.pytorch.strategies import Strategy

        if not isinstance(strategy, Strategy):
            raise SpriteUsageError(
                f"strategy= must be a Lightning Strategy object, got {type(strategy).__name__}; "
                "pass for example MyDDPStrategy() (a fresh object per run)"
            )
        if strategy in _USED_STRATEGIES:
            raise SpriteUsageError(
                f"strategy= got a {type(strategy).__name__} object that an earlier arm already ran with; "
                "Lightning strategies keep state from their fit, so pass a fresh object per run"
            )
        _USED_STRATEGIES.add(strategy)
    return global_batch


def check_bf16_run(
    recipe: Recipe,
    world: World,
    arm: str,
    precision: str,
    steps: int,
    clip: float,
    global_batch: int | None,
    accumulate: int,
    fault: str | None,
    strategy: Strategy | None,
) -> int:
    """Refuse bad arguments for one of criterion v2's arms; return the global batch to use."""
    if arm != "ref32" and not is_bf16(precision):
        raise SpriteUsageError(
            f"arm {arm!r} is a BF16 arm of criterion v2 and runs precision='bf16-mixed', got {precision!r}; "
            f'pass precision="bf16-mixed" (ref32 is its FP32 reference and runs FP32 either way)'
        )
    if arm == "ref32" and not (is_bf16(precision) or precision == FP32_PRECISION):
        raise SpriteUsageError(
            f"arm 'ref32' is criterion v2's FP32 reference; pass precision='bf16-mixed' (the run's precision) "
            f"or '32-true', got {precision!r}"
        )
    if accumulate != 1:
        raise SpriteUsageError(
            f"the BF16 arms take no accumulate= (got {accumulate}): criterion v2 trains one shard per rank "
            "and step, and loss/N accumulation would change BF16 backward rounding"
        )
    if strategy is not None and arm not in DISTRIBUTED_ARMS:
        raise SpriteUsageError(f"strategy= applies to the ddp and fsdp arms, not {arm!r}")
    n = world.size
    ran = FP32_PRECISION if arm == "ref32" else BF16_PRECISION
    if arm in DISTRIBUTED_ARMS and n < 2:
        raise SpriteUsageError(
            f"arm {arm!r} needs the ranks of a test marked @pytest.mark.ranks(n) with n >= 2; this test runs "
            f"on {n} process"
        )
    global_batch = check_run(
        recipe,
        world,
        "ddp" if arm in DISTRIBUTED_ARMS else "single",
        steps,
        clip,
        global_batch,
        1,
        None,
        strategy,
        ran,
    )
    if global_batch % n:
        raise SpriteUsageError(
            f"global_batch={global_batch} must be a multiple of the world size {n}: every BF16 arm trains "
            f"(or, on one device, emulates) the {n} rank shards"
        )
    if fault is not None:
        site = PlantSite(
            arm=arm,
            rank=world.rank,
            world_size=n if arm in DISTRIBUTED_ARMS else 1,
            accumulate=1,
            precision=ran,
        )
        _check_fault(recipe, fault, site)
    return global_batch


def _check_fault(recipe: Recipe, fault: str, site: PlantSite) -> None:
    """The registry's refusals, then the recipe's: a fault needing what the recipe lacks is refused by name."""
    get_fault(fault).check(site)
    need = FAULT_NEEDS.get(fault)
    if need is not None and getattr(recipe, need) is None:
        raise SpriteUsageError(
            f"fault {fault!r} needs the recipe's {need} module, and recipe {recipe.name!r} names none; "
            f"pass Recipe({need}='<module name>') to plant it"
        )
