"""torch's own multiprocess test classes, run on ranks with their bodies unchanged (``--torch-tests=ranks``).

A ``MultiProcessTestCase`` test spawns ``world_size`` fresh interpreters per test (2-16 s each). Opted in,
each of its test methods becomes a ranks test on the class's ``world_size`` (or its
``@requires_world_size(n)``) that asks for no default group (``ranks(n, init=False)``), and runs the way
torch's own runner runs it:

- the parent's side, in the controller (``parent``): ``setUpClass`` and ``setUp`` before the ranks start,
  ``tearDown`` and ``tearDownClass`` after every rank ended, in a process of its own per test (a fork of the
  controller), so that tests packed side by side do not share the parent's globals;
- each rank (``rank``): a test child without a default process group that runs the class's own ``_run``
  (``FSDPTest``, ``DistributedTest`` initialise their groups there) with ``self.rank`` and the test's store
  file, the environment the parent's side set, and torch's exit codes mapped to outcomes;
- the verdict (``verdict``): torch's exit-code protocol (an error exit fails, rank 0's code decides,
  ``skip_return_code_checks`` / ``special_return_code_checks``), applied to the ranks' reports before they
  are merged.

A ``MultiProcContinuousTest`` class (``DTensorContinuousTestBase``) keeps one world for all its tests, as
torch does: its first selected test carries the others, which its ranks run after it in the same processes
(``classworld``: the grouping and the controller's side; ``classworld_rank``: the ranks' side).

Modules: ``state`` (what the parent's side hands the ranks), ``collect`` (which items, on how many ranks),
``parent``, ``rank``, ``verdict``, ``classworld``, ``classworld_rank``. torch is imported only when the test
modules already did.
"""

from __future__ import annotations

import pytest

__all__ = ["register"]


def register(config: pytest.Config, *, agent: bool) -> None:
    """Register the collection plugin and the test children's (locally forked agents inherit both)."""
    from .collect import TorchTestsCollector
    from .spawned_rank import TorchTestsRank

    config.pluginmanager.register(TorchTestsCollector(controller=not agent), "sprite-torch-tests")
    config.pluginmanager.register(TorchTestsRank(), "sprite-torch-tests-rank")
