"""``shard_model``: FSDP2 per transformer block, then the root, safe to call again."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from torch.nn import Module

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.lightning._internals import no_split_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["shard_model"]

_SHOWN = 12


def shard_model(
    module: Module,
    mesh: DeviceMesh,
    layer_classes: Iterable[type[Module] | str] | None = None,
) -> Module:
    """``fully_shard`` each block, bottom-up, then ``module`` itself; return ``module``.

    Blocks are the submodules whose class is named in Hugging Face's ``_no_split_modules`` (read from
    ``module`` and every submodule, so a PEFT-wrapped model works), or those matching ``layer_classes``
    (classes or class names) when given. Idempotent, because Lightning calls ``configure_model`` again for a
    later validate/test/predict: an already-sharded root is returned as it is, and already-sharded blocks
    are skipped.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(module, FSDPModule):
        return module
    matches = _block_matcher(module, layer_classes)
    blocks = [sub for sub in module.modules() if sub is not module and matches(sub)]
    if layer_classes is not None and not blocks:
        present = sorted({type(sub).__name__ for sub in module.modules()})
        shown = ", ".join(present[:_SHOWN]) + (", ..." if len(present) > _SHOWN else "")
        raise SpriteUsageError(
            f"shard_model(layer_classes={_describe(layer_classes)}) matched no submodule of "
            f"{type(module).__name__}; its module classes are: {shown}. Pass the class of the repeated block "
            f"(e.g. the decoder layer), or layer_classes=None to use Hugging Face's _no_split_modules."
        )
    # modules() is pre-order (parents first); reversed, every block is sharded before any block holding it.
    for block in reversed(blocks):
        if not isinstance(block, FSDPModule):
            fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _block_matcher(
    module: Module, layer_classes: Iterable[type[Module] | str] | None
) -> Callable[[Module], bool]:
    if layer_classes is None:
        names: set[str] = set()
        for sub in module.modules():
            names.update(no_split_modules(sub))
        return lambda sub: type(sub).__name__ in names
    given = list(layer_classes) if not isinstance(layer_classes, (str, type)) else [layer_classes]
    classes = tuple(c for c in given if isinstance(c, type))
    class_names = {c for c in given if isinstance(c, str)}
    bad = [c for c in given if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, Module)))]
    if bad:
        raise SpriteUsageError(
            f"shard_model(layer_classes=...) got {bad!r}; pass torch.nn.Module subclasses or their class names."
        )
    return lambda sub: isinstance(sub, classes) or type(sub).__name__ in class_names


def _describe(layer_classes: Iterable[type[Module] | str]) -> str:
    items = [layer_classes] if isinstance(layer_classes, (str, type)) else list(layer_classes)
    return "[" + ", ".join(c if isinstance(c, str) else c.__name__ for c in items) + "]"
