"""The launcher registry: the one list of ``--launcher`` names and what implements each.

It is filled by the ``pytest_sprite_add_launchers`` hook once per session; the built-in launchers register
through that hook (below) exactly as a project's conftest or plugin does, so a new launcher is one module
that implements :class:`~pytest_sprite.launch.launchers.base.Launcher` plus one ``add`` call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Final

import pytest

from ...errors import LaunchError, SpriteUsageError
from .base import Launcher

__all__ = ["BUILTIN_LAUNCHERS", "LauncherRegistry", "collect_launchers", "get_launcher", "session_launchers"]

BUILTIN_LAUNCHERS: Final = {
    "local": "pytest_sprite.launch.launchers.local:LocalLauncher",
    "mpiexec": "pytest_sprite.launch.launchers.mpiexec:MpiexecLauncher",
    "pals": "pytest_sprite.launch.launchers.pals:PalsLauncher",
    "srun": "pytest_sprite.launch.launchers.srun:SrunLauncher",
    "torchrun": "pytest_sprite.launch.launchers.torchrun:TorchrunLauncher",
}
"""The launchers pytest-sprite ships, as ``module:Class`` (imported only when the session uses one)."""

LauncherFactory = Callable[[], Launcher]


class LauncherRegistry:
    """``--launcher`` name -> what makes a fresh launcher of that name, in the order they were added."""

    def __init__(self) -> None:
        self._factories: dict[str, LauncherFactory | str] = {}

    def add(self, name: str, launcher: LauncherFactory | str) -> None:
        """Register ``--launcher=name``: a launcher class (any callable returning a fresh launcher), or
        ``"module:Class"``, imported only when a session launches with it. A name added twice is an error."""
        if name in self._factories:
            raise SpriteUsageError(
                f"launcher {name!r} is registered twice (pytest_sprite_add_launchers); give the new one another name"
            )
        self._factories[name] = launcher

    @property
    def names(self) -> tuple[str, ...]:
        """Every registered ``--launcher`` value."""
        return tuple(self._factories)

    def create(self, name: str) -> Launcher:
        """A fresh launcher for ``--launcher=name``."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise LaunchError(
                f"--launcher={name!r} is not a known launcher; valid: {', '.join(self.names)}"
            ) from None
        if isinstance(factory, str):
            factory = _import_target(name, factory)
        launcher: Launcher = factory()
        return launcher


def _import_target(name: str, target: str) -> LauncherFactory:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LaunchError(f"--launcher={name} is not available in this installation: {exc}") from exc
    factory: LauncherFactory = getattr(module, attribute)
    return factory


@pytest.hookimpl(tryfirst=True)  # the built-ins first in every list
def pytest_sprite_add_launchers(launchers: LauncherRegistry) -> None:
    """The built-in launchers, registered like a project's."""
    for name, target in BUILTIN_LAUNCHERS.items():
        launchers.add(name, target)


_launchers_key: Final = pytest.StashKey[LauncherRegistry]()


def collect_launchers(config: pytest.Config) -> LauncherRegistry:
    """Ask every plugin for its launchers (``pytest_sprite_add_launchers``), once per session."""
    registry = LauncherRegistry()
    config.hook.pytest_sprite_add_launchers(launchers=registry)
    config.stash[_launchers_key] = registry
    return registry


def session_launchers(config: pytest.Config) -> LauncherRegistry:
    """The session's launcher registry (collected at configure)."""
    if _launchers_key not in config.stash:
        return collect_launchers(config)
    return config.stash[_launchers_key]


def get_launcher(config: pytest.Config, name: str) -> Launcher:
    """A fresh launcher for ``--launcher=name`` from the session's registry."""
    return session_launchers(config).create(name)
