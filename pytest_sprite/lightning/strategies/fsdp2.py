"""FSDP2 (``fully_shard``) data parallelism on Lightning's ModelParallelStrategy.

Lightning 2.6's FSDP1 ``FSDPStrategy`` refuses norm clipping (``plugins/precision/fsdp.py:85-92``), autocasts
for "cuda" (line 130) and builds a "cuda" mesh (``strategies/fsdp.py:272``). Its ``ModelParallelStrategy``
defaults to data_parallel = nodes and tensor_parallel = processes per node (``model_parallel.py:147-150``),
so on one node it shards nothing and every rank sees the same batches. :class:`FSDP2Strategy` defaults to
data parallelism over every process, on the root device's own mesh type, and keeps Lightning's sharded
(torch.distributed.checkpoint) and full-state checkpoints; full-state optimizer state is matched to the
optimizer by position, so 1-device and DDP checkpoints of a partly frozen model resume under FSDP2.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.lightning._internals import fsdp_param_groups
from pytest_sprite.lightning.strategies._common import (
    LaunchScoped,
    ProcessScope,
    default_cluster_environment,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FSDP2Strategy"]

_SHOWN = 8


class FSDP2Strategy(LaunchScoped, ModelParallelStrategy):
    """FSDP2 data parallelism over every process, with the checks a correctness run needs before it starts.

    - ``data_parallel_size="auto"`` is the world size divided by ``tensor_parallel_size`` ("auto" = 1), so one
      node shards too and every rank sees its own batches.
    - Before fitting, raises if a trainable parameter is not managed by a ``fully_shard`` module: its
      gradients would never be averaged across ranks. Being a DTensor is not enough, since tensor
      parallelism alone also produces DTensors.
    - Under an external launcher, checks the launched process count against devices x num_nodes.
    - Gradient clipping by norm goes through the precision plugin's ``clip_grad_norm_``, which reduces the
      DTensor gradient norms over the mesh: the norm is global, as on one device.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.cluster_environment = default_cluster_environment(cluster_environment)
        self._scope = ProcessScope()

    # ---------------------------------------------------------------------------------------------------
    # processes, mesh

    def setup_environment(self) -> None:
        self._resolve_mesh_sizes()
        super().setup_environment()

    def _resolve_mesh_sizes(self) -> None:
        """Data parallel over every process unless told otherwise (Lightning's "auto" is TP within a node)."""
        world = self.num_nodes * self.num_processes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        if self._data_parallel_size == "auto":
            tp = int(self._tensor_parallel_size)
            if world % tp:
                raise SpriteUsageError(
                    f"FSDP2Strategy(tensor_parallel_size={tp}) does not divide the world of {world} processes "
                    f"({self.num_nodes} node(s) x {self.num_processes}); choose a divisor of {world}."
                )
            self._data_parallel_size = world // tp

    def setup(self, trainer: pl.Trainer) -> None:
        lightning_module = self.lightning_module
        if (
            trainer.state.fn == TrainerFn.FITTING
            and lightning_module is not None
            and is_overridden("configure_model", lightning_module)
        ):
            _refuse_unmanaged_trainable(lightning_module, self.world_size)
        super().setup(trainer)

    # ---------------------------------------------------------------------------------------------------
    # checkpoints

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Sharded directories load as in Lightning; full-state files map optimizer state by position.

        A full-state file (1-device, DDP, or ``save_distributed_checkpoint=False``) keys optimizer state by
        integers. Lightning turns them into names by taking the i-th parameter of the *module*, frozen ones
        included (``fabric/strategies/model_parallel.py:478-483``), so the state of a LoRA optimizer lands
        on frozen weights and loading raises "Missing optimizer state". Here the k-th saved parameter is the
        k-th parameter of the optimizer, as ``torch.optim.Optimizer.load_state_dict`` pairs them.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():  # a sharded checkpoint is a directory
            return super().load_checkpoint(path, weights_only=weights_only)
        model = _model(self)
        lightning_module = self.lightning_module
        strict = lightning_module.strict_loading if lightning_module is not None else True
        checkpoint: dict[str, Any] = torch.load(
            path, mmap=True, map_location="cpu", weights_only=weights_only
        )
        # Every rank read the whole file: torch shards each full tensor into this rank's part.
        set_model_state_dict(
            model, checkpoint.pop("state_dict"), options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        states = checkpoint.get("optimizer_states", [])
        if self.optimizers and len(states) != len(self.optimizers):
            raise SpriteUsageError(
                f"checkpoint {str(path)!r} holds {len(states)} optimizer state(s) but the module configures "
                f"{len(self.optimizers)} optimizer(s); resume with the configure_optimizers it was saved with."
            )
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        for optimizer, state in zip(self.optimizers, states[: len(self.optimizers)], strict=True):
            by_name = _keyed_by_name(state, model, optimizer, path)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name, options=options)
        return checkpoint


