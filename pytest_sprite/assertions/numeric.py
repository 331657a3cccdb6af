"""The number rules every assertion shares: relative errors, bit equality, update measures, JSON numbers.

One rule for values that are not finite, everywhere a figure measures how far apart two things are:

- equal values are 0 apart (``==``: an infinity equals itself, ``-0.0`` equals ``0.0``);
- otherwise a NaN or an infinity on either side, or a zero reference, gives ``inf``: such a figure is never
  within a limit, and a NaN never reaches a table as a small number (the lightning-sprite procedure's relative errors are finite
  by construction, and its checks fail what is not);
- an L2 measure is 0 when the difference is exactly 0, and ``inf`` when the difference is not finite or the
  base is 0.

Bit equality is the lightning-sprite procedure's "bit-identical": same dtype, same shape, same bytes (a NaN equals the same NaN,
``-0.0`` differs from ``0.0``). In JSON a non-finite float is written as its ``repr`` (``'inf'``, ``'nan'``).
Torch is imported only where tensors are compared.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_sprite.records import FP32_PRECISION, finite_or_repr

if TYPE_CHECKING:
    import torch

__all__ = [
    "FP32_PRECISION",
    "bit_equal",
    "finite_or_repr",
    "json_safe",
    "ratio",
    "rel",
    "rel_l2",
    "rel_l2_tensors",
    "same_float",
    "tensor_rel",
]


def rel(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` under the module's rule (0 when equal, else ``inf`` for a
    non-finite side or a zero reference)."""
    if value == reference:
        return 0.0
    if reference == 0 or not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    return abs(value - reference) / abs(reference)


def ratio(diff: float, base: float) -> float:
    """An L2 difference over its base: 0 for no difference, ``inf`` for a non-finite difference, a zero base
    or a NaN quotient."""
    if diff == 0:
        return 0.0
    if base == 0 or not math.isfinite(diff):
        return math.inf
    quotient = diff / base
    return math.inf if math.isnan(quotient) else quotient


def rel_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L2 difference of two vectors (``inf`` when their shapes differ)."""
    if value.shape != reference.shape:
        return math.inf
    return ratio(float((value - reference).norm()), float(reference.norm()))


def rel_l2_tensors(
    values: Mapping[str, torch.Tensor], references: Mapping[str, torch.Tensor], names: Sequence[str]
) -> float:
    """Relative L2 difference of several tensors taken together (per-tensor sums of squares, ``inf`` when a
    shape differs)."""
    diff_sq = 0.0
    base_sq = 0.0
    for k in names:
        a, b = values[k], references[k]
        if a.shape != b.shape:
            return math.inf
        diff_sq += float(((a - b) ** 2).sum())
        base_sq += float((b**2).sum())
    return ratio(math.sqrt(diff_sq), math.sqrt(base_sq))


def tensor_rel(value: torch.Tensor, reference: torch.Tensor, base: torch.Tensor) -> float:
    """L2 norm of ``value - reference`` over the L2 norm of ``base``, in float64."""
    diff = float((value.double() - reference.double()).norm())
    return ratio(diff, float(base.double().norm()))


def same_float(a: float, b: float) -> bool:
    """Bit for bit: the same IEEE double (so ``nan`` equals the same ``nan``, ``-0.0`` differs from ``0.0``)."""
    return struct.pack(">d", float(a)) == struct.pack(">d", float(b))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape and the same bytes."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float in it written by :func:`finite_or_repr` (tuples become lists)."""
    if isinstance(value, float):
        return finite_or_repr(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
