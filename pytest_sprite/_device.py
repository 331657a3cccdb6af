"""Which device and process-group backend a rank uses; shared by test children and worlds of one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_CHOICES", "select_device"]

DEVICE_CHOICES: Final = ("auto", "cpu", "cuda", "xpu")


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
    for kind, backend in (("xpu", "xccl"), ("cuda", "nccl")):
        if preference not in ("auto", kind):
            continue
        module = getattr(torch, kind, None)
        if module is None or not module.is_available():
            if preference == kind:
                raise RuntimeError(
                    f"--sprite-device={kind} was asked for, but torch.{kind}.is_available() is False"
                )
            continue
        count = module.device_count()
        device = torch.device(kind, local_rank % count)
        if bind:
            module.set_device(device)
        return device, backend if count >= local_size else "gloo"
    return torch.device("cpu"), "gloo"
