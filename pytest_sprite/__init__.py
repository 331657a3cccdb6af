"""pytest-sprite: distributed-training correctness as ordinary pytest tests.

The public API is loaded lazily: importing ``pytest_sprite`` imports neither torch nor the plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "LaunchError",
    "RankEnvError",
    "SpriteError",
    "SpriteUsageError",
    "World",
    "collected",
]

_LAZY = {
    "LaunchError": "pytest_sprite.errors",
    "RankEnvError": "pytest_sprite.errors",
    "SpriteError": "pytest_sprite.errors",
    "SpriteUsageError": "pytest_sprite.errors",
    "World": "pytest_sprite.world",
    "collected": "pytest_sprite._collected",
}

if TYPE_CHECKING:
    from ._collected import collected
    from .errors import LaunchError, RankEnvError, SpriteError, SpriteUsageError
    from .world import World


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_sprite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
