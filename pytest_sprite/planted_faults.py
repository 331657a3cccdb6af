"""The fault registry: every fault pytest-sprite plants, each one entry that says what, where and who catches it.

An entry (:class:`Fault`) names the fault, the arms it may be planted on, the checks that must reject it
(``by``) and its :class:`Planter`, whose hooks the arms call at fixed points of the training step. The
registry is filled once per session by the ``pytest_sprite_add_faults`` hook: the built-in faults register
through it like a project's. The arms plant through :func:`plant`; ``expect_fault_rejected`` judges through
:func:`get_fault`; :func:`registered_faults` lists them all. Both the recipes and the assertions import this
module, and it imports neither (nor torch at import time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import pytest

from pytest_sprite.errors import SpriteUsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUILTIN_FAULTS",
    "CLEAN",
    "FAULTS",
    "Fault",
    "FaultRegistry",
    "PlantSite",
    "Planter",
    "collect_faults",
    "get_fault",
    "plant",
    "registered_faults",
    "restore_faults",
]


@dataclass(frozen=True, kw_only=True)
class PlantSite:
    """Where a planter acts: the arm, this rank's place in it, and the run's shape."""

    arm: str
    """The arm being trained (``ddp``, ``fsdp``, ...)."""
    rank: int
    """This process's rank in the arm."""
    world_size: int
    """Ranks the arm trains on."""
    accumulate: int
    """Micro-batches per optimizer step."""
    precision: str | None = None
    """The arm's Lightning precision flag, when the arm says (faults of one precision's check refuse others)."""


class Planter:
    """How a fault breaks a run. Override the hooks where the fault acts; every default leaves the run clean.

    The hooks, in the order a training step reaches them (every arm, FP32 or BF16, calls each of the first six
    at its point; the checkpoint resume role calls :meth:`after_restore`):

    - :meth:`check`: before anything trains, refuse a run the fault cannot be planted in;
    - :meth:`unsynchronized`: before the strategy wraps the model, trainables (the recipe's adapter tensor) to
      leave out of gradient sync;
    - :meth:`forward_context`: around every forward of the recipe's backbone (the whole model when it names
      none) (e.g. leave the precision plugin's autocast);
    - :meth:`loss`: this rank's micro-batch loss (a split arm: each emulated shard's), before backward;
    - :meth:`gradients`: after the gradients are synchronized across ranks (a split arm: summed over its
      shards), before clipping;
    - :meth:`skip_step`: whether this rank skips the optimizer step;
    - :meth:`after_restore`: right after a checkpoint restore (weights, optimizer, LR schedulers).
    """

    def check(self, site: PlantSite) -> None:
        """Raise :class:`SpriteUsageError` if the fault cannot be planted in this run."""

    def unsynchronized(self, candidates: Sequence[str], site: PlantSite) -> tuple[str, ...]:
        """Trainables (of the recipe's ``candidates``) the strategy must leave out of gradient synchronization."""
        return ()

    def forward_context(self, site: PlantSite, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """A context the model's forward runs in, inside the precision plugin's own."""
        return contextlib.nullcontext()

    def loss(self, loss: torch.Tensor, site: PlantSite) -> torch.Tensor:
        """The loss this rank back-propagates."""
        return loss

    def gradients(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], site: PlantSite) -> None:
        """Change the synchronized gradients in place (trainable parameters, in parameter order)."""

    def skip_step(self, step: int, steps: int, site: PlantSite) -> bool:
        """True to skip optimizer step ``step`` (0-based, of ``steps``) on this rank."""
        return False

    def after_restore(self, trainer: Any, site: PlantSite) -> None:
        """Change what a Lightning ``trainer`` has just restored from a checkpoint."""

    def can_change(self, trainer: Any, site: PlantSite) -> bool:
        """Whether :meth:`after_restore` has something to change in this restored ``trainer`` (``--sprite-mutate``
        asks in a user's fit: its mutant does not apply where it would change nothing)."""
        return True

    def hooks(self) -> tuple[str, ...]:
        """Names of the hooks this planter overrides: the points where it acts."""
        return tuple(h for h in _HOOKS if getattr(type(self), h) is not getattr(Planter, h))


