"""What every record shares: the recipe identity two arms must agree on, tensor digests, precisions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BF16_PRECISION", "FP32_PRECISION", "RecipeIdentity", "tensor_digest"]

FP32_PRECISION = "32-true"
"""Lightning's FP32 precision flag: FP32 parity and the BF16 run's ref32 (TF32 disabled)."""
BF16_PRECISION = "bf16-mixed"
"""Precision of every BF16 arm but ref32."""


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes: equal digests mean bit-identical tensors."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class RecipeIdentity:
    """Everything two arms must share for a comparison between them to mean anything.

    Two records whose identities differ are refused by the assertions instead of compared.
    """

    model: str
    """Which backbone: ``tiny-qwen2:<config digest>`` or ``<path>:<config digest>`` for real weights."""
    seed: int
    """Seed of the initial weights (lora_B always uses its own seed 1) and of the rows."""
    rows: int
    """Rows in the whole run: steps x global batch."""
    rows_digest: str
    """SHA-256 of every row's tokens and label, so that same-sized but different data is told apart."""
    seq_len: int
    """Tokens per row."""
    steps: int
    """Optimizer steps."""
    global_batch: int
    """Rows per optimizer step, summed over ranks and micro-batches."""
    lr: float
    """SGD learning rate."""
    clip: float
    """Global gradient-norm clip."""

    def differences(self, other: RecipeIdentity) -> list[str]:
        """Human-readable ``field: mine != theirs`` lines, empty when the identities agree."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
