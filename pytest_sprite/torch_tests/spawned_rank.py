"""Inside a test child: one rank of a torch test, run the way torch's spawned process runs it.

The item's own setup and teardown (pytest's unittest machinery: an instance, ``setUpClass`` as a class
fixture) are left out, as in a natively spawned child; the call runs the class's ``_run(rank, test_name,
file_name, pipe, fake_pg=...)``: a fresh instance with ``self.rank`` and ``self.file_name``, the
subclass's own initialisation (``FSDPTest``, ``DistributedTest``), ``run_test`` with torch's seeding. The
process exit torch would make (``sys.exit``) ends the call instead, and its code becomes the outcome
(``verdict``). The environment the parent's ``setUp`` set is applied first.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Any, Final

import pytest

from ..glue.pytest_internals import skip_at_item
from ..plumbing.dependency_internals import torch_run_rank
from .cases import torch_test_key
from .exit_codes import CODE_ATTR, ERROR_EXIT_CODE, SKIPPED_ATTR, exit_code, skip_messages
from .state import ParentState, child_spec, read_state

__all__ = ["TorchTestsRank"]

_code_key: Final = pytest.StashKey[tuple[int, bool]]()
"""The rank's exit code and whether it is one of torch's skip codes, for its call report."""
_carried_time_key: Final = pytest.StashKey[float]()
"""Seconds a class world's first test spent, in its teardown, running the class's other tests."""


class TorchTestsRank:
    """Child-side plugin of ``--torch-tests=ranks`` (registered in agents; active in their test children)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Before pytest sets the item up: no unittest instance or class fixture; the call runs ``_run``."""
        if torch_test_key not in item.stash or item.config.pluginmanager.get_plugin("sprite-child") is None:
            return  # not a torch test, or not in a test child (the controller runs a test it skips)
        item.setup = _nothing  # type: ignore[method-assign]
        item.teardown = _nothing  # type: ignore[method-assign]
        if item.stash[torch_test_key].kind == "continuous":
            from .classworld_rank import run_continuous

            item.runtest = lambda: run_continuous(item)  # type: ignore[method-assign]
        else:
            item.runtest = lambda: run_rank(item)  # type: ignore[method-assign]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        """A class world's first test, once torn down: its children run the class's other tests."""
        try:
            return (yield)
        finally:
            from .classworld import group_key

            group = item.stash.get(group_key, None)
            child = item.config.pluginmanager.get_plugin("sprite-child")
            if group is not None and item is group.carrier and len(group.items) > 1 and child is not None:
                from .classworld_rank import run_followers

                item.stash[_carried_time_key] = run_followers(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if call.when == "call" and _code_key in item.stash:
            code, skipped = item.stash[_code_key]
            setattr(report, CODE_ATTR, code)
            setattr(report, SKIPPED_ATTR, skipped)
        if call.when == "teardown" and _carried_time_key in item.stash:  # its own teardown's time only
            report.duration = max(0.0, report.duration - item.stash[_carried_time_key])
        return report


def _nothing() -> None:
    pass


def _apply_env(state: ParentState) -> None:
    for name in state.env_unset:
        os.environ.pop(name, None)
    os.environ.update(state.env_set)


def run_rank(item: pytest.Item) -> None:
    """The call phase of one rank: torch's ``_run`` with its exit mapped to this rank's outcome."""
    __tracebackhide__ = True
    test = item.stash[torch_test_key]
    spec = child_spec(item)
    rank = int(spec["rank"])
    state = read_state(Path(spec["tmp_path"]))
    if state.skipped is not None:
        skip_at_item(state.skipped)
    if state.error is not None:
        pytest.fail(f"setUp (the parent's side, in the controller) raised:\n{state.error}", pytrace=False)
    _apply_env(state)
    here, there = multiprocessing.Pipe()
    code, escaped = 0, None
    try:
        torch_run_rank(test.cls, rank, test.name, state.file_name, there, fake_pg=state.fake_pg)
    except SystemExit as exc:
        code = exit_code(exc)
    except Exception:  # natively the process dies of it: exit code 1, and rank 0's code decides
        code, escaped = 1, traceback.format_exc()
    skips = skip_messages()
    item.stash[_code_key] = (code, code in skips)
    if code == ERROR_EXIT_CODE:
        error = here.recv() if here.poll(1.0) else "(the rank sent no traceback)"
        pytest.fail(f"exited with error code {ERROR_EXIT_CODE} and exception:\n{error}", pytrace=False)
    if code in skips:
        skip_at_item(skips[code])
    if code != 0:
        detail = f"rank {rank} exited with code {code}" + (f":\n{escaped}" if escaped else "")
        item.add_report_section("call", "torch exit code", detail)
