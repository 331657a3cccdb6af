"""The training and checkpoint mutants of ``--sprite-mutate``: the fault registry's planters in any Lightning fit.

Lightning builds the callback of every Trainer made in a mutation run through its public
``lightning.pytorch.callbacks_factory`` entry point (``pyproject.toml``), so a user's own fit, a recipe's arm
and a resume role in a sub-world are reached alike, with nothing patched. Outside a mutation run
:func:`callbacks` returns nothing. The callback does in the user's fit what the plugin's arms do at their hook
points: ``loss`` on the loss a training step returns, ``gradients`` before the optimizer step (after
backward synchronized them, before clipping), ``after_restore`` when the fit starts from a checkpoint.

The clean run records, per training step and per restore, which faults could be planted there (each planter's
``check`` accepts the fit, and a restore fault has something to change): the controller runs a fault's
mutant only for a test whose clean run recorded it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback

from ..plumbing.mutants import MutationRun, current_run

__all__ = ["FaultMutants", "callbacks"]


def callbacks() -> list[Any]:
    """Lightning's ``callbacks_factory`` entry point: the mutation run's callback, or none outside one."""
    run = current_run()
    if run is None:
        return []
    from ..planted_faults import registered_faults
    from ..plumbing.mutants import fault_mutant

    faults = []
    for fault in registered_faults().values():
        mutant = fault_mutant(fault.name, fault.description, fault.planter.hooks())
        if mutant is not None:
            faults.append((mutant.op, fault))
    return [FaultMutants(run, faults)]


class FaultMutants(Callback):
    """Plants the run's training or checkpoint mutant in one Trainer's fits; records where each could go."""

    def __init__(self, run: MutationRun, faults: Sequence[tuple[str, Any]]) -> None:
        self.run = run
        self.faults = list(faults)
        """(op, registry entry) of every fault a mutant can plant from outside the arms."""
        self.restored = False
        self.site: Any = None
        self.plantable: list[tuple[str, Any]] = []
        self.active: Any = None
        """The planter acting on this training step, or None."""

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.restored = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.site = _site(trainer)
        self.plantable = [(op, f) for op, f in self.faults if _accepts(f.planter, self.site)]
        if self.restored:
            self.restored = False
            for op, fault in self.plantable:
                if op.startswith("restore:") and fault.planter.can_change(trainer, self.site):
                    if self.run.acting(op, self.site.rank, self.site.world_size) is not None:
                        fault.planter.after_restore(trainer, self.site)
        planted = self.run.spec
        if planted is not None and any(op == planted.mutant.op for op, _ in self.plantable):
            _wrap_training_step(pl_module, self)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.active = None
        for op, fault in self.plantable:
            if op.startswith("step:") and self.run.acting(op, self.site.rank, self.site.world_size):
                self.active = fault.planter

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.active is not None:
            trainables = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
            self.active.gradients(trainables, self.site)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.active = None
        pl_module.__dict__.pop("training_step", None)

    def scaled(self, output: Any) -> Any:
        """A training step's output with its loss through the acting planter's ``loss`` hook."""
        import torch

        if self.active is None:
            return output
        if isinstance(output, torch.Tensor):
            return self.active.loss(output, self.site)
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": self.active.loss(output["loss"], self.site)}
        return output  # None (a skipped step) or manual optimization: nothing to scale


def _wrap_training_step(pl_module: Any, mutants: FaultMutants) -> None:
    """Route ``pl_module``'s training step output through the planter (an instance attribute, removed at the
    fit's end; Lightning's strategies look the step up on the instance, DDP's forward redirection too)."""
    step = type(pl_module).training_step.__get__(pl_module)

    def training_step(*args: Any, **kwargs: Any) -> Any:
        return mutants.scaled(step(*args, **kwargs))

    pl_module.training_step = training_step


def _site(trainer: Any) -> Any:
    from ..planted_faults import PlantSite

    strategy = trainer.strategy
    return PlantSite(
        arm=str(getattr(strategy, "strategy_name", type(strategy).__name__)),
        rank=int(trainer.global_rank),
        world_size=int(trainer.world_size),
        accumulate=int(trainer.accumulate_grad_batches),
        precision=str(trainer.precision),
    )


def _accepts(planter: Any, site: Any) -> bool:
    """Whether the planter's own check lets it into this fit (a BF16 control refuses an FP32 fit)."""
    from ..errors import SpriteUsageError

    try:
        planter.check(site)
    except SpriteUsageError:
        return False
    return True
