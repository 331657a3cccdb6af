"""The installed distribution's version, read from its metadata: ``pyproject.toml``'s ``version`` is the one place
it is written, and every line that prints it (pytest's header, the JSON report) reads it here."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from typing import Final

DISTRIBUTION: Final = "pytest-sprite"


def installed_version(distribution: str = DISTRIBUTION) -> str | None:
    """The version of ``distribution`` as installed (wheel, sdist or editable), or None when it is not installed
    (the package imported from a bare checkout on ``sys.path``)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    """Whether ``module`` can be imported here, found without importing it (a ``None`` in ``sys.modules``, an
    import blocked on purpose, counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
