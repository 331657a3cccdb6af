"""Inside a test child: the tests of one ``MultiProcContinuousTest`` class, one after another in one world.

What torch's worker does (``_worker_loop``), in the children of the class's first test (``classworld``):

- once per class: the class's ``rank`` and ``world_size``, then its own ``_init_pg`` on a rendezvous file
  in the first test's directory (shared by every rank); a skip code there skips every test of the class;
- per test: torch's ``_run_test_given_id`` (a fresh instance, torch's seed, the method). A skip code
  (``TEST_SKIPS``) skips; any other exception, ``unittest.SkipTest`` and ``SystemExit`` included, fails,
  as in torch's worker;
- then every rank learns every rank's outcome (a file store in the same directory) and the test's outcome
  is torch's: the first rank, in rank order, that did not pass decides; after a failure the rest of the
  class is skipped ("Previous test failed, skipping ..."). A rank that does not report within the test's
  timeout (``get_timeout``) fails it on the ranks that wait.

The first test's call initialises the world and runs it; the others run after its teardown
(:func:`run_followers`), each through pytest's phases and reports, so that each is its own test.
"""

from __future__ import annotations

import json
import traceback
import unittest
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, Literal, NoReturn

import pytest

from ..glue.pytest_internals import skip_at_item
from ..plumbing.dependency_internals import torch_continuous_init, torch_continuous_run
from ..plumbing.ranges import fold_ranks
from ..plumbing.timing import monotonic
from .cases import case_id, torch_test_key
from .classworld import group_key, poison_reason
from .exit_codes import exit_code, skip_messages
from .state import child_spec

__all__ = ["run_continuous", "run_followers"]

RENDEZVOUS_FILE: Final = "classworld-rendezvous"
"""The class's ``rdvz_file`` in its first test's directory: torch's ``_init_pg`` makes a ``FileStore`` on it."""
OUTCOMES_FILE: Final = "classworld-outcomes"
"""The file store on which the ranks tell each other how each test went."""
DEFAULT_TIMEOUT: Final = 300.0
"""Seconds a rank waits for its peers' outcome when torch has no ``get_timeout`` (its ``TIMEOUT_DEFAULT``)."""


@dataclass
class _RankWorld:
    """This rank's side of its class's world."""

    rank: int
    world_size: int
    store: Any
    init_skip: str | None = None
    """``_init_pg`` exited with one of torch's skip codes: every test of the class skips with its message."""
    poisoned: bool = False
    """A test of the class failed (or its group could not be made): the rest skip."""


@dataclass(frozen=True)
class _Outcome:
    """How one test went on this rank, before the ranks agree."""

    outcome: str
    """``passed``, ``skipped`` or ``failed``."""
    reason: str = ""
    exc: BaseException | None = None
    text: str = ""


_worlds: dict[type, _RankWorld] = {}
"""The class worlds of this child (one test child serves one group: one class)."""


def _class_world(cls: type, spec: dict[str, Any]) -> _RankWorld:
    """This rank's world of ``cls``, made at its first test: torch's ``_init_pg``, and the outcomes' store."""
    world = _worlds.get(cls)
    if world is not None:
        return world
    import torch.distributed as dist

    test_dir = Path(spec["tmp_path"])
    rank, world_size = int(spec["rank"]), int(spec["world_size"])
    file_store: Any = getattr(dist, "FileStore")  # noqa: B009 (torch exports it without a stub)
    store = file_store(str(test_dir / OUTCOMES_FILE), world_size)
    world = _worlds[cls] = _RankWorld(rank=rank, world_size=world_size, store=store)
    try:
        torch_continuous_init(cls, rank, world_size, str(test_dir / RENDEZVOUS_FILE))
    except SystemExit as exc:
        code, skips = exit_code(exc), skip_messages()
        if code not in skips:
            world.poisoned = True
            pytest.fail(f"{cls.__qualname__}._init_pg exited with code {code} on rank {rank}", pytrace=False)
        world.init_skip = skips[code]
    except BaseException:
        world.poisoned = True
        raise
    return world


