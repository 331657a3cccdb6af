"""What may run in the controller around a ranks test: before its ranks start, and after every rank ended.

torch's ``MultiProcessTestCase`` runs its ``setUp`` and ``tearDown`` in the parent, once, around the
processes it spawns; with ``--torch-tests=ranks`` that parent's side is an :class:`AroundRanks`
kept in the item's stash, and the controller calls it. An ordinary ranks test has none.

A ranks test may also carry other tests: its children run them after it, in the same processes (torch's
``MultiProcContinuousTest`` keeps one world for a whole class). Their reports reach the controller with the
test's own; :meth:`AroundRanks.after` sorts them out, and each is logged as its own test after it
(:meth:`AroundRanks.carried`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol

import pytest

__all__ = ["AroundRanks", "CarriedTest", "around_ranks_key"]


class CarriedTest(NamedTuple):
    """A test the children of a ranks test ran after it, and each rank's reports of it, in order."""

    item: pytest.Item
    reports: dict[int, list[pytest.TestReport]]


class AroundRanks(Protocol):
    """The controller's side of one ranks test."""

    def before(self, test_dir: Path) -> None:
        """Called once, before any rank starts, with the test's shared directory (its ``tmp_path``).

        Must not raise: what goes wrong is for the ranks to report (they read it from ``test_dir``).
        """

    def after(self, reports: Mapping[int, list[pytest.TestReport]], ends: Mapping[int, Any]) -> None:
        """Called once every rank has ended, before the reports are merged; may change them in place.

        ``reports``: each rank's reports, in order; ``ends``: how each rank's child ended (``RankEnd``).
        Called even when ``before`` was not (the agents could not start). When the test carries others,
        ``reports`` holds theirs too (each report names its test): leave only the test's own.
        """

    def carried(self) -> Sequence[CarriedTest]:
        """The tests this one carried, in the order they ran, with their reports (after :meth:`after`).

        Each is logged as its own test after this one. A rank whose reports of a carried test end with its
        teardown finished it; any other rank's end is how its child ended.
        """


around_ranks_key: Final = pytest.StashKey[AroundRanks]()
"""An item's :class:`AroundRanks` (absent: nothing runs around its ranks)."""