def _model(strategy: FSDP2Strategy) -> Module:
    if strategy.model is None:
        raise RuntimeError("FSDP2Strategy has no model yet; checkpoints are saved and loaded inside a fit")
    return strategy.model


# -------------------------------------------------------------------------------------------------------
# managed parameters


def _fsdp_managed_parameters(model: Module) -> set[int]:
    """ids of the parameters some ``fully_shard`` module manages (shards, all-gathers, reduce-scatters)."""
    from torch.distributed.fsdp import FSDPModule

    managed: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            managed.update(id(fsdp_param.sharded_param) for fsdp_param in group.fsdp_params)
    return managed


def _refuse_unmanaged_trainable(model: Module, world_size: int) -> None:
    """Raise before the first step if a trainable parameter escaped ``fully_shard``."""
    managed = _fsdp_managed_parameters(model)
    loose = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
    if not loose:
        return
    shown = ", ".join(loose[:_SHOWN]) + (f", ... ({len(loose) - _SHOWN} more)" if len(loose) > _SHOWN else "")
    raise SpriteUsageError(
        f"FSDP2Strategy: {len(loose)} trainable parameter(s) are not managed by any fully_shard module, so "
        f"their gradients would never be averaged across the {world_size} ranks: {shown}. Put every trainable "
        f"module, including any task head, inside the module you pass to shard_model() in configure_model "
        f"(or fully_shard it yourself), or freeze it with requires_grad_(False). Being a DTensor is not "
        f"enough: tensor parallelism alone also produces DTensors."
    )


# -------------------------------------------------------------------------------------------------------
# optimizer state keys


def _keyed_by_name(state: dict[str, Any], model: Module, optimizer: Optimizer, path: Path) -> dict[str, Any]:
    """Integer keys (1-device, DDP, full-state FSDP2 checkpoints) → this optimizer's parameter names."""
    saved = [key for group in state["param_groups"] for key in group["params"]]
    if not saved or not isinstance(saved[0], int):
        return state  # already keyed by name
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    current = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))
    current_groups = cast(list[dict[str, Any]], current["param_groups"])
    names = [name for group in current_groups for name in group["params"]]
    saved_sizes = [len(group["params"]) for group in state["param_groups"]]
    current_sizes = [len(group["params"]) for group in current_groups]
    if saved_sizes != current_sizes:
        raise SpriteUsageError(
            f"checkpoint {str(path)!r} has optimizer param groups of {saved_sizes} parameters, but this "
            f"optimizer's groups hold {current_sizes}: the trainable parameters changed between save and "
            f"resume (frozen or unfrozen layers, a different adapter). Resume with the same trainable parameters."
        )
    # torch.optim semantics: the k-th saved parameter is the k-th parameter of the optimizer now
    name_of = dict(zip(saved, names, strict=True))
    return {
        "state": {name_of[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [name_of[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
