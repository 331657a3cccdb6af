"""One arm as ``run`` was asked for it, and the refusals it meets before anything trains.

``Recipe.run(arm, ...)`` builds an :class:`ArmRequest`; :meth:`ArmRequest.checked` refuses bad arguments by
name (FP32 parity and criterion v2's BF16 arms each have their rules) and resolves the global batch.
Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.planted_faults import PlantSite, get_fault
from pytest_sprite.recipes.constants import DEFAULT_CLIP, DEFAULT_STEPS
from pytest_sprite.records import (
    ARMS,
    BF16_ARMS,
    BF16_PRECISION,
    BF16_SINGLE_DEVICE_ARMS,
    DISTRIBUTED_ARMS,
    FP32_PRECISION,
)

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

    from pytest_sprite.recipes.spec import RecipeSpec
    from pytest_sprite.world import World

__all__ = ["FAULT_NEEDS", "ArmRequest", "is_bf16"]

FAULT_NEEDS: Final[Mapping[str, str]] = {"fp32-backbone": "backbone"}
"""Faults that need something only the recipe can name: fault -> the :class:`Recipe` field it reads.

``local-adapter`` needs a tensor too, but every model has one to offer: without ``adapter=`` it is the
first trainable tensor, as the issue asks; ``fp32-backbone`` has no such default and is refused by name.
"""

_USED_STRATEGIES: weakref.WeakSet[Any] = weakref.WeakSet()
"""Strategy objects an arm has run with: Lightning strategies keep state from their fit."""


def is_bf16(precision: object) -> bool:
    """Whether ``precision`` names bf16-mixed, in any of Lightning's spellings ("bf16-mixed", "bf16")."""
    return isinstance(precision, str) and precision.strip().lower() in ("bf16-mixed", "bf16")


@dataclass(frozen=True, kw_only=True, eq=False)
class ArmRequest:
    """One arm of a recipe, as ``run`` was called: the arguments of ``Recipe.run``."""

    arm: str
    """``single``, ``ddp`` or ``fsdp`` (FP32 parity); ``ref32``, ``ref``, ``split``, ``split_premul``, or
    ``ddp``/``fsdp`` at ``bf16-mixed`` (criterion v2)."""
    precision: str = FP32_PRECISION
    steps: int = DEFAULT_STEPS
    clip: float = DEFAULT_CLIP
    global_batch: int | None = None
    """Rows per optimizer step, all ranks together; None: 2 x the world size (resolved by :meth:`checked`)."""
    accumulate: int = 1
    fault: str | None = None
    strategy: Strategy | None = None

    @property
    def bf16(self) -> bool:
        """Whether this is one of criterion v2's BF16 arms (an ``Bf16ArmRecord``)."""
        return self.arm in BF16_ARMS and (self.arm in BF16_SINGLE_DEVICE_ARMS or is_bf16(self.precision))

    @property
    def batch(self) -> int:
        """The global batch of a checked request."""
        if self.global_batch is None:
            raise RuntimeError("the arm request was not checked: its global batch is unresolved")
        return self.global_batch

    def checked(self, recipe: RecipeSpec, world: World) -> ArmRequest:
        """This request with its global batch resolved, after refusing bad arguments by name."""
        batch = _check_bf16(self, recipe, world) if self.bf16 else _check_fp32(self, recipe, world)
        return dataclasses.replace(self, global_batch=batch)


def _check_fp32(request: ArmRequest, recipe: RecipeSpec, world: World) -> int:
    """Refuse bad ``run`` arguments before anything trains; return the global batch to use."""
    arm, accumulate = request.arm, request.accumulate
    if arm not in ARMS:
        raise SpriteUsageError(
            f"unknown arm {arm!r}; arms: {', '.join(ARMS)} (FP32 parity) and {', '.join(BF16_ARMS)} "
            "(BF16 criterion v2, precision='bf16-mixed')"
        )
    for name, value in (("steps", request.steps), ("accumulate", accumulate)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpriteUsageError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(request.clip, (int, float)) or not request.clip > 0:
        raise SpriteUsageError(
            f"clip must be a positive number, got {request.clip!r}; the recipe needs an active global-norm clip"
        )
    global_batch = request.global_batch if request.global_batch is not None else 2 * world.size
    ranks = 1 if arm == "single" else world.size
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % (ranks * accumulate):
        raise SpriteUsageError(
            f"global_batch={global_batch!r} must be a positive multiple of ranks x accumulate = "
            f"{ranks} x {accumulate} = {ranks * accumulate} for arm {arm!r}"
        )
    if request.fault is not None:
        site = PlantSite(
            arm=arm, rank=world.rank, world_size=ranks, accumulate=accumulate, precision=request.precision
        )
        _check_fault(recipe, request.fault, site)
    if arm in DISTRIBUTED_ARMS and not world.distributed:
        raise SpriteUsageError(
            f"arm {arm!r} needs the ranks of a test marked @pytest.mark.ranks(n); this test runs on one "
            "process without a process group"
        )
    if request.strategy is not None:
        _check_strategy(request.strategy)
    return global_batch


def _check_strategy(strategy: object) -> None:
    """A fresh Lightning Strategy object per arm, remembered so that a second arm with it is refused."""
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


def _check_bf16(request: ArmRequest, recipe: RecipeSpec, world: World) -> int:
    """Refuse bad arguments for one of criterion v2's arms; return the global batch to use."""
    arm, precision = request.arm, request.precision
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
    if request.accumulate != 1:
        raise SpriteUsageError(
            f"the BF16 arms take no accumulate= (got {request.accumulate}): criterion v2 trains one shard per "
            "rank and step, and loss/N accumulation would change BF16 backward rounding"
        )
    if request.strategy is not None and arm not in DISTRIBUTED_ARMS:
        raise SpriteUsageError(f"strategy= applies to the ddp and fsdp arms, not {arm!r}")
    n = world.size
    ran = FP32_PRECISION if arm == "ref32" else BF16_PRECISION
    if arm in DISTRIBUTED_ARMS and n < 2:
        raise SpriteUsageError(
            f"arm {arm!r} needs the ranks of a test marked @pytest.mark.ranks(n) with n >= 2; this test runs "
            f"on {n} process"
        )
    shape = dataclasses.replace(
        request, arm="ddp" if arm in DISTRIBUTED_ARMS else "single", precision=ran, fault=None
    )
    global_batch = _check_fp32(shape, recipe, world)
    if global_batch % n:
        raise SpriteUsageError(
            f"global_batch={global_batch} must be a multiple of the world size {n}: every BF16 arm trains "
            f"(or, on one device, emulates) the {n} rank shards"
        )
    if request.fault is not None:
        site = PlantSite(
            arm=arm,
            rank=world.rank,
            world_size=n if arm in DISTRIBUTED_ARMS else 1,
            accumulate=1,
            precision=ran,
        )
        _check_fault(recipe, request.fault, site)
    return global_batch


def _check_fault(recipe: RecipeSpec, fault: str, site: PlantSite) -> None:
    """The registry's refusals, then the recipe's: a fault needing what the recipe lacks is refused by name."""
    get_fault(fault).check(site)
    need = FAULT_NEEDS.get(fault)
    if need is not None and getattr(recipe, need) is None:
        raise SpriteUsageError(
            f"fault {fault!r} needs the recipe's {need} module, and recipe {recipe.name!r} names none; "
            f"pass Recipe({need}='<module name>') to plant it"
        )
