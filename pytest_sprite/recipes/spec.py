"""What a recipe is: its fields and their checks, below everything that trains or judges one.

:class:`~pytest_sprite.Recipe` adds how it runs (``run``, ``resume_roles``). The modules that check an arm
request, resolve a model or plan a resume read a recipe's fields through :class:`RecipeSpec`, so none of
them imports the module that runs recipes. Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.constants import DEFAULT_LR

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RecipeSpec", "describe"]


def describe(value: object) -> str:
    """What was given, for error messages: ``<function rows>``, ``<class MLP>``, ``3 (int)``."""
    if isinstance(value, type):
        return f"<class {value.__qualname__}>"
    if callable(value):
        return f"<{type(value).__name__} {getattr(value, '__qualname__', repr(value))}>"
    return f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True, kw_only=True, eq=False)
class RecipeSpec:
    """A recipe's fields, checked when it is built; :class:`~pytest_sprite.Recipe` is what users build."""

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
            problems.append(f"name must be a non-empty str, got {describe(self.name)}")
        for field_name, what in (
            ("model", "a callable that builds an nn.Module (e.g. the module's class)"),
            ("rows", "a callable rows(n) returning n rows"),
            ("loss", "a callable loss(model, batch) returning a scalar tensor"),
        ):
            value = getattr(self, field_name)
            if not callable(value):
                problems.append(f"{field_name} must be {what}, got {describe(value)}")
            elif field_name == "model" and not isinstance(value, type) and hasattr(value, "named_parameters"):
                # A module instance is callable too, but every arm must train a fresh copy built after seeding.
                problems.append(
                    f"model must be {what}, got a built {type(value).__name__} instance; pass its class "
                    f"(model={type(value).__name__}) or a function that builds one"
                )
        if self.shard is not None and not callable(self.shard):
            problems.append(
                f"shard must be a callable shard(model, mesh) or None, got {describe(self.shard)}"
            )
        if self.linear_sites is not None and (
            isinstance(self.linear_sites, str)
            or not isinstance(self.linear_sites, Sequence)
            or not all(isinstance(s, str) and s for s in self.linear_sites)
        ):
            problems.append(
                f"linear_sites must be a sequence of module names (e.g. ('fc1', 'head')) or None, "
                f"got {describe(self.linear_sites)}"
            )
        for field_name in ("backbone", "adapter"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                problems.append(f"{field_name} must be a non-empty name or None, got {describe(value)}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            problems.append(f"seed must be a non-negative int, got {describe(self.seed)}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            problems.append(f"lr must be a positive number, got {describe(self.lr)}")
        if problems:
            raise SpriteUsageError("Recipe(...): " + "; ".join(problems))
