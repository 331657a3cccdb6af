"""``trainer_kwargs``: the accelerator, strategy, devices and plugins for one of three ways to train."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy

from pytest_sprite.env.rank_variables import optional_rank_env
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.lightning.accelerator import XPUAccelerator
from pytest_sprite.lightning.precision import XPUMixedPrecision, normalize_precision
from pytest_sprite.lightning.strategies.ddp import XPUDDPStrategy
from pytest_sprite.lightning.strategies.fsdp2 import FSDP2Strategy

__all__ = ["trainer_kwargs"]

StrategyName = Literal["single", "ddp", "fsdp"]
AcceleratorName = Literal["xpu", "cpu", "cuda"]
Devices = int | str | Sequence[int]

_STRATEGIES = ("single", "ddp", "fsdp")
_ACCELERATORS = ("xpu", "cpu", "cuda")


def trainer_kwargs(
    strategy: StrategyName,
    *,
    devices: Devices = "auto",
    num_nodes: int = 1,
    precision: str | int = "bf16-mixed",
    accelerator: AcceleratorName = "xpu",
) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer``: accelerator, strategy, devices, num_nodes and plugins.

    ``strategy`` is "single" (one device), "ddp" (:class:`XPUDDPStrategy`) or "fsdp" (:class:`FSDP2Strategy`).
    Precision goes in ``plugins`` (do not also pass ``precision=`` to the Trainer: Lightning raises "Received
    both"): "bf16-mixed" (default) and "16-mixed" (and the aliases "bf16", "16", 16) autocast on the real
    device type via :class:`XPUMixedPrecision`; "32-true", "bf16-true" and "16-true" are Lightning's own.
    ``accelerator="cpu"`` gives the same strategies on CPU with gloo, which is how CI runs them;
    ``accelerator="cuda"`` gives them on NVIDIA GPUs with nccl (the lightning-sprite procedure's A100 reference runs).

    ``trainer_kwargs("single", devices=[3])`` pins tile 3; "auto" or 1 pins the current tile (or GPU). For
    "ddp" and "fsdp", ``devices="auto"`` is the launcher's processes per node when a launcher set it, else
    every visible tile or GPU, or one process on CPU.
    """
    if strategy not in _STRATEGIES:
        raise SpriteUsageError(f"trainer_kwargs(strategy={strategy!r}): use one of {', '.join(_STRATEGIES)}.")
    if accelerator not in _ACCELERATORS:
        raise SpriteUsageError(
            f"trainer_kwargs(accelerator={accelerator!r}): use one of {', '.join(_ACCELERATORS)} ('cpu' runs "
            f"the same strategies with gloo)."
        )
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise SpriteUsageError(
            f"trainer_kwargs(num_nodes={num_nodes!r}): use a positive int (nodes in the job)."
        )
    precision_name = normalize_precision(precision)
    _require_visible(accelerator)
    plugin = _precision_plugin(strategy, precision_name, accelerator)

    chosen: Strategy
    if strategy == "single":
        if num_nodes != 1:
            raise SpriteUsageError(
                f"trainer_kwargs('single', num_nodes={num_nodes}): one device runs on one node; use 'ddp' or "
                f"'fsdp' for several nodes."
            )
        index = _single_device_index(devices, accelerator)
        chosen = SingleDeviceStrategy(device=torch.device(accelerator, index) if index is not None else "cpu")
        resolved: Devices = [index] if index is not None else 1
    else:
        chosen = XPUDDPStrategy() if strategy == "ddp" else FSDP2Strategy()
        resolved = _parallel_devices(devices, accelerator)
    return {
        "accelerator": accelerator,
        "strategy": chosen,
        "devices": resolved,
        "num_nodes": num_nodes,
        "plugins": [plugin],
    }


def _require_visible(accelerator: str) -> None:
    """Raise when ``accelerator`` is "xpu" or "cuda" and this torch sees no such device."""
    if accelerator == "xpu" and not XPUAccelerator.is_available():
        raise SpriteUsageError(
            f"trainer_kwargs(accelerator='xpu'): no XPU is visible (torch {torch.__version__}, "
            f"torch.xpu.is_available() is False). Use a torch build with XPU support (on Aurora: `module load "
            f"frameworks`), or accelerator='cpu' to run the same strategy on CPU with gloo."
        )
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise SpriteUsageError(
            f"trainer_kwargs(accelerator='cuda'): no CUDA GPU is visible (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); use accelerator='cpu' to run the same strategy on CPU."
        )


def _precision_plugin(strategy: str, name: str, accelerator: str) -> Precision:
    if name == "16-mixed" and strategy == "fsdp":
        raise SpriteUsageError(
            "trainer_kwargs('fsdp', precision='16-mixed'): FSDP2 with fp16 needs a gradient scaler whose "
            "inf checks agree across shards, which Lightning's ModelParallelStrategy does not provide; use "
            "precision='bf16-mixed' (the default)."
        )
    if name in ("bf16-mixed", "16-mixed"):
        return XPUMixedPrecision(name, device=accelerator)
    if name == "32-true":
        return Precision()
    return HalfPrecision(name)  # type: ignore[arg-type]


def _single_device_index(devices: Devices, accelerator: str) -> int | None:
    """The one device of a "single" run: None on CPU, else the pinned index (the current one for "auto" or 1)."""
    if accelerator == "cpu":
        if devices in ("auto", 1, "1"):
            return None
    elif devices in ("auto", 1, "1"):
        return int(torch.xpu.current_device() if accelerator == "xpu" else torch.cuda.current_device())
    elif (
        isinstance(devices, Sequence)
        and not isinstance(devices, str)
        and len(devices) == 1
        and isinstance(devices[0], int)
        and not isinstance(devices[0], bool)
    ):
        if accelerator == "xpu":
            return XPUAccelerator.parse_devices(list(devices))[0]
        count = torch.cuda.device_count()
        if not 0 <= devices[0] < count:
            raise SpriteUsageError(
                f"trainer_kwargs('single', devices={list(devices)!r}, accelerator='cuda'): this process sees "
                f"{count} GPU(s), indices 0..{count - 1}."
            )
        return devices[0]
    pin = " or [<index>] to pin one device" if accelerator != "cpu" else ""
    raise SpriteUsageError(
        f"trainer_kwargs('single', devices={devices!r}, accelerator={accelerator!r}): one device runs one "
        f"process; use devices='auto' or 1{pin}, or strategy 'ddp'/'fsdp' for several."
    )


def _parallel_devices(devices: Devices, accelerator: str) -> Devices:
    """Resolve "auto" to the launcher's processes per node, so one rank per process uses its own device."""
    if devices != "auto":
        return devices
    info = optional_rank_env()
    if info is not None and info.local_world_size is not None:
        return info.local_world_size
    if accelerator == "xpu":
        return XPUAccelerator.auto_device_count()
    return torch.cuda.device_count() if accelerator == "cuda" else 1
