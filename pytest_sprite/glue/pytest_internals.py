"""Every reach into pytest's private state, in one file: the one to check when pytest releases.

Each function says which private name it touches and why no public API serves. Imported by the
controller (``teardown_controller_state``, ``tmp_path_factory``) and by test children (the others).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest

# A merged report renders itself the way pytest's own reports do: ``TerminalRepr`` (the base of every
# longrepr), ``ReprFileLocation`` (the short-summary line) and ``TerminalWriter`` (what ``toterminal``
# receives) have no public name in pytest 8.0 - 9.2; pytest-xdist imports them from the same places.
from _pytest._code.code import ReprFileLocation, TerminalRepr
from _pytest._io import TerminalWriter

__all__ = [
    "ReprFileLocation",
    "TerminalRepr",
    "TerminalWriter",
    "adopt_basetemp",
    "capture_tmpfiles",
    "fresh_session_state",
    "function_scoped_arguments",
    "record_warnings",
    "runtestprotocol",
    "skip_at_item",
    "stdin_is_terminal",
    "teardown_controller_state",
    "tmp_path_factory",
    "uncaptured_terminal",
]


def _all_fixturedefs(items: Sequence[pytest.Item]) -> list[Any]:
    """Every fixture definition the session knows.

    ``session._fixturemanager`` is private and its registry changed shape: ``_get_all_fixture_defs()``
    from pytest 9.2, ``_arg2fixturedefs`` in 8.0 - 9.1. Falls back to the items' own closures
    (``item._fixtureinfo``), which cover every fixture they request by name.
    """
    manager = items[0].session._fixturemanager
    if hasattr(manager, "_get_all_fixture_defs"):  # pytest >= 9.2
        return list(manager._get_all_fixture_defs())
    if hasattr(manager, "_arg2fixturedefs"):  # pytest 8.0 - 9.1
        return [fd for defs in manager._arg2fixturedefs.values() for fd in defs]
    infos = [info for item in items if (info := getattr(item, "_fixtureinfo", None)) is not None]
    return list(
        {id(fd): fd for info in infos for defs in info.name2fixturedefs.values() for fd in defs}.values()
    )


def fresh_session_state(items: Sequence[pytest.Item]) -> None:
    """Forget the fixtures and setup state an agent inherited through fork: every test child sets up its own.

    Called once in the agent, before it forks test children: the agent runs no test, so each child
    inherits the state this leaves (done in each child, it cost a child a third of a millisecond and
    copied about eighty pages). The agent forked from a process whose pytest had already set
    up fixtures (the controller's session-scoped ones, for the local launcher). pytest has no public
    "forget" API, so: ``session._setupstate`` is replaced with a fresh ``_pytest.runner.SetupState``
    (its stack holds the parent's nodes), and each FixtureDef's ``cached_result`` (the parent's value)
    and ``_finalizers`` (the parent's teardowns) are cleared. No debugger prompt in a rank without a
    terminal: the ``pdbinvoke`` / ``pdbtrace`` plugins (public plugin names) are unregistered.
    """
    from _pytest.runner import SetupState

    if not items:
        return
    items[0].session._setupstate = SetupState()
    for fixturedef in _all_fixturedefs(items):
        fixturedef.cached_result = None
        finalizers = getattr(fixturedef, "_finalizers", None)
        if finalizers is not None:
            finalizers.clear()
    manager = items[0].config.pluginmanager
    for name in ("pdbinvoke", "pdbtrace"):
        plugin = manager.get_plugin(name)
        if plugin is not None:
            manager.unregister(plugin)


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


def tmp_path_factory(config: pytest.Config) -> Any:
    """The session's ``TempPathFactory``: ``config._tmp_path_factory``, set by pytest's tmpdir plugin.

    Outside a fixture pytest offers no public way to reach it; the controller makes the session's
    basetemp and each ranks test's directory with it.
    """
    return config._tmp_path_factory  # type: ignore[attr-defined]


def adopt_basetemp(config: pytest.Config, basetemp: Path) -> Any:
    """Make a test child's ``TempPathFactory`` use the controller's ``basetemp`` and never delete.

    ``TempPathFactory._basetemp`` and ``_retention_policy`` are private; the public constructor takes
    a ``given_basetemp`` that ``getbasetemp()`` would wipe, which must not happen to a directory every
    rank shares. Retention "all" here: the controller prunes once every rank has ended.
    """
    factory = tmp_path_factory(config)
    factory._basetemp = basetemp
    factory._retention_policy = "all"
    return factory


def record_warnings(item: pytest.Item) -> Any:
    """A context manager recording ``item``'s warnings with the session's filters, as pytest does.

    pytest records a test's warnings in its own ``pytest_runtest_protocol`` (``_pytest.warnings.
    catch_warnings_for_item``), which a test child does not run: it calls ``runtestprotocol`` itself.
    Each warning reaches ``pytest_warning_recorded``, where the child sends it to the controller.
    """
    from _pytest.warnings import catch_warnings_for_item

    return catch_warnings_for_item(item.config, ihook=item.ihook, when="runtest", item=item)


def function_scoped_arguments(item: pytest.Item) -> set[str]:
    """The test function's arguments that are function-scoped fixtures (what hypothesis warns about).

    ``item._fixtureinfo.name2fixturedefs`` is private; it is where hypothesis' own pytest plugin looks.
    Called only for a hypothesis test. When the signature cannot be read (``inspect.signature``
    raises ``ValueError: invalid method signature`` on a ``functools.wraps`` of a bound method, as torch's
    ``MultiProcessTestCase.join_or_run`` makes), the names pytest itself read from the function at
    collection (``_fixtureinfo.argnames``) stand in for it.
    """
    import inspect

    function = getattr(item, "function", None)
    info = getattr(item, "_fixtureinfo", None)
    if function is None or info is None:
        return set()
    try:
        names = set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        names = set(info.argnames)
    return {
        name
        for name, defs in info.name2fixturedefs.items()
        if name in names and defs and defs[-1].scope == "function"
    }


def skip_at_item(reason: str) -> NoReturn:
    """Skip the running test, reported at the test's own location (as pytest's unittest support does).

    ``pytest.skip`` reports where it was called; ``skip.Exception(..., _use_item_location=True)`` (a private
    keyword, pytest 7.0 - 9.2) is what ``_pytest.unittest`` raises for a unittest skip, so a torch test's
    skip on ranks reads as it does natively.
    """
    raise pytest.skip.Exception(reason, _use_item_location=True)


def runtestprotocol(item: pytest.Item) -> None:
    """Run ``item``'s setup, call and teardown in a test child, reports sent by the child's hooks.

    ``_pytest.runner.runtestprotocol`` is private (pytest 8.0 - 9.2); pytest-xdist's workers call it the
    same way, because ``pytest_runtest_protocol`` would also log the reports in the child.
    """
    from _pytest.runner import runtestprotocol as run

    run(item, log=False, nextitem=None)


def _captured_stdin(config: pytest.Config) -> Any:
    """pytest's capture of stdin (``capturemanager._global_capturing.in_``), or None.

    ``MultiCapture`` and its ``in_`` (an ``FDCapture`` or ``SysCapture``) are private: no public API says where
    the user's stdin went, nor suspends its capture alone.
    """
    capman = config.pluginmanager.get_plugin("capturemanager")
    return getattr(getattr(capman, "_global_capturing", None), "in_", None)


def stdin_is_terminal(config: pytest.Config) -> bool:
    """Whether the user's pytest process reads a terminal (stdin, under pytest's capture).

    With ``--capture=fd`` (the default) pytest has put /dev/null on descriptor 0 and keeps the user's own
    stdin on the capture's ``targetfd_save`` (private, see :func:`_captured_stdin`).
    """
    fd = getattr(_captured_stdin(config), "targetfd_save", 0)
    try:
        return os.isatty(fd)
    except OSError:
        return False


@contextlib.contextmanager
def uncaptured_terminal(config: pytest.Config) -> Iterator[None]:
    """The user's terminal, stdin included, while a debugger on a rank has it; as pytest's own pdb has it.

    ``CaptureManager.global_and_fixture_disabled`` (public) leaves stdin captured: its capture is
    suspended here (private, see :func:`_captured_stdin`) and resumed after when it was running.
    """
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is None:
        yield
        return
    with capman.global_and_fixture_disabled():
        stdin = _captured_stdin(config)
        running = stdin is not None and getattr(stdin, "_state", "") == "started"
        if running:
            stdin.suspend()
        try:
            yield
        finally:
            if running:
                stdin.resume()
