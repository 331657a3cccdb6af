"""A recipe resolved against its model and rows: what the arms and roles need to know before they train.

The rows drawn (checked deterministic and equal on every rank), the model built after seeding (the one
place a recipe's model is built), its identity, and the Linear sites, backbone and adapter tensor that
criterion v2 and its faults name. Importing this module imports no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.spec import RecipeSpec, describe

if TYPE_CHECKING:
    import torch

    from pytest_sprite.world import World

__all__ = [
    "RecipeData",
    "adapter_tensor",
    "backbone_module",
    "build_model",
    "check_same_model_everywhere",
    "describe",
    "draw_rows",
    "linear_sites",
    "model_identity",
    "rows_digest",
]


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


def draw_rows(recipe: RecipeSpec, n: int, world: World) -> RecipeData:
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


def _call_rows(recipe: RecipeSpec, n: int) -> Sequence[Any]:
    rows = recipe.rows(n)
    if not isinstance(rows, Sequence) and not (hasattr(rows, "__len__") and hasattr(rows, "__getitem__")):
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: rows({n}) must return a sequence of {n} rows, got {describe(rows)}"
        )
    if len(rows) != n:
        raise SpriteUsageError(f"recipe {recipe.name!r}: rows({n}) returned {len(rows)} rows, not {n}")
    return rows


def build_model(recipe: RecipeSpec) -> torch.nn.Module:
    """``recipe.model()`` after ``torch.manual_seed(recipe.seed)``, the global RNG restored afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = recipe.model()
    if not isinstance(model, torch.nn.Module):
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: model() must return a torch.nn.Module, got {describe(model)}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise SpriteUsageError(
            f"recipe {recipe.name!r}: model() built a {type(model).__name__} without a trainable parameter; "
            "every parameter has requires_grad=False, so no arm would train anything"
        )
    model.train()
    return model


def model_identity(recipe: RecipeSpec, model: torch.nn.Module) -> str:
    """``<name>:<digest>`` of the model's class and parameter names, shapes and dtypes (its structure)."""
    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return f"{recipe.name}:{h.hexdigest()[:16]}"


def check_same_model_everywhere(recipe: RecipeSpec, model: torch.nn.Module, world: World) -> None:
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


def linear_sites(recipe: RecipeSpec, model: torch.nn.Module) -> dict[str, str]:
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


def backbone_module(recipe: RecipeSpec, model: torch.nn.Module, fault: str) -> str:
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


def adapter_tensor(recipe: RecipeSpec, model: torch.nn.Module) -> str:
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
