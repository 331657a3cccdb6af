"""What a checkpoint-resume role is: the recipe its roles share, and one role's spec.

Picklable and free of torch: a spec travels to the role's fresh processes (``pytest_sprite.recipes._resume``
runs it there) and is built by the host side (``pytest_sprite.recipes.resume_roles``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.planted_faults import FAULTS

if TYPE_CHECKING:
    from pytest_sprite.recipes.spec import RecipeSpec

__all__ = ["FROZEN_CHANGED", "RESUME_FAULTS", "ROLES", "STRATEGIES", "ResumeRecipe", "RoleSpec"]

STRATEGIES: tuple[str, ...] = ("single", "ddp", "fsdp", "fsdp_file")
"""How a role trains: one device, XPUDDPStrategy, FSDP2Strategy sharded (torch.distributed.checkpoint
directories) and FSDP2Strategy with ``save_distributed_checkpoint=False`` (one full-state file)."""
ROLES: tuple[str, ...] = ("fit", "twin", "killed", "resume", "reload", "reshard", "export")
"""Every role of a resume check."""
RESUME_FAULTS: tuple[str, ...] = tuple(name for name, f in FAULTS.items() if "resume" in f.arms)
"""Faults a resume role plants right after its restore (the registry's entries for the ``resume`` arm)."""
FROZEN_CHANGED = 4
"""Frozen tensors changed before every load: only the checkpoint can put them back."""


@dataclass(frozen=True, kw_only=True)
class ResumeRecipe:
    """The training recipe every role of one check shares (picklable: it travels to the role's processes)."""

    seed: int = 0
    """Seed of the model's weights and of the rows."""
    qwen_path: str | None = None
    """Real Qwen2 weights, or None for the tiny in-memory model."""
    seq_len: int = 8
    """Tokens per row."""
    lr: float = 1e-2
    """AdamW's base learning rate."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    end_factor: float = 0.1
    """The per-step schedule: LinearLR from lr down to lr x end_factor over the whole run."""
    clip: float = 0.01
    """Global gradient-norm clip (active at every step of the tiny model)."""
    epochs: int = 2
    """Epochs of the uninterrupted fit."""
    steps_per_epoch: int = 3
    """Optimizer steps per epoch."""
    global_batch: int = 8
    """Rows per optimizer step, all ranks together."""
    source: RecipeSpec = None  # type: ignore[assignment]
    """The :class:`~pytest_sprite.Recipe` whose model, rows, loss and sharding the roles train (picklable:
    top-level callables), for example ``LoraQwen(seed=..., qwen_path=..., seq_len=...)``."""

    def __post_init__(self) -> None:
        if self.source is None:
            raise SpriteUsageError(
                "ResumeRecipe(source=...) names the recipe the roles train, e.g. "
                "source=LoraQwen(seed=0) from pytest_sprite.recipes.lora_qwen"
            )

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the uninterrupted fit."""
        return self.epochs * self.steps_per_epoch


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """One role: how it trains, where it writes, what it loads and which fault it plants."""

    role: str
    """A name from :data:`ROLES`."""
    strategy: str
    """A name from :data:`STRATEGIES`."""
    precision: str
    """Lightning precision flag: ``32-true`` or ``bf16-mixed``."""
    recipe: ResumeRecipe
    """The shared training recipe."""
    directory: str
    """Where this role writes its checkpoints (shared by its ranks)."""
    resume_from: str | None = None
    """Checkpoint to load before training, None for a fresh fit."""
    fault: str | None = None
    """Fault planted right after the restore."""
    max_epochs: int | None = None
    """Epochs to train up to; default the recipe's."""
    stop_after_restore: bool = False
    """End the fit right after the restore (the reload role)."""
    save_every_n_steps: int | None = None
    """Also save every n optimizer steps (a mid-epoch checkpoint); None saves at epoch ends only."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SpriteUsageError(f"unknown resume role {self.role!r}; roles: {', '.join(ROLES)}")
        if self.strategy not in STRATEGIES:
            raise SpriteUsageError(
                f"unknown resume strategy {self.strategy!r}; strategies: {', '.join(STRATEGIES)}"
            )
        if self.fault is not None and self.fault not in RESUME_FAULTS:
            raise SpriteUsageError(
                f"fault {self.fault!r} is not planted by a resume role; resume faults: {', '.join(RESUME_FAULTS)}"
            )
        if self.fault is not None and self.resume_from is None:
            raise SpriteUsageError(f"fault {self.fault!r} is planted after a restore; give resume_from=")
