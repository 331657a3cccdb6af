"""pytest-timeout on ranks tests: its timeout becomes the test's rank timeout.

pytest-timeout ends a test from inside the test's process, by a signal or by a thread that exits the
process. A ranks test's body runs in other processes: in the controller such a timer would interrupt the
event loop or end the whole session, and in a rank it would end that rank alone, without the other
ranks' stacks. So for a ranks test this module reads pytest-timeout's timeout (its marker, ``--timeout``,
``PYTEST_TIMEOUT``, the ``timeout`` ini key) as the test's rank timeout, which ends every rank with its
stacks and the roll call, and keeps pytest-timeout's own timer off through pytest-timeout's hooks.

Which timeout a ranks test gets, the most specific first: ``@pytest.mark.ranks(timeout=...)``;
``@pytest.mark.timeout(...)``; ``--rank-timeout`` (or its ini key or environment variable) when given;
pytest-timeout's session timeout; ``--rank-timeout``'s default. A timeout of 0 (pytest-timeout's "none")
leaves the rank timeout in force: a ranks test always has one, since a hung collective never returns. A
test with both markers' timeouts is refused at collection: one of them would be ignored.
"""

from __future__ import annotations

import os
from typing import Any, Final

import pytest

from .markers import item_ranks_spec

__all__ = ["PYTEST_TIMEOUT_PLUGIN", "TimeoutBridge", "pytest_timeout_of", "register_timeout_bridge"]

PYTEST_TIMEOUT_PLUGIN: Final = "timeout"
"""pytest-timeout's plugin name (its entry point); absent: nothing here applies."""


def _seconds(value: object) -> float | None:
    """pytest-timeout's value as seconds; None for its "no timeout" (unset, 0 or negative)."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # pytest-timeout reports its own bad values
    return seconds if seconds > 0 else None


def _marker_timeout(item: pytest.Item) -> float | None:
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return None
    return _seconds(mark.args[0] if mark.args else mark.kwargs.get("timeout"))


def pytest_timeout_of(item: pytest.Item, *, per_test_only: bool = False) -> tuple[float, str] | None:
    """pytest-timeout's timeout for ``item`` and where it came from, in the words a timeout failure uses.

    ``per_test_only``: only the item's own ``@pytest.mark.timeout``. None when pytest-timeout is not
    loaded or gives no timeout.
    """
    config = item.config
    if not config.pluginmanager.has_plugin(PYTEST_TIMEOUT_PLUGIN):
        return None
    marked = _marker_timeout(item)
    if marked is not None:
        return marked, f"@pytest.mark.timeout({marked:g})"
    if per_test_only:
        return None
    option = _seconds(config.getoption("timeout", None))
    if option is not None:
        return option, f"--timeout={option:g}"
    env = _seconds(os.environ.get("PYTEST_TIMEOUT"))
    if env is not None:
        return env, f"PYTEST_TIMEOUT={env:g}"
    ini = _seconds(config.getini("timeout"))
    if ini is not None:
        return ini, f"the ini key timeout = {ini:g}"
    return None


class TimeoutBridge:
    """Registered when pytest-timeout is loaded: its timer stays off on ranks tests, in every process."""

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        """A ranks test is timed by its rank timeout (the controller's), not by a timer in this process."""
        return True if item_ranks_spec(item) is not None else None

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if item_ranks_spec(item) is not None else None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Refuse a ranks test whose ``@pytest.mark.timeout`` is not a number of seconds (pytest-timeout would
        stop the session with an internal error when the test starts), or that sets its timeout twice."""
        for item in items:
            spec = item_ranks_spec(item)
            if spec is None:
                continue
            _check_marker(item)
            if spec.timeout is None:
                continue
            theirs = pytest_timeout_of(item, per_test_only=True)
            if theirs is not None:
                raise pytest.UsageError(
                    f"{item.nodeid}: both @pytest.mark.ranks(timeout={spec.timeout:g}) and {theirs[1]} set "
                    "its timeout; keep one (either becomes the test's rank timeout)"
                )


def _check_marker(item: pytest.Item) -> None:
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return
    value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
    try:
        valid = value is not None and not isinstance(value, bool) and float(value) >= 0
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.timeout({value!r}) is not a number of seconds; give one, such as "
            "@pytest.mark.timeout(60) (it becomes the test's rank timeout)"
        )


def register_timeout_bridge(config: pytest.Config) -> None:
    """Bridge pytest-timeout when it is loaded (``-p no:timeout`` or not installed: nothing to do)."""
    if config.pluginmanager.has_plugin(PYTEST_TIMEOUT_PLUGIN):
        config.pluginmanager.register(TimeoutBridge(), "sprite-pytest-timeout")
