"""One world per ``MultiProcContinuousTest`` class: its tests run one after another in the same ranks.

Natively torch spawns ``world_size`` workers at the class's first test, each initialises one process group
(``_init_pg``), and every test of the class is sent to the same workers over queues; after a test that
failed on any rank the rest of the class is skipped ("Previous test failed, skipping ..."). Here:

- the class's selected tests form a group (:func:`group_classes`, after ``-k`` / ``-m`` deselected); its
  first test carries the others: it alone is a ranks test (``ranks(n, init=False)``, its timeout torch's
  ``get_timeout`` of every test of the group, summed), and its children run the rest after it
  (``classworld_rank``), each reported as its own test;
- in the controller, :class:`ClassWorld` (the first test's ``AroundRanks``) sorts the reports out by test
  once the ranks ended, and gives the tests that no rank reached after a failure torch's skip;
- the others' own ``pytest_runtest_protocol`` does nothing (:func:`follower_protocol`): they are logged
  with the first, when it finishes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import pytest

from ..glue.around import CarriedTest, around_ranks_key
from ..glue.markers import timeout_source_key
from ..glue.pytest_internals import skip_at_item, teardown_controller_state
from .cases import case_id, torch_test_key

__all__ = ["ClassGroup", "ClassWorld", "follower_protocol", "group_classes", "group_key", "poison_reason"]


@dataclass(eq=False)
class ClassGroup:
    """A class's selected tests, in the order they run; the first carries the others."""

    items: list[pytest.Item]
    world: ClassWorld | None = None
    """In the controller: the first test's ``AroundRanks``."""

    @property
    def carrier(self) -> pytest.Item:
        return self.items[0]


group_key: Final = pytest.StashKey[ClassGroup]()
"""Set on every test of a class world: its group."""


def poison_reason(item: pytest.Item) -> str:
    """torch's skip of the tests after a failure in the class (``MultiProcContinuousTest.setUp``)."""
    test = item.stash[torch_test_key]
    return f"Previous test failed, skipping {case_id(test.cls, test.name)}"


def together(config: pytest.Config) -> bool:
    """Whether a class's tests share one world: always, but in a pytest-xdist worker, where each test gets a
    world of its own. A worker accepts a test's reports only while that test's own protocol runs, and the
    tests of a class world are logged together, with the first."""
    return not hasattr(config, "workerinput")


def group_classes(items: list[pytest.Item], *, controller: bool, config: pytest.Config) -> None:
    """Group the selected class-world tests by class, mark each group's first ``ranks(n, init=False)``."""
    groups: dict[Any, list[pytest.Item]] = {}
    joined = together(config)
    for item in items:
        test = item.stash.get(torch_test_key, None)
        if test is not None and test.kind == "continuous":
            groups.setdefault(test.cls if joined else item, []).append(item)
    for members in groups.values():
        group = ClassGroup(items=members)
        for item in members:
            item.stash[group_key] = group
        carrier = group.carrier
        test = carrier.stash[torch_test_key]
        timeouts = [item.stash[torch_test_key].timeout for item in members]
        total = None if any(t is None for t in timeouts) else sum(t for t in timeouts if t is not None)
        carrier.add_marker(pytest.mark.ranks(test.world_size, timeout=total, init=False))
        carrier.stash[timeout_source_key] = (
            test.timeout_source
            if len(members) == 1
            else f"torch's get_timeout for each of the {len(members)} tests of {test.cls.__qualname__}, "
            "summed: one world runs them all"
        )
        if controller:
            group.world = ClassWorld(group)
            carrier.stash[around_ranks_key] = group.world


def follower_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """A carried test's ``pytest_runtest_protocol`` in the controller: nothing, its first test logs it.

    When the first test did not go to ranks (it needs more ranks than the world), this one is skipped
    the same way (None: pytest runs it, and its copied ``skip`` marker skips it).
    """
    group = item.stash.get(group_key, None)
    if group is None or item is group.carrier:
        return None
    world = group.world
    skips = list(group.carrier.iter_markers("skip"))
    if (world is not None and world.started) or not skips:
        teardown_controller_state(item, nextitem)
        return True
    for mark in skips:
        item.add_marker(pytest.mark.skip(*mark.args, **mark.kwargs))
    return None


def _complete(reports: Sequence[pytest.TestReport] | None) -> bool:
    return reports is not None and len(reports) > 0 and reports[-1].when == "teardown"


def _failed(per_rank: Mapping[int, Sequence[pytest.TestReport]], world_size: int) -> bool:
    """Whether the merged test fails: a rank failed a phase, or did not finish it."""
    if any(rep.failed for reps in per_rank.values() for rep in reps):
        return True
    return not all(_complete(per_rank.get(rank)) for rank in range(world_size))


def _phase_report(item: pytest.Item, when: Literal["setup", "teardown"], run: Any) -> pytest.TestReport:
    call = pytest.CallInfo.from_call(run, when=when)
    return pytest.TestReport.from_item_and_call(item, call)


def _nothing() -> None:
    pass


def skipped_reports(item: pytest.Item, reason: str) -> list[pytest.TestReport]:
    """What a rank reports for a test it skips in setup: made here for a rank that did not reach it."""
    return [
        _phase_report(item, "setup", lambda: skip_at_item(reason)),
        _phase_report(item, "teardown", _nothing),
    ]


@dataclass(eq=False)
class ClassWorld:
    """The controller's side of a class world (an ``AroundRanks`` on its first test)."""

    group: ClassGroup
    started: bool = False
    """True once the first test's ranks were started or it finished: the others are logged with it."""
    _carried: list[CarriedTest] = field(default_factory=list)

    def before(self, test_dir: Path) -> None:
        self.started = True

    def after(self, reports: Mapping[int, list[pytest.TestReport]], ends: Mapping[int, Any]) -> None:
        """Sort the reports out by test; torch's skip for the tests no rank reached after a failure."""
        self.started = True
        items = self.group.items
        world_size = items[0].stash[torch_test_key].world_size
        by_test: dict[str, dict[int, list[pytest.TestReport]]] = {item.nodeid: {} for item in items}
        for rank, reps in reports.items():
            for rep in reps:
                by_test.setdefault(rep.nodeid, {}).setdefault(rank, []).append(rep)
        first = by_test[items[0].nodeid]
        for rank, reps in first.items():
            later = any(rank in by_test[item.nodeid] for item in items[1:])
            if later and not _complete(reps):  # its teardown report comes after the others': it ended
                reps.append(_phase_report(items[0], "teardown", _nothing))
        for rank, reps in reports.items():
            reps[:] = first.get(rank, [])
        poisoned = _failed(first, world_size)
        self._carried = []
        for item in items[1:]:
            per_rank = by_test[item.nodeid]
            if poisoned:
                for rank in range(world_size):
                    if not _complete(per_rank.get(rank)):
                        per_rank[rank] = skipped_reports(item, poison_reason(item))
            poisoned = poisoned or _failed(per_rank, world_size)
            self._carried.append(CarriedTest(item=item, reports=per_rank))

    def carried(self) -> Sequence[CarriedTest]:
        return self._carried
