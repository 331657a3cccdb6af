"""Every reach into pytest's private state, in one file: the one to check when pytest releases.

Each function says which private name it touches and why no public API serves. Imported by the
controller (``teardown_controller_state``) and by test children (the others).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

__all__ = ["capture_tmpfiles", "fresh_child_state", "teardown_controller_state"]


def _all_fixturedefs(item: pytest.Item) -> list[Any]:
    """Every fixture definition the session knows.

    ``session._fixturemanager`` is private and its registry changed shape: ``_get_all_fixture_defs()``
    from pytest 9.2, ``_arg2fixturedefs`` in 8.0 - 9.1. Falls back to the item's own closure
    (``item._fixtureinfo``), which covers every fixture it requests by name.
    """
    manager = item.session._fixturemanager
    if hasattr(manager, "_get_all_fixture_defs"):  # pytest >= 9.2
        return list(manager._get_all_fixture_defs())
    if hasattr(manager, "_arg2fixturedefs"):  # pytest 8.0 - 9.1
        return [fd for defs in manager._arg2fixturedefs.values() for fd in defs]
    info = getattr(item, "_fixtureinfo", None)
    return [fd for defs in info.name2fixturedefs.values() for fd in defs] if info is not None else []


def fresh_child_state(item: pytest.Item) -> None:
    """Forget the fixtures and setup state a test child inherited through fork: every child sets up its own.

    The agent forked from a process whose pytest had already set up fixtures (the controller's
    session-scoped ones, for the local launcher). pytest has no public "forget" API, so:
    ``session._setupstate`` is replaced with a fresh ``_pytest.runner.SetupState`` (its stack holds the
    parent's nodes), and each FixtureDef's ``cached_result`` (the parent's value) and ``_finalizers``
    (the parent's teardowns) are cleared. No debugger prompt in a rank without a terminal: the
    ``pdbinvoke`` / ``pdbtrace`` plugins (public plugin names) are unregistered.
    """
    from _pytest.runner import SetupState

    session = item.session
    session._setupstate = SetupState()
    for fixturedef in _all_fixturedefs(item):
        fixturedef.cached_result = None
        finalizers = getattr(fixturedef, "_finalizers", None)
        if finalizers is not None:
            finalizers.clear()
    for name in ("pdbinvoke", "pdbtrace"):
        plugin = item.config.pluginmanager.get_plugin(name)
        if plugin is not None:
            item.config.pluginmanager.unregister(plugin)


def capture_tmpfiles(config: pytest.Config, run_dir: Path) -> None:
    """Point pytest's fd capture at ``run_dir/capture-{out,err}.log``, so a crash's captured output can be read back.

    The capture manager's ``_global_capturing`` (a ``MultiCapture``) and its ``FDCapture.tmpfile`` are
    private; pytest offers no way to name the capture files. The new file is dup'd onto the capture's
    own descriptor, so every holder of that file object (a logging handler made at collection time
    holds ``sys.stderr`` as it was then) keeps writing to a valid file. pytest snapshots and truncates
    it per phase; after a crash it holds the running phase's output. Other capture modes keep pytest's
    own temporary files.
    """
    from _pytest.capture import FDCapture

    capman = config.pluginmanager.get_plugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)
    for attr, name in (("out", "capture-out.log"), ("err", "capture-err.log")):
        cap = getattr(capturing, attr, None)
        if not isinstance(cap, FDCapture):
            continue
        fd = os.open(run_dir / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, cap.tmpfile.fileno())
        os.close(fd)


def teardown_controller_state(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tear down the controller's own fixtures that ``nextitem`` does not share.

    A ranks test runs in its children, never in the controller, but pytest's setup state here still
    holds the module of an earlier in-process test; without this, the next module's first in-process
    test finds it "not torn down properly". ``session._setupstate.teardown_exact`` is what pytest's
    own ``runtestprotocol`` calls after an item; the controller replaces that protocol for ranks tests.
    """
    if item.session.shouldfail or item.session.shouldstop:
        nextitem = None
    item.session._setupstate.teardown_exact(nextitem)
