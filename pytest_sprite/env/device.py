"""Which device and process-group backend a rank uses: the one chooser for children, meshes and strategies.

Stdlib only at import (torch is imported inside the functions), so the plugin, the recipes and the
code under test (``pytest_sprite.lightning``) can all read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "DEVICE_CHOICES", "accelerator_type", "default_backend", "select_device"]

DEVICE_CHOICES: Final = ("auto", "cpu", "cuda", "xpu")
"""``--sprite-device`` values; ``auto`` is XPU if present, else CUDA, else CPU."""

BACKENDS: Final = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}
"""The process-group backend of each device type when every rank has a device of its own."""

_ACCELERATORS: Final = ("xpu", "cuda")
"""Accelerator types in the order the design prefers them."""


def _usable(kind: str) -> bool:
    import torch

    module = getattr(torch, kind, None)
    return module is not None and bool(module.is_available())


def accelerator_type() -> str:
    """``xpu`` when an XPU is usable, else ``cuda``, else ``cpu``: the order the design prescribes."""
    return next((kind for kind in _ACCELERATORS if _usable(kind)), "cpu")


def default_backend(device_type: str) -> str | None:
    """The backend for ``device_type`` (gloo, nccl, xccl), or None for a type without one."""
    return BACKENDS.get(device_type)


def select_device(
    preference: str, local_rank: int, local_size: int, *, bind: bool = True
) -> tuple[torch.device, str]:
    """The device and backend for a rank: XPU if present, else CUDA, else CPU.

    ``xpu:<local rank>`` with xccl, or ``cuda:<local rank>`` with nccl, when every local rank has its
    own device; ranks sharing fewer devices use gloo with device tensors; the CPU uses gloo.
    ``bind`` makes the device current (``set_device``).
    """
    import torch

    if preference not in DEVICE_CHOICES:
        raise ValueError(f"--sprite-device={preference!r}: valid values are {', '.join(DEVICE_CHOICES)}")
    for kind in _ACCELERATORS:
        if preference not in ("auto", kind):
            continue
        if not _usable(kind):
            if preference == kind:
                raise RuntimeError(
                    f"--sprite-device={kind} was asked for, but torch.{kind}.is_available() is False"
                )
            continue
        module = getattr(torch, kind)
        count = module.device_count()
        device = torch.device(kind, local_rank % count)
        if bind:
            module.set_device(device)
        return device, BACKENDS[kind] if count >= local_size else "gloo"
    return torch.device("cpu"), BACKENDS["cpu"]