_HOOKS: Final = ("unsynchronized", "forward_context", "loss", "gradients", "skip_step", "after_restore")

CLEAN: Final = Planter()
"""The planter of a clean arm: every hook leaves the run as it is."""


class _LossScale(Planter):
    """A loss-level fault: this rank's loss is multiplied by :meth:`factor` (1 leaves it untouched)."""

    def factor(self, site: PlantSite) -> float:
        raise NotImplementedError

    def loss(self, loss: torch.Tensor, site: PlantSite) -> torch.Tensor:
        factor = self.factor(site)
        return loss * factor if factor != 1.0 else loss


class _DropLastRank(_LossScale):
    def factor(self, site: PlantSite) -> float:
        return 0.0 if site.rank == site.world_size - 1 else 1.0


class _SumOverRanks(_LossScale):
    def factor(self, site: PlantSite) -> float:
        return float(site.world_size)


class _SumMicroBatches(_LossScale):
    def check(self, site: PlantSite) -> None:
        if site.accumulate < 2:
            raise SpriteUsageError(
                f"fault 'accumulate-sum' needs accumulate >= 2 (got accumulate={site.accumulate}): "
                "with one micro-batch there is no division to skip"
            )

    def factor(self, site: PlantSite) -> float:
        # Lightning divides each micro-batch loss by k; multiplying by k undoes exactly that division.
        return float(site.accumulate)


class _Bf16Only(Planter):
    """A control of the BF16 criterion v2: it only means something in a bf16-mixed arm."""

    name = ""

    def check(self, site: PlantSite) -> None:
        if site.precision is not None and site.precision != "bf16-mixed":
            raise SpriteUsageError(
                f"fault {self.name!r} is a control of the BF16 criterion v2 and needs precision='bf16-mixed', "
                f"the {site.arm!r} arm runs {site.precision!r}"
            )


class _Fp32Backbone(_Bf16Only):
    name = "fp32-backbone"

    def forward_context(self, site: PlantSite, device_type: str) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.autocast(device_type=device_type, enabled=False)


class _LocalAdapter(_Bf16Only):
    name = "local-adapter"

    def unsynchronized(self, candidates: Sequence[str], site: PlantSite) -> tuple[str, ...]:
        return tuple(candidates[:1])


class _ScaleGrad(_Bf16Only):
    name = "scale-grad"

    def gradients(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], site: PlantSite) -> None:
        for _, p in named_parameters:
            if p.grad is not None:
                p.grad.mul_(site.world_size)


class _SkipLastUpdate(_Bf16Only):
    name = "skip-update"

    def skip_step(self, step: int, steps: int, site: PlantSite) -> bool:
        return site.rank != 0 and step == steps - 1


class _DropOptimizerState(Planter):
    """AdamW's state is emptied after the restore: its moments and step count start over."""

    def after_restore(self, trainer: Any, site: PlantSite) -> None:
        trainer.optimizers[0].state.clear()

    def can_change(self, trainer: Any, site: PlantSite) -> bool:
        return bool(trainer.optimizers) and bool(trainer.optimizers[0].state)