def _run_test(cls: type, tid: str) -> _Outcome:
    """One test on this rank, its outcome as torch's worker sees it (``_worker_loop``)."""
    try:
        torch_continuous_run(cls, tid)
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        skips = skip_messages()
        code = exit_code(exc)
        if code in skips:
            return _Outcome("skipped", reason=skips[code])
        return _Outcome("failed", exc=exc, text=traceback.format_exc())
    except BaseException as exc:  # torch's worker fails the test for any of them, SkipTest included
        return _Outcome("failed", exc=exc, text=traceback.format_exc())
    return _Outcome("passed")


def _agree(
    world: _RankWorld, index: int, own: _Outcome, *, tid: str, timeout: float, deadline: float
) -> list[Any]:
    """Every rank's outcome of test ``index``; a failure naming the ranks that did not report in time."""
    __tracebackhide__ = True
    keys = [f"sprite/test{index}/rank{rank}" for rank in range(world.world_size)]
    world.store.set(keys[world.rank], json.dumps({"outcome": own.outcome, "reason": own.reason}))
    try:
        world.store.wait(keys, timedelta(seconds=max(1.0, deadline - monotonic())))
    except Exception:  # torch's store raises its own error type on a timeout
        world.poisoned = True
        if own.outcome == "failed":
            _raise(own)
        missing = [rank for rank, key in enumerate(keys) if not world.store.check([key])]
        pytest.fail(
            f"{fold_ranks(missing)} did not finish {tid} within {timeout:g}s (torch's get_timeout for it); "
            f"rank {world.rank} finished it ({own.outcome})",
            pytrace=False,
        )
    return [json.loads(world.store.get(key)) for key in keys]


def _raise(own: _Outcome) -> NoReturn:
    """This rank's failure: its exception as raised, or, for one pytest would not report as a failure
    (``SkipTest``, ``SystemExit``, pytest's outcomes), torch's message with its traceback."""
    __tracebackhide__ = True
    if isinstance(own.exc, Exception) and not isinstance(own.exc, unittest.SkipTest):
        raise own.exc
    pytest.fail(f"Exception in worker process:\n{own.text}", pytrace=False)


def run_continuous(item: pytest.Item) -> None:
    """The call phase of one class-world test on this rank (``item.runtest``)."""
    __tracebackhide__ = True
    test = item.stash[torch_test_key]
    group = item.stash[group_key]
    world = _class_world(test.cls, child_spec(item))
    if world.poisoned:
        skip_at_item(poison_reason(item))
    if world.init_skip is not None:
        skip_at_item(world.init_skip)
    timeout = test.timeout or DEFAULT_TIMEOUT
    deadline = monotonic() + timeout
    tid = case_id(test.cls, test.name)
    own = _run_test(test.cls, tid)
    outcomes = _agree(world, group.items.index(item), own, tid=tid, timeout=timeout, deadline=deadline)
    first = next((seen for seen in outcomes if seen["outcome"] != "passed"), None)
    if first is None:
        return
    if first["outcome"] == "skipped":  # torch: the first rank that did not pass decides
        skip_at_item(str(first["reason"]))
    world.poisoned = True
    if own.outcome == "failed":
        _raise(own)


def _phase(item: pytest.Item, when: Literal["setup", "call", "teardown"], hook: Any) -> pytest.TestReport:
    """One phase as pytest's runner runs it: the hook, then the report (which the child sends)."""
    call = pytest.CallInfo.from_call(
        lambda: hook(item=item) if when != "teardown" else hook(item=item, nextitem=None),
        when=when,
        reraise=(pytest.exit.Exception, KeyboardInterrupt),
    )
    report: pytest.TestReport = item.ihook.pytest_runtest_makereport(item=item, call=call)
    return report


def run_followers(carrier: pytest.Item) -> float:
    """After the first test's teardown: the class's other tests, each through setup, call and teardown.

    The test child's own setup (joining the test's world) is left out: this process is in its world
    already, with the class's process group. Returns the seconds they took.
    """
    group = carrier.stash[group_key]
    manager = carrier.config.pluginmanager
    child = manager.get_plugin("sprite-child")
    setup = manager.subset_hook_caller("pytest_runtest_setup", remove_plugins=[child] if child else [])
    started = monotonic()
    for item in group.items[1:]:
        if _phase(item, "setup", setup).passed:
            _phase(item, "call", item.ihook.pytest_runtest_call)
        _phase(item, "teardown", item.ihook.pytest_runtest_teardown)
    return monotonic() - started
