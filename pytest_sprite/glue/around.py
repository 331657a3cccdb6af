"""What may run in the controller around a ranks test: before its ranks start, and after every rank ended.

torch's ``MultiProcessTestCase`` runs its ``setUp`` and ``tearDown`` in the parent, once, around the
processes it spawns; with ``--torch-tests=ranks`` (issue 26) that parent's side is an :class:`AroundRanks`
kept in the item's stash, and the controller calls it. An ordinary ranks test has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import pytest

__all__ = ["AroundRanks", "around_ranks_key"]


class AroundRanks(Protocol):
    """The controller's side of one ranks test."""

    def before(self, test_dir: Path) -> None:
        """Called once, before any rank starts, with the test's shared directory (its ``tmp_path``).

        Must not raise: what goes wrong is for the ranks to report (they read it from ``test_dir``).
        """

    def after(self, reports: Mapping[int, list[pytest.TestReport]], ends: Mapping[int, Any]) -> None:
        """Called once every rank has ended, before the reports are merged; may change them in place.

        ``reports``: each rank's reports, in order; ``ends``: how each rank's child ended (``RankEnd``).
        Called even when ``before`` was not (the agents could not start).
        """


around_ranks_key: Final = pytest.StashKey[AroundRanks]()
"""An item's :class:`AroundRanks` (absent: nothing runs around its ranks)."""
