"""Lightning accelerator for Intel Data Center GPU Max tiles (``torch.xpu``).

Lightning 2.6 registers cpu, cuda, mps and tpu only (Lightning #20938). This accelerator is registered as
``"xpu"`` when :mod:`pytest_sprite.lightning` is imported. Each rank computes on ``xpu:<local rank>``; on
Aurora every rank must see all 12 tiles of its node (``ZE_FLAT_DEVICE_HIERARCHY=FLAT``, no per-rank
``ZE_AFFINITY_MASK``), so a rank that cannot see its tile raises instead of silently sharing tile 0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry

from pytest_sprite.errors import SpriteUsageError

__all__ = ["XPUAccelerator"]

_VISIBILITY_VARS = ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY")


def _xpu_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def _xpu_count() -> int:
    return int(torch.xpu.device_count()) if _xpu_available() else 0


def _visibility_note() -> str:
    """The variables that decide which tiles a process sees, as set now (for error messages)."""
    shown = ", ".join(f"{name}={os.environ[name]!r}" for name in _VISIBILITY_VARS if name in os.environ)
    return f" ({shown})" if shown else " (ZE_AFFINITY_MASK is unset)"


class XPUAccelerator(Accelerator):
    """Accelerator for Intel XPU tiles: device parsing, ``xpu:<local rank>`` selection, memory stats."""

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current XPU; raise if the process cannot see that tile."""
        if device.type != "xpu":
            raise SpriteUsageError(
                f"XPUAccelerator was given device {str(device)!r}; it runs on 'xpu:<index>' devices only. "
                f"Use accelerator='cpu' (or trainer_kwargs(..., accelerator='cpu')) for CPU runs."
            )
        index = device.index if device.index is not None else int(torch.xpu.current_device())
        count = _xpu_count()
        if index >= count:
            raise RuntimeError(
                f"this process should compute on xpu:{index} (its local rank selects the tile), but it sees "
                f"only {count} XPU device(s){_visibility_note()}. Each rank must see every tile of its node: "
                f"do not give ranks their own ZE_AFFINITY_MASK, export ZE_FLAT_DEVICE_HIERARCHY=FLAT (12 "
                f"devices per Aurora node) and launch one rank per tile (mpiexec --ppn 12)."
            )
        torch.xpu.set_device(index)

    def teardown(self) -> None:
        """Release cached blocks so a later test or fit in this process starts from an empty allocator."""
        if _xpu_available():
            torch.xpu.empty_cache()

    @staticmethod
    def parse_devices(devices: int | str | Sequence[int]) -> list[int]:
        """Turn the Trainer's ``devices`` into tile indices: N → [0..N-1], -1 → all, "0,3" or [0, 3] → those."""
        count = _xpu_count()
        indices = _parse_indices(devices, count)
        missing = [i for i in indices if i >= count]
        if missing:
            raise SpriteUsageError(
                f"devices={devices!r} asks for XPU tile(s) {missing}, but this process sees {count} XPU "
                f"device(s) (indices 0..{count - 1}){_visibility_note()}. Ask for at most {count} devices, or "
                f"make all tiles visible: no per-rank ZE_AFFINITY_MASK, ZE_FLAT_DEVICE_HIERARCHY=FLAT."
            )
        return indices

    @staticmethod
    def get_parallel_devices(devices: Sequence[int]) -> list[torch.device]:
        """One ``xpu:<i>`` device per parsed index; rank ``r`` of a node computes on the ``r``-th."""
        return [torch.device("xpu", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        """All visible tiles (12 per Aurora node with ZE_FLAT_DEVICE_HIERARCHY=FLAT)."""
        return _xpu_count()

    @staticmethod
    def is_available() -> bool:
        """True when this torch build has XPU support and sees at least one device."""
        return _xpu_available() and _xpu_count() > 0

    @staticmethod
    def name() -> str:
        return "xpu"

    def get_device_stats(self, device: torch.device | str | int) -> dict[str, Any]:
        """``torch.xpu.memory_stats`` for ``device`` (what Lightning's DeviceStatsMonitor logs); {} if absent."""
        memory_stats = getattr(torch.xpu, "memory_stats", None)
        if memory_stats is None:
            return {}
        return dict(memory_stats(device))

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


def _parse_indices(devices: int | str | Sequence[int], count: int) -> list[int]:
    """Lightning's GPU ``devices`` grammar, with errors that show what was given."""
    allowed = "a positive int, -1 (all tiles), 'auto', a string like '0,3', or a list of tile indices"
    value: Any = devices
    if isinstance(value, str):
        text = value.strip()
        if text == "auto" or text == "-1":
            value = -1
        elif "," in text:
            value = [int(part) for part in text.split(",") if part.strip()] if _is_index_list(text) else None
        elif text.isdigit():
            value = int(text)
        else:
            value = None
    if isinstance(value, bool) or value is None:
        raise SpriteUsageError(f"devices={devices!r} is not valid for XPUAccelerator; use {allowed}.")
    if isinstance(value, int):
        if value == -1:
            return list(range(count))
        if value < 1:
            raise SpriteUsageError(f"devices={devices!r} is not valid for XPUAccelerator; use {allowed}.")
        return list(range(value))
    indices = list(value)
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices):
        raise SpriteUsageError(f"devices={devices!r} is not valid for XPUAccelerator; use {allowed}.")
    if len(set(indices)) != len(indices):
        raise SpriteUsageError(f"devices={devices!r} names a tile twice; each tile can serve one rank.")
    return indices


def _is_index_list(text: str) -> bool:
    parts = [part.strip() for part in text.split(",")]
    return all(part.isdigit() for part in parts if part) and any(parts)


def _register() -> None:
    """Register ``"xpu"`` with Lightning's accelerator registry (idempotent; done on package import)."""
    if XPUAccelerator.name() not in AcceleratorRegistry:
        XPUAccelerator.register_accelerators(AcceleratorRegistry)
