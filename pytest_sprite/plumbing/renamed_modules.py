"""Old module names kept importable after a rename, each with a DeprecationWarning naming the new one.

A project that imported ``pytest_sprite.chaos.protocols`` or ``pytest_sprite.faults`` from 0.2.0 keeps working for
one more minor release: the old name resolves to the very same module object (not a second copy, so a
registry filled through one name is the one read through the other). renamed-alias: the module rename tool
leaves this file alone.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["RENAMED", "alias_module"]

RENAMED = {
    "pytest_sprite.chaos": "pytest_sprite.save_crashes",
    "pytest_sprite.faults": "pytest_sprite.planted_faults",
}
"""Old name -> new name, for modules and packages renamed in 0.3.0 (the aliases go in 0.4.0)."""


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``old.sub`` to the already imported ``new.sub`` module object."""

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for old in RENAMED:
            if fullname.startswith(old + "."):
                return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        for old, new in RENAMED.items():
            if spec.name.startswith(old + "."):
                return importlib.import_module(new + spec.name[len(old) :])
        raise ImportError(spec.name)  # pragma: no cover - find_spec answered only for renamed names

    def exec_module(self, module: types.ModuleType) -> None:
        """The new module already ran: nothing to execute again."""


_FINDER = _AliasFinder()


def alias_module(old: str) -> types.ModuleType:
    """Warn that ``old`` is renamed and make ``old`` (and every ``old.sub``) the new module object."""
    new = RENAMED[old]
    warnings.warn(
        f"{old} is renamed {new}; import {new} instead ({old} goes in pytest-sprite 0.4.0)",
        DeprecationWarning,
        stacklevel=3,
    )
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
