"""``tmp_path`` in a ranks test: one directory per test, the same path on every rank.

Each agent used to make its own basetemp, so the ranks of one test saw different ``tmp_path``
directories, the agents' basetemps piled up unpruned and ``pytest-current`` pointed at a rank's.
Now the controller's own ``TempPathFactory`` makes the session's one basetemp (so pytest numbers,
links and prunes it as for any session) and, before a ranks test starts, the test's directory in it,
named as pytest names ``tmp_path``. The test children use that basetemp instead of making one:

- ``tmp_path`` is the test's directory, on every rank;
- ``tmp_path_factory.mktemp(name)`` gives ``<basetemp>/<test dir>-<name>N``, numbered per test and
  call, so every rank that calls it in the same order gets the same path;
- a child never deletes what other ranks may still use: the controller applies
  ``tmp_path_retention_policy`` once every rank has ended.

On a cluster the basetemp must be on a filesystem every node sees: ``--basetemp=DIR``.
Imports only the standard library and pytest; both sides of the process boundary use it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ..errors import SpriteUsageError
from .pytest_internals import adopt_basetemp, tmp_path_factory

if TYPE_CHECKING:
    import pytest

__all__ = [
    "TMP_FIXTURES",
    "make_test_dir",
    "prune_test_dir",
    "share_tmp_path",
    "shared_test_dir",
    "tmp_path_name",
]

_NAME_CHARS: Final = 30
"""pytest's own limit on a ``tmp_path`` directory name (``_pytest.tmpdir._mk_tmp``)."""
_NOT_A_WORD_CHAR: Final = re.compile(r"[\W]")
"""Compiled at import, so every forked test child inherits it instead of compiling it again."""


def tmp_path_name(item_name: str) -> str:
    """The prefix pytest gives the ``tmp_path`` of a test called ``item_name``."""
    return _NOT_A_WORD_CHAR.sub("_", item_name)[:_NAME_CHARS]


TMP_FIXTURES: Final = frozenset({"tmp_path", "tmpdir", "tmp_path_factory", "tmpdir_factory"})
"""pytest's fixtures that hand a test its directory: a ranks test that uses one gets it made up front."""


def make_test_dir(config: pytest.Config, item_name: str, *, now: bool, run_id: int) -> tuple[Path, Path]:
    """Controller: the session's basetemp (made on first use) and the directory of one ranks test.

    ``now``: made here, named as pytest names ``tmp_path`` (the test uses one of :data:`TMP_FIXTURES`).
    Otherwise only named, ``<name>-run<run_id>``, and made by the first rank that needs it
    (``world.rank_path``, a fixture asked for at run time): most ranks tests never use one, and making
    and pruning it cost the controller milliseconds per test. The ``-`` keeps the name out
    of pytest's numbering (its names hold only word characters and digits).
    """
    factory = tmp_path_factory(config)
    basetemp = factory.getbasetemp()
    if now:
        return basetemp, factory.mktemp(tmp_path_name(item_name), numbered=True)
    return basetemp, basetemp / f"{tmp_path_name(item_name)}-run{run_id}"


def prune_test_dir(config: pytest.Config, test_dir: Path, *, passed: bool) -> None:
    """Controller, after every rank has ended: apply ``tmp_path_retention_policy`` to the test's files."""
    policy = config.getini("tmp_path_retention_policy")
    if policy == "none" or (policy == "failed" and passed):
        for path in [test_dir, *test_dir.parent.glob(f"{test_dir.name}-*")]:
            shutil.rmtree(path, ignore_errors=True)
        return
    try:  # a test that never used it leaves no empty directory behind, as with pytest's lazy tmp_path
        test_dir.rmdir()
    except OSError:
        pass


def share_tmp_path(config: pytest.Config, *, basetemp: Path, test_dir: Path, item_name: str) -> None:
    """Test child: make ``tmp_path`` and ``tmp_path_factory`` give every rank the same directories.

    Called before the test's fixtures run; the child's factory never makes a basetemp of its own.
    """
    factory = adopt_basetemp(config, basetemp)  # and never delete: the controller prunes once all ranks ended
    first = tmp_path_name(item_name)
    counts: dict[str, int] = {}

    def mktemp(basename: str, numbered: bool = True) -> Path:
        relative = os.path.normpath(basename)
        if os.path.isabs(relative) or relative.startswith(os.pardir) or os.sep in relative:
            raise ValueError(f"{basename} is not a normalized and relative path")
        if numbered and basename == first and first not in counts:
            counts[first] = 0
            path = test_dir
        elif numbered:
            k = counts[f"-{basename}"] = counts.get(f"-{basename}", -1) + 1
            path = basetemp / f"{test_dir.name}-{basename}{k}"
        else:
            path = basetemp / f"{test_dir.name}-{basename}"
        shared_test_dir(basetemp, test_dir)
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    factory.mktemp = mktemp


def shared_test_dir(basetemp: Path, test_dir: Path) -> Path:
    """``test_dir``, made if no rank made it yet, or a clear error when this rank's host does not see the
    controller's basetemp."""
    try:
        test_dir.mkdir(mode=0o700, exist_ok=True)
        return test_dir
    except FileNotFoundError:
        pass
    if not basetemp.is_dir():
        raise SpriteUsageError(
            f"the session's basetemp {basetemp} does not exist on this rank's host ({os.uname().nodename}): "
            "the ranks of a test share tmp_path, so on a cluster the basetemp must be on a filesystem "
            "every node sees: pass --basetemp=DIR with DIR on it (e.g. --basetemp=$PWD/.sprite-tmp)"
        )
    return test_dir
