"""The FSDP2 units of a recipe that says nothing about sharding (imports torch only when it shards)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

from pytest_sprite.plumbing.dependency_internals import hf_no_split_modules

__all__ = ["default_shard"]


def default_shard(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 units when a recipe gives no ``shard``: Hugging Face's ``_no_split_modules`` rule when the model
    declares blocks that way, else every direct child that holds trainables; then the root.

    Idempotent like ``shard_model`` (Lightning calls ``configure_model`` again for a later stage).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from pytest_sprite.lightning import shard_model

    if isinstance(model, FSDPModule):
        return
    declared: set[str] = set()
    for sub in model.modules():
        declared.update(hf_no_split_modules(sub))
    if any(type(sub).__name__ in declared for sub in model.modules() if sub is not model):
        shard_model(model, mesh)
        return
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()) and not isinstance(child, FSDPModule):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
