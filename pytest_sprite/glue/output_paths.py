"""Where the session writes its files (``--sprite-report``, ``--sprite-plots``, ``--sprite-artifacts``), checked
before any test runs.

A path that cannot be written is found at the end of a session otherwise, after every test ran: the work
is lost to a traceback. Each check finds the nearest folder that exists on the way to the path and creates
(and removes) a probe file in it, so what is refused is what this process could not do, not a guess from
permission bits (root passes those everywhere, ``/proc`` refuses files whatever its bits say).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import SpriteUsageError

__all__ = ["check_output_dir", "check_output_file", "not_written"]


def check_output_file(path: str, option: str) -> None:
    """Refuse a file path whose folder cannot be made or written: ``option`` names it in the error."""
    _check_creatable(Path(path).absolute().parent, path, option)


def check_output_dir(path: str, option: str) -> None:
    """Refuse a folder path that names a file or under which nothing can be created."""
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise SpriteUsageError(
            f"{option}={path}: is a file, not a directory; pass a directory (it is made if missing)"
        )
    _check_creatable(target, path, option)


def not_written(what: str, path: str | os.PathLike[str], exc: BaseException) -> str:
    """The line that says a file of the session could not be written at its end, and why."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    named = getattr(exc, "filename", None)
    if named is not None and str(named) != str(path):
        why = f"{why}: {named}"
    return f"warning: {what} was not written to {path}: {why}"


def _check_creatable(folder: Path, path: str, option: str) -> None:
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SpriteUsageError(
            f"{option}={path}: {existing} is a file, not a directory, so nothing can be written under it; "
            "pass a path whose every folder is a directory"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".sprite-probe-", dir=existing)
    except OSError as exc:
        raise SpriteUsageError(
            f"{option}={path}: cannot create files in {existing} ({exc.strerror or exc}); pass a path in a "
            "directory this user can write"
        ) from None
    os.close(fd)
    os.unlink(probe)
