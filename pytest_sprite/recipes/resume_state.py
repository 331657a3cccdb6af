"""The training state of a resume role at one point: what a save wrote, or a restore put back.

Full trainables and optimizer state (gathered from FSDP2 shards in one collective), parameter groups, the
LR scheduler, digests of the frozen tensors and of the RNG. Loaded only inside a role's process.
"""

from __future__ import annotations

import hashlib

import lightning.pytorch as pl
import torch

from pytest_sprite.recipes.fit_kit import full_values
from pytest_sprite.records import StateCapture, tensor_digest

__all__ = ["capture_state", "rng_digest"]


def rng_digest(device: torch.device) -> str:
    """Digest of the CPU generator's state and, on an accelerator, the device's."""
    h = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes())
    if device.type == "cuda":
        h.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    elif device.type == "xpu":
        h.update(torch.xpu.get_rng_state(device).numpy().tobytes())
    return h.hexdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _names(net: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in net.named_parameters()}


def capture_state(trainer: pl.Trainer, net: torch.nn.Module, *, rank: int, world_size: int) -> StateCapture:
    """The training state on this rank now: full trainables and optimizer state, groups, scheduler, frozen.

    A collective under FSDP2 (full values are gathered): every rank must call it at the same point.
    """
    optimizer = trainer.optimizers[0]
    names = _names(net)
    trainables = {n: p for n, p in net.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in net.named_parameters() if not p.requires_grad}
    state_by_name = {names[id(p)]: s for p, s in optimizer.state.items() if id(p) in names}
    wanted: list[tuple[str, torch.Tensor]] = [(f"param:{n}", p.detach()) for n, p in trainables.items()]
    wanted += [(f"frozen:{n}", p.detach()) for n, p in frozen.items()]
    opt_devices: dict[str, dict[str, str]] = {}
    opt_keys: dict[str, tuple[str, str]] = {}
    for name in trainables:
        state = {k: v for k, v in sorted(state_by_name.get(name, {}).items()) if torch.is_tensor(v)}
        for k, v in state.items():
            opt_keys[f"opt:{name}:{k}"] = (name, k)
            wanted.append((f"opt:{name}:{k}", v.detach()))
        opt_devices[name] = {k: str(_local(v).device) for k, v in state.items()}
    full = full_values(wanted)  # every rank, the same order: one collective under FSDP2
    opt_full: dict[str, dict[str, torch.Tensor]] = {name: {} for name in trainables}
    for key, (name, state_key) in opt_keys.items():
        opt_full[name][state_key] = full[key]
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names.get(id(p), "?") for p in group["params"]],
            }
        )
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    return StateCapture(
        rank=rank,
        world_size=world_size,
        global_step=int(trainer.global_step),
        epochs_done=int(getattr(trainer.fit_loop.epoch_progress.current, "processed", 0)),
        trainables={n: full[f"param:{n}"] for n in trainables},
        optimizer=opt_full,
        optimizer_devices=opt_devices,
        param_devices={n: str(_local(p).device) for n, p in trainables.items()},
        param_groups=tuple(groups),
        scheduler=dict(scheduler.state_dict()),
        frozen={n: tensor_digest(full[f"frozen:{n}"]) for n in frozen},
    )
