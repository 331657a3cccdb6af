"""Pickles that carry plain CPU tensors as their bytes: records kept in the session store and shared by rank 0.

torch pickles a tensor's storage in ``torch.save``'s legacy format, and reading it back runs one nested
``torch.load`` per storage. A criterion v2 arm record holds about 200 small tensors: reading one back took
0.02 s on a quiet core and 0.1-0.2 s in a test's rank on a loaded one, most of a reused arm's cost. Here a plain
CPU tensor is written as its dtype, shape and bytes and rebuilt with ``torch.frombuffer``: the same dtype, shape
and values bit for bit (a view comes back as a contiguous tensor of its own), read about ten times faster.
Anything else (another device, a subclass such as DTensor or ``Parameter``, a tensor that requires grad or
carries attributes, sparse, quantized, conjugate or negative views) is pickled as torch pickles it. :func:`pickle.loads` reads both.

Importing this module imports no torch.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["dumps", "rebuild_tensor"]


def dumps(obj: Any) -> bytes:
    """``obj`` pickled, its plain CPU tensors as their bytes (read back with :func:`pickle.loads`)."""
    out = io.BytesIO()
    _TensorBytesPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def rebuild_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor :func:`dumps` wrote as ``data`` (its bytes in row-major order), ``dtype`` and ``shape``."""
    import torch

    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


class _TensorBytesPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        """A plain CPU tensor as :func:`rebuild_tensor` and its bytes; anything else as pickle would."""
        import sys

        torch = sys.modules.get("torch")  # no torch imported: no tensor to write
        if torch is None or type(obj) is not torch.Tensor or not _plain(obj):
            return NotImplemented
        flat = obj.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return rebuild_tensor, (data, obj.dtype, tuple(obj.shape))


def _plain(tensor: torch.Tensor) -> bool:
    import torch

    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.__dict__  # attributes set on it travel with torch's own pickle
    )
