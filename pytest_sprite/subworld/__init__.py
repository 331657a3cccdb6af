"""Sub-worlds: run a function in fresh processes, one per rank, with a fresh rendezvous, and kill them at will.

Inside a ranks test every rank calls :func:`run_subworld` together; each of the first ``ranks`` ranks gets a
new process forked from its test's *zygote* (a process that never touched a device or a process group, asked
for by the test's first sub-world from the one its rank agent keeps), so a sub-world costs a fork, never an
interpreter start. The new
processes form their own world (``RANK``/``WORLD_SIZE``/``MASTER_*`` exported, their own default process
group on a fresh store) and run ``fn(world, *args, **kwargs)``. Every rank of the test gets the same
:class:`SubworldResult`: per rank, the value returned (or the error raised), every value the function
emitted with :func:`emit` while it ran, and how the process ended.

A plain test (no ranks marker) is a world of its own: its process forks the sub-world's ranks directly.

Kill points make crashes part of the plan: code in the sub-world calls ``kill_point("step", 4)`` (or
``kill_point("file", detail=path)``), and a kill plan such as ``KillAt("step", at=4, ranks=[1])`` decides
which rank dies there. A rank that dies (planned, crashed or signalled) ends its sub-world: the other ranks
are killed too, and the result says, rank by rank, who died where and who was ended. The test that started
the sub-world carries on. Sub-worlds do not nest.

The checkpoint resume check (kill a fit after its checkpoint, resume it in new processes, reshard at half the
world) and the crash-consistency check (die inside the n-th file event of a save) are built on this.

Modules: ``plan`` (kill plans), ``result`` (what comes back), ``rank`` (the rank process, ``emit`` and
``kill_point``), ``join`` (joining a world, shared with the test child), ``zygote`` (forking ranks) and
``host`` (``run_subworld``: start, watch, collect).
"""

from __future__ import annotations

from .host import DEFAULT_TIMEOUT, run_subworld
from .host import _subworld_place as _subworld_place
from .plan import KillAt, KillPlan, KillPoint
from .rank_body import emit, in_subworld, kill_point
from .result import RankOutcome, SubworldError, SubworldResult
from .zygote import Pristine, Zygote, set_pristine, settle_zygote_ranks, zygote_pid

__all__ = [
    "DEFAULT_TIMEOUT",
    "KillAt",
    "KillPlan",
    "KillPoint",
    "Pristine",
    "RankOutcome",
    "SubworldError",
    "SubworldResult",
    "Zygote",
    "emit",
    "in_subworld",
    "kill_point",
    "run_subworld",
    "set_pristine",
    "settle_zygote_ranks",
    "zygote_pid",
]
