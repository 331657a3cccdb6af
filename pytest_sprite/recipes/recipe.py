"""``Recipe``: the model an arm trains, so a project checks the model it trains, not only the shipped one.

A recipe is a model factory, deterministic rows and a mean loss, plus optional answers to what
some checks must know about the model: how FSDP2 shards it, which Linear sites criterion v2 watches, which
module is the backbone (``fp32-backbone``) and which tensor the ``local-adapter`` fault leaves unsynchronized.
``recipe.run(arm, ...)`` trains one arm with a real Lightning fit and returns an :class:`ArmRecord`, the same
on every rank; ``lora_qwen`` is one recipe (the shipped one) run through the same code.

Importing this module imports no torch: a recipe is usually built at a test module's top level, which the
controller imports at collection. The model is built and the rows drawn only when an arm runs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.recorded_results import progress
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.plumbing.timing import perf_counter
from pytest_sprite.recipes.arm_request import FAULT_NEEDS, ArmRequest
from pytest_sprite.recipes.clean_references import obtain, store_key
from pytest_sprite.recipes.constants import DEFAULT_CLIP, DEFAULT_STEPS
from pytest_sprite.recipes.resolve import (
    RecipeData,
    adapter_tensor,
    backbone_module,
    build_model,
    check_same_model_everywhere,
    draw_rows,
    linear_sites,
    model_identity,
)
from pytest_sprite.recipes.sharding_units import default_shard
from pytest_sprite.recipes.spec import RecipeSpec
from pytest_sprite.records import (
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
    from typing_extensions import TypedDict, Unpack

    from pytest_sprite.recipes._arm_precision import ArmPrecision, ArmSites
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.recipes.fit_kit import ArmRecipe
    from pytest_sprite.world import World

    class RunOptions(TypedDict, total=False):
        """The keyword arguments of :meth:`Recipe.run` (its defaults are the method's)."""

        precision: str
        steps: int
        clip: float
        global_batch: int | None
        accumulate: int
        fault: str | None
        strategy: Strategy | None


__all__ = ["FAULT_NEEDS", "Recipe", "RecipeData", "default_shard", "linear_sites", "run_recipe"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Recipe(RecipeSpec):
    """What an arm trains: ``model`` built after the harness seeds torch, ``rows(n)``, and ``loss(model, batch)``.

    ``Recipe(name="mlp", model=MLP, rows=rows, loss=loss).run("ddp")`` inside a ranks test trains the
    ``ddp`` arm on every rank and returns its :class:`ArmRecord`. A batch is
    ``torch.utils.data.default_collate`` of the rows it holds; the loss must be the mean over those rows,
    so that averaging over ranks and micro-batches gives the full batch's loss. Parameters with
    ``requires_grad=False`` are the frozen ones, which every arm must leave unchanged.

    For the resume and crash checks, which run roles in fresh processes, the callables must be picklable:
    functions and classes defined at a module's top level, not lambdas.
    """

    @overload
    def run(self, arm: Literal["single"], **options: Unpack[RunOptions]) -> ArmRecord: ...

    @overload
    def run(
        self, arm: Literal["ref32", "ref", "split", "split_premul"], **options: Unpack[RunOptions]
    ) -> Bf16ArmRecord: ...

    @overload
    def run(self, arm: str, **options: Unpack[RunOptions]) -> ArmRecord | Bf16ArmRecord: ...

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
        request = ArmRequest(
            arm=arm,
            precision=precision,
            steps=steps,
            clip=clip,
            global_batch=global_batch,
            accumulate=accumulate,
            fault=fault,
            strategy=strategy,
        )
        world = self._bound_world()
        record = run_recipe(
            self,
            world=world if world is not None else _world_of_one(),
            request=request,
            artifacts=self._artifacts(resume=False),
        )
        self._keep(record)
        return record

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

        What ``assert_resume_bitexact(recipe, ...)`` calls: the checkpoint resume check's recipe (AdamW, a per-step
        LR schedule, global-norm clipping, 2 epochs of 3 steps, global batch 2 x the test's ranks) trained
        on this recipe's model, rows and loss. Call it on every rank. The roles run in fresh processes, so
        the recipe must pickle: its callables must be top-level functions or classes, not lambdas. Rank 0
        stores the run (``resume-run.pt``) under the test's ``--sprite-artifacts`` directory, else beside
        the checkpoints.
        """
        import pickle

        from pytest_sprite.recipes.resume_roles import resume_roles

        world = self._bound_world()
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
            artifacts=self._artifacts(resume=True),
        )

    # --- what a recipe bound to a test (the lora_qwen fixture's) changes ------------------------------

    def _bound_world(self) -> World | None:
        """The world an arm or the resume check runs on: the running test's, None without the ranks marker."""
        from pytest_sprite.world import current_world

        return current_world()

    def _artifacts(self, *, resume: bool) -> ArtifactDir | None:
        """Where rank 0 stores what a run made: the test's ``--sprite-artifacts`` for a resume run only."""
        return _test_artifacts() if resume else None

    def _identity(self, model: torch.nn.Module) -> tuple[str, int]:
        """The model and row length a record names: the model's structure digest, and 0 tokens."""
        return model_identity(self, model), 0

    def _keep(self, record: ArmRecord | Bf16ArmRecord) -> None:
        """Called with every record ``run`` returns (the lora_qwen fixture keeps them for reports)."""


def _test_artifacts() -> ArtifactDir | None:
    """The running test's ``--sprite-artifacts`` directory (where a resume check stores its run), if any."""
    from pytest_sprite.glue.recorded_results import running_item
    from pytest_sprite.recipes.artifacts import test_artifacts

    item = running_item()
    return test_artifacts(item) if item is not None else None


def _world_of_one() -> World:
    """The world of a test that runs without the ranks marker (and did not ask for the world fixture)."""
    from pytest_sprite.env.device import select_device
    from pytest_sprite.world import World

    device, _ = select_device("auto", 0, 1, bind=False)
    return World.alone(device)


# -------------------------------------------------------------------------------------------------------
# one arm


def run_recipe(
    recipe: Recipe, *, world: World, request: ArmRequest, artifacts: ArtifactDir | None = None
) -> ArmRecord | Bf16ArmRecord:
    """Train one arm of ``recipe`` on ``world`` and return its record, identical on every rank.

    FP32 parity arms (single, ddp, fsdp at ``32-true``) give an :class:`ArmRecord`; criterion v2's arms
    (ref32, ref, split, split_premul, and ddp/fsdp at ``bf16-mixed``) a :class:`Bf16ArmRecord`. The
    record's identity names the model and row length ``recipe._identity`` gives (``lora_qwen``: its
    backbone's identity and its token count; a plain recipe: its structure digest and 0). With
    ``artifacts`` rank 0 writes the record under it.
    """
    request = request.checked(recipe, world)
    with phase("probe"):
        arm = _ready_arm(recipe, request, world)
    target = None
    if artifacts is not None:
        target = world.run_on_rank(
            0, artifacts.next_arm_dir, arm=request.arm, accumulate=request.accumulate, fault=request.fault
        )
    what = (
        f"arm {request.arm}, {request.precision}"
        + (f", accumulate {request.accumulate}" if request.accumulate != 1 else "")
        + (f", fault {request.fault}" if request.fault else "")
    )
    progress(what)

    def compute() -> ArmRecord | Bf16ArmRecord:
        start = perf_counter()
        trained = _train(recipe, request, arm, world)
        # Rank 0's wall time, so the record stays identical on every rank.
        elapsed = world.broadcast_object(perf_counter() - start)
        return dataclasses.replace(trained, wall_s=elapsed)

    # A faulted arm is never stored, nor taken from the store: it is computed here, every time.
    key = None if request.fault is not None else (lambda: store_key(recipe, request, arm.identity, world))
    record, origin = obtain(what, compute, world=world, key=key)
    if artifacts is not None and target is not None:
        world.run_on_rank(0, artifacts.write, target, record, origin=origin.describe())
        record = dataclasses.replace(record, source=str(target))
    return record


@dataclass(frozen=True, kw_only=True, eq=False)
class _ReadyArm:
    """What an arm trains, resolved and checked on every rank before it starts."""

    rows: Sequence[Any]
    identity: RecipeIdentity
    calls: ArmRecipe
    sites: ArmSites
    family: ArmPrecision


def _ready_arm(recipe: Recipe, request: ArmRequest, world: World) -> _ReadyArm:
    """The rows, a probe model's identity and what the arm calls of the recipe (the probe is dropped)."""
    from pytest_sprite.recipes._arm_precision import BF16_CRITERION, FP32_PARITY, ArmSites
    from pytest_sprite.recipes.fit_kit import ArmRecipe

    data, probe = _probed(recipe, request.steps * request.batch, world)
    if request.fault is not None and request.fault in FAULT_NEEDS:
        backbone_module(recipe, probe, request.fault)
    model_id, seq_len = recipe._identity(probe)
    identity = RecipeIdentity(
        model=model_id,
        seed=recipe.seed,
        rows=request.steps * request.batch,
        rows_digest=data.digest,
        seq_len=seq_len,
        steps=request.steps,
        global_batch=request.batch,
        lr=float(recipe.lr),
        clip=float(request.clip),
    )
    calls = ArmRecipe(
        name=recipe.name, loss=recipe.loss, shard=recipe.shard if recipe.shard is not None else default_shard
    )
    family = BF16_CRITERION if request.bf16 else FP32_PARITY
    sites = ArmSites(
        linear=linear_sites(recipe, probe) if family.watches_steps else {},
        backbone=recipe.backbone or "",
        adapters=(adapter_tensor(recipe, probe),),
    )
    return _ReadyArm(rows=data.rows, identity=identity, calls=calls, sites=sites, family=family)


_PROBED: dict[object, Any] = {}
"""The last recipe's rows (by count) and probe model: every arm of a test draws the same rows and builds the
same probe, so they are drawn, built and checked once (a test's arms call with the test's one recipe)."""


def _probed(recipe: Recipe, rows: int, world: World) -> tuple[Any, torch.nn.Module]:
    """The recipe's first ``rows`` rows (checked deterministic and alike on every rank) and its probe model
    (checked alike on every rank), once per recipe and world; every rank of the world calls it the same way,
    so all take the cache or none does (the checks are collectives)."""
    if _PROBED.get("recipe") is not recipe or _PROBED.get("world") is not world:
        _PROBED.clear()
        _PROBED.update(recipe=recipe, world=world)
    if "probe" not in _PROBED:
        probe = build_model(recipe)
        check_same_model_everywhere(recipe, probe, world)
        _PROBED["probe"] = probe
    data = _PROBED.get(("rows", rows))
    if data is None:
        data = _PROBED[("rows", rows)] = draw_rows(recipe, rows, world)
    return data, _PROBED["probe"]


def _train(recipe: Recipe, request: ArmRequest, ready: _ReadyArm, world: World) -> ArmRecord | Bf16ArmRecord:
    """The arm's fit: on rank 0 for the single-device arms (the others receive its record), else everywhere."""
    from pytest_sprite.recipes import _arm
    from pytest_sprite.recipes._arm_precision import ArmPlan

    plan = ArmPlan(
        arm=request.arm,
        identity=ready.identity,
        family=ready.family,
        precision=ready.family.lightning_precision(request.arm, request.precision),
        fault=request.fault,
        accumulate=request.accumulate,
        shards=world.size,
    )

    def fit() -> _arm.ArmFit:  # the model is built only where the arm trains
        return _arm.ArmFit(
            plan=plan,
            recipe=ready.calls,
            model=build_model(recipe),
            rows=ready.rows,
            world=world,
            sites=ready.sites,
            strategy=request.strategy,
        )

    if request.arm in DISTRIBUTED_ARMS:
        return _arm.run_distributed(fit())
    return world.run_on_rank(0, lambda: _arm.run_single(fit()))