class _ResetScheduler(Planter):
    """The LR scheduler goes back to step 0 after the restore, and the optimizer to its base LR."""

    def after_restore(self, trainer: Any, site: PlantSite) -> None:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        for group, base in zip(trainer.optimizers[0].param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base
        scheduler.last_epoch = 0
        scheduler._step_count = 1
        scheduler._last_lr = list(scheduler.base_lrs)

    def can_change(self, trainer: Any, site: PlantSite) -> bool:
        configs = trainer.lr_scheduler_configs
        return bool(configs) and bool(trainer.optimizers) and configs[0].scheduler.last_epoch > 0


class _PerturbWeight(Planter):
    """The first element of the first trainable tensor (this rank's shard of it) moves by 1e-3 after the restore."""

    def after_restore(self, trainer: Any, site: PlantSite) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        param = next(p for p in trainer.lightning_module.parameters() if p.requires_grad)
        local = param.data.to_local() if isinstance(param.data, DTensor) else param.data
        if local.numel():
            with torch.no_grad():
                local.view(-1)[0] += 1e-3

    def can_change(self, trainer: Any, site: PlantSite) -> bool:
        return any(p.requires_grad for p in trainer.lightning_module.parameters())


class _UnrestoredRng(Planter):
    """Every random generator (torch's on the CPU and the devices, Python's, NumPy's) takes another state right
    after the restore, as if the checkpoint's RNG state had not been loaded. The new seed is drawn from the
    restored state, so the mutant is the same on every run and on every rank that restored the same state."""

    def after_restore(self, trainer: Any, site: PlantSite) -> None:
        import random

        import torch

        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        torch.manual_seed(seed)  # the CPU generator and every device's
        random.seed(seed)
        try:
            import numpy
        except ImportError:
            return
        numpy.random.seed(seed)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault: what it breaks, the arms it may be planted on, the checks that must reject it, its planter."""

    name: str
    """Registry name, as passed to ``run(fault=...)`` and ``expect_fault_rejected``."""
    description: str
    """What the fault does to the training step."""
    arms: tuple[str, ...]
    """Arms it may be planted on; planting it elsewhere is a usage error naming these. None: a fault of a
    user's own fits only, planted by ``--sprite-mutate`` (no check of the plugin's judges it)."""
    by: tuple[str, ...]
    """Checks that must be among the failed ones (``expect_fault_rejected``'s default ``by=``); none for a
    fault no arm takes."""
    planter: Planter
    """What plants it: the hooks the arms call."""
    by_assertion: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per assertion kind (``criterion_v2``), the checks that reject it there when they differ from ``by``."""

    def checks_for(self, kind: str | None) -> tuple[str, ...]:
        """The checks that must reject this fault in an assertion of ``kind`` (its result's ``kind``)."""
        return self.by_assertion.get(kind or "", self.by)

    def check(self, site: PlantSite) -> None:
        """Refuse, before training, an arm the fault is not for, or a run its planter cannot break."""
        if not self.arms:
            raise SpriteUsageError(
                f"fault {self.name!r} is planted only by --sprite-mutate, in a test's own Lightning fits: no arm "
                "of pytest-sprite's recipes takes it"
            )
        if site.arm not in self.arms:
            reference = "; the reference arm always runs clean" if site.arm == "single" else ""
            raise SpriteUsageError(
                f"fault {self.name!r} applies to arms {', '.join(self.arms)}, not {site.arm!r}{reference}"
            )
        self.planter.check(site)


BUILTIN_FAULTS: Final[tuple[Fault, ...]] = (
    Fault(
        name="missing-rank",
        description="the last rank's loss is multiplied by 0, so its gradient never reaches the average",
        arms=("ddp", "fsdp"),
        by=("pre_norm",),
        planter=_DropLastRank(),
        by_assertion={"criterion_v2": ("pre_norm", "gradients")},
    ),
    Fault(
        name="wrong-scale",
        description="every rank's loss is multiplied by N (the world size), so gradients are summed, not averaged",
        arms=("ddp", "fsdp"),
        by=("pre_norm",),
        planter=_SumOverRanks(),
        by_assertion={"criterion_v2": ("pre_norm", "gradients")},
    ),
    Fault(
        name="accumulate-sum",
        description=(
            "gradient accumulation skips the division by the k micro-batches, so the step uses k times the mean"
        ),
        arms=("ddp", "fsdp"),
        by=("pre_norm",),
        planter=_SumMicroBatches(),
    ),
    Fault(
        name="fp32-backbone",
        description="the backbone's forward runs without autocast, so its Linear layers compute in FP32",
        arms=("ddp",),
        by=("dtype",),
        planter=_Fp32Backbone(),
    ),
    Fault(
        name="local-adapter",
        description="one LoRA tensor is left out of DDP, so it keeps its local, unsynchronized gradient",
        arms=("ddp",),
        by=("synchronized",),
        planter=_LocalAdapter(),
    ),
    Fault(
        name="scale-grad",
        description="gradients are multiplied by N (the world size) after synchronization",
        arms=("ddp",),
        by=("pre_norm", "gradients"),
        planter=_ScaleGrad(),
    ),
    Fault(
        name="skip-update",
        description="ranks other than 0 skip the last update",
        arms=("ddp",),
        by=("synchronized",),
        planter=_SkipLastUpdate(),
    ),
    Fault(
        name="dropped-optimizer-state",
        description="the optimizer state is dropped right after the checkpoint restore",
        arms=("resume",),
        by=("optimizer_state",),
        planter=_DropOptimizerState(),
    ),
    Fault(
        name="reset-lr-scheduler",
        description="the LR scheduler restarts from step 0 right after the checkpoint restore",
        arms=("resume",),
        by=("lr_scheduler", "lr"),
        planter=_ResetScheduler(),
    ),
    Fault(
        name="perturbed-weight",
        description="a trainable weight moves by 1e-3 right after the checkpoint restore",
        arms=("resume",),
        by=("trainables",),
        planter=_PerturbWeight(),
    ),
    Fault(
        name="unrestored-rng",
        description="the random generators take another state right after the checkpoint restore, as if the "
        "checkpoint's RNG state had not been loaded",
        arms=(),
        by=(),
        planter=_UnrestoredRng(),
    ),
)
"""The faults pytest-sprite ships (registered through ``pytest_sprite_add_faults`` like a project's)."""


class FaultRegistry:
    """What ``pytest_sprite_add_faults`` fills: every fault a session may plant, by name, in the order added."""

    def __init__(self) -> None:
        self.faults: dict[str, Fault] = {}

    def add(self, fault: Fault) -> None:
        """Register ``fault``; a name added twice is an error (a fault means one thing in a session)."""
        if fault.name in self.faults:
            raise SpriteUsageError(
                f"fault {fault.name!r} is registered twice (pytest_sprite_add_faults); give the new one another name"
            )
        self.faults[fault.name] = fault


@pytest.hookimpl(tryfirst=True)  # the built-ins first in every list
def pytest_sprite_add_faults(faults: FaultRegistry) -> None:
    """The built-in faults, registered like a project's."""
    for fault in BUILTIN_FAULTS:
        faults.add(fault)


FAULTS: Final[dict[str, Fault]] = {f.name: f for f in BUILTIN_FAULTS}
"""The one fault registry: every fault this session plants, by name (the built-ins until a session collects)."""

_faults_key: Final = pytest.StashKey[dict[str, Fault]]()


def collect_faults(config: pytest.Config) -> Mapping[str, Fault]:
    """Ask every plugin for its faults (``pytest_sprite_add_faults``) and make them the registry, once per session.

    The session's faults replace :data:`FAULTS`' entries in place (every process of the session, forks included,
    reads them there); :func:`restore_faults` puts the previous entries back when the session ends.
    """
    registry = FaultRegistry()
    config.hook.pytest_sprite_add_faults(faults=registry)
    config.stash[_faults_key] = dict(FAULTS)
    FAULTS.clear()
    FAULTS.update(registry.faults)
    return registry.faults


def restore_faults(config: pytest.Config) -> None:
    """Put back the registry :func:`collect_faults` replaced (a pytest session run inside another one)."""
    previous = config.stash.get(_faults_key, None)
    if previous is not None:
        FAULTS.clear()
        FAULTS.update(previous)


def registered_faults() -> Mapping[str, Fault]:
    """Every fault the running session may plant, by name, built-in and registered by plugins alike."""
    return dict(FAULTS)


_RESERVED: Final[dict[str, str]] = {}
"""The lightning-sprite procedure's faults that a later version plants; each becomes a :data:`FAULTS` entry and leaves this table."""


def get_fault(name: object) -> Fault:
    """The registry entry for ``name``; an unknown or not yet planted name raises listing the known ones."""
    if isinstance(name, str) and name in FAULTS:
        return FAULTS[name]
    if isinstance(name, str) and name in _RESERVED:
        raise SpriteUsageError(
            f"fault {name!r} is reserved for {_RESERVED[name]} and not planted by this version; "
            f"faults it plants: {', '.join(FAULTS)}"
        )
    raise SpriteUsageError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")


def plant(fault: str | None, site: PlantSite) -> Planter:
    """The planter an arm calls at its hooks: the fault's, after checking it may go there, or :data:`CLEAN`."""
    if fault is None:
        return CLEAN
    entry = get_fault(fault)
    entry.check(site)
    return entry.planter
