"""Lightning strategies for XPU and CPU: DDP without CUDA calls, FSDP2 data parallelism."""

from __future__ import annotations

from pytest_sprite.lightning.strategies.ddp import XPUDDPStrategy
from pytest_sprite.lightning.strategies.fsdp2 import FSDP2Strategy

__all__ = ["FSDP2Strategy", "XPUDDPStrategy"]
