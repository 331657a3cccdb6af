"""Mixed precision that autocasts on the device the model really runs on.

Lightning 2.6 picks the autocast device from the accelerator *flag*: "cpu" and "mps" are kept, anything else
becomes "cuda" (``accelerator_connector.py:489``, Lightning #21982). With a custom XPU accelerator (and with
``ModelParallelStrategy``) bf16-mixed therefore autocasts for CUDA, torch only warns, and the model trains in
fp32. :class:`XPUMixedPrecision` is told its device type, so bf16-mixed is bf16 on XPU and on CPU alike.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from pytest_sprite.errors import SpriteUsageError

__all__ = ["XPUMixedPrecision"]

MixedPrecisionName = Literal["bf16-mixed", "16-mixed"]

_ALIASES: dict[Any, str] = {
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "16-mixed",
    "32-true": "32-true",
    "bf16-true": "bf16-true",
    "16-true": "16-true",
    # Lightning's legacy spellings (lightning/fabric/connector.py `_convert_precision_to_unified_args`)
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "32": "32-true",
    32: "32-true",
}

SUPPORTED_PRECISIONS = ("bf16-mixed", "16-mixed", "32-true", "bf16-true", "16-true")
"""Precisions :func:`trainer_kwargs` accepts, after resolving Lightning's legacy aliases."""

_MIXED: tuple[MixedPrecisionName, ...] = ("bf16-mixed", "16-mixed")


def normalize_precision(precision: str | int) -> str:
    """Resolve Lightning's aliases ("bf16", "16", 16, 32) to the unified names; raise on anything else."""
    key = precision.strip().lower() if isinstance(precision, str) else precision
    if isinstance(key, bool) or key not in _ALIASES:
        aliases = ", ".join(repr(k) for k in _ALIASES if _ALIASES[k] != k)
        raise SpriteUsageError(
            f"precision={precision!r} is not supported; use one of {', '.join(SUPPORTED_PRECISIONS)} "
            f"(Lightning's aliases {aliases} are accepted too)."
        )
    return _ALIASES[key]


def _device_type(device: str | torch.device) -> str:
    """'xpu:3' and torch.device('xpu', 3) both autocast as 'xpu': autocast takes a device type, not an index."""
    if isinstance(device, torch.device):
        return device.type
    text = str(device).strip()
    try:
        return torch.device(text).type
    except RuntimeError as exc:
        raise SpriteUsageError(
            f"device={device!r} is not a torch device type; use 'xpu', 'cpu' or 'cuda' (the accelerator's "
            f"device type)."
        ) from exc


class XPUMixedPrecision(MixedPrecision):
    """Autocast ("bf16-mixed" by default, or "16-mixed") on ``device``'s real type, and backward outside it.

    Also accepts Lightning's legacy aliases "bf16", "16" and 16. Backward always runs with autocast
    disabled: in Lightning 2.6 the autocast context spans the whole ``training_step``
    (``strategy.py:388``), so a ``manual_backward`` there would otherwise run under autocast while automatic
    optimization's backward does not, and the two would compute different gradients.
    """

    def __init__(
        self,
        precision: str | int = "bf16-mixed",
        device: str | torch.device = "xpu",
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        name = normalize_precision(precision)
        if name not in _MIXED:
            raise SpriteUsageError(
                f"XPUMixedPrecision(precision={precision!r}) resolves to {name!r}, which is not mixed "
                f"precision; use 'bf16-mixed' or '16-mixed' (or their aliases 'bf16', '16', 16). "
                f"'32-true' and 'bf16-true' need no autocast: pass them to trainer_kwargs(precision=...)."
            )
        super().__init__(name, device=_device_type(device), scaler=scaler)

    def backward(
        self,
        tensor: torch.Tensor,
        model: Any,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Run backward with autocast off, so manual and automatic optimization compute the same gradients."""
        with torch.autocast(self.device, enabled=False):
            super().backward(tensor, model, optimizer, *args, **kwargs)
