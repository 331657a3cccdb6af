"""Launcher registry: ``--launcher`` names and the module that implements each."""

from __future__ import annotations

import importlib
from typing import Final

from ...errors import LaunchError
from ...glue.options import LAUNCHER_NAMES
from .base import Launcher

__all__ = ["LAUNCHER_NAMES", "get_launcher"]

_REGISTRY: Final = {
    "local": "pytest_sprite.launch.launchers.local:LocalLauncher",
    "mpiexec": "pytest_sprite.launch.launchers.mpiexec:MpiexecLauncher",
    "pals": "pytest_sprite.launch.launchers.pals:PalsLauncher",
    "srun": "pytest_sprite.launch.launchers.srun:SrunLauncher",
    "torchrun": "pytest_sprite.launch.launchers.torchrun:TorchrunLauncher",
}

"""Each of ``_settings.LAUNCHER_NAMES`` (which the settings validate) and the class that implements it."""


def get_launcher(name: str) -> Launcher:
    """A fresh launcher for ``--launcher=name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise LaunchError(
            f"--launcher={name!r} is not a known launcher; valid: {', '.join(LAUNCHER_NAMES)}"
        ) from None
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LaunchError(f"--launcher={name} is not available in this installation: {exc}") from exc
    launcher: Launcher = getattr(module, cls_name)()
    return launcher
