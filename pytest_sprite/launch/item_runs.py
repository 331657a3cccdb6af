"""The controller's bookkeeping of ranks tests: what each item needs, and one test's run from submission to log.

Split from :mod:`pytest_sprite.launch.controller` (which re-exports the public names): the world size and
timeout an item asks for, whether the world launches before collection, the session's hypothesis seed, and
:class:`_Run`, the record of one ranks test that the event loop fills and the reporting reads.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ..glue.markers import PARAM_NAME, WORLD, Size, item_ranks_spec, timeout_source_key
from ..glue.options import DEFAULT_TIMEOUT_SOURCE, Settings
from ..glue.pytest_timeout import pytest_timeout_of
from ..plumbing.placement import Placement
from ..plumbing.protocol import DebuggerAddress, EndedBy, RunSpec
from ..plumbing.timing import monotonic
from .rank_end import RankEnd

__all__ = [
    "beyond_world_key",
    "finished_run_key",
    "item_timeout",
    "item_world_size",
    "launches_early",
    "size_items",
    "usable_cores",
    "world_size_key",
]

world_size_key = pytest.StashKey[int]()
"""The number of ranks an item runs on (absent: an ordinary test)."""
beyond_world_key = pytest.StashKey[str]()
"""Set when the item needs more ranks than the world: the skip reason."""
finished_run_key = pytest.StashKey["_Run"]()
"""Set on a ranks item whose test has finished, just before the loop hands it to ``pytest_runtest_protocol``."""


def item_world_size(item: pytest.Item) -> Size | None:
    """How many ranks ``item`` runs on (``"world"``: the session's world, not sized yet), None for an ordinary test."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and PARAM_NAME in callspec.params:
        size = callspec.params[PARAM_NAME]
        return WORLD if size == WORLD else int(size)
    spec = item_ranks_spec(item)
    return spec.sizes[0] if spec is not None else None


def size_items(items: list[pytest.Item], world_size: int | None) -> int | None:
    """Record each item's world size, skip those that need more ranks than the world; the world's size.

    ``world_size`` is the session's (``--ranks``), else the largest size a marker asks for; a
    ``ranks("world")`` item runs on it, and is skipped when nothing sets it.
    """
    sizes: dict[pytest.Item, int] = {}
    whole: list[pytest.Item] = []
    for item in items:
        n = item_world_size(item)
        if n == WORLD:
            whole.append(item)
        elif n is not None:
            sizes[item] = n
            item.stash[world_size_key] = n
    if world_size is None and sizes:
        world_size = max(sizes.values())
    for item in whole:  # ranks("world") without --ranks: the world the other markers size
        if world_size is None:
            reason = (
                '@pytest.mark.ranks("world") runs on the session\'s world, whose size nothing sets here: '
                "pass --ranks=W (or SPRITE_RANKS, or the ini option ranks)"
            )
            item.stash[beyond_world_key] = reason
            item.add_marker(pytest.mark.skip(reason=reason))
        else:
            sizes[item] = item.stash[world_size_key] = world_size
    for item, n in sizes.items():
        assert world_size is not None
        if n > world_size:
            reason = (
                f"needs {n} ranks, the world has {world_size} "
                f"(--ranks={world_size}); run with --ranks={n} or more to include it"
            )
            item.stash[beyond_world_key] = reason
            item.add_marker(pytest.mark.skip(reason=reason))
    return world_size


def item_timeout(item: pytest.Item, settings: Settings) -> tuple[float, str]:
    """The seconds ``item`` may run and where that came from, the most specific first: its marker's
    ``timeout=``; pytest-timeout's marker; the session's rank timeout when given; pytest-timeout's
    session timeout; the session's default (see :mod:`pytest_sprite.glue.pytest_timeout`).

    Whatever form the marker has (a size, a list of sizes, ``"world"``): a parametrized item's spec is
    found through :func:`item_ranks_spec`, not only in its stash, which only an unparametrized item had
    filled at this point, so ``ranks("world", timeout=8)`` runs for its own timeout.
    """
    spec = item_ranks_spec(item)
    if spec is not None and spec.timeout is not None:  # a plugin that added the marker names its source
        return spec.timeout, item.stash.get(timeout_source_key, "@pytest.mark.ranks(timeout=...)")
    marked = pytest_timeout_of(item, per_test_only=True)
    if marked is not None:
        return marked
    if settings.timeout_source != DEFAULT_TIMEOUT_SOURCE:
        return settings.timeout, settings.timeout_source
    return pytest_timeout_of(item) or (settings.timeout, settings.timeout_source)


def launches_early(settings: Settings, *, collect_only: bool, cores: int) -> bool:
    """Whether the world is launched as collection starts (``--launch-early``; see ``Controller.launch_early``).

    ``auto`` launches early only when this host has ``cores`` for the controller and every agent it may
    run (``--ppn``, else all of ``--ranks``): on fewer, the agents' start-up and the controller's
    collection share the cores and gain nothing by overlapping, while a session whose selected tests
    need no world would pay for agents it ends unused.
    """
    if settings.launcher == "local" or settings.world_size is None or collect_only:
        return False
    if settings.launch_early != "auto":
        return settings.launch_early == "on"
    on_this_host = min(settings.world_size, settings.ppn or settings.world_size)
    return cores >= on_this_host + 1


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _hypothesis_seed(config: pytest.Config) -> int | str:
    """The session's hypothesis seed, decided once for every rank: ``--hypothesis-seed`` or drawn."""
    given = config.getoption("hypothesis_seed", None)
    if given is None:
        return secrets.randbits(64)
    try:
        return int(given)  # as hypothesis' own pytest plugin reads it
    except ValueError:
        return str(given)


@dataclass
class _Run:
    """One ranks test, from its submission until its reports are logged."""

    run_id: int
    item: pytest.Item
    nextitem: pytest.Item | None
    n: int
    timeout: float
    timeout_source: str
    agents: tuple[int, ...] = ()
    """Test rank r runs on agent ``agents[r]``; empty until it starts."""
    started: float = 0.0
    started_at: float = 0.0
    """Wall clock (``timing.wall``) of ``started``, which the ranks' report times are comparable with."""
    held: float = 0.0
    """Seconds a debugger on a rank held the controller's terminal while this test ran: not counted against
    its timeout (a debugger left open is the user's choice, not a hang)."""
    done: bool = False
    reports: dict[int, list[pytest.TestReport]] = field(default_factory=dict)
    ends: dict[int, RankEnd] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)
    first_failure: float | None = None
    aborted: dict[int, float] = field(default_factory=dict)
    """Rank -> when the controller asked its agent to take its stacks and end it."""
    abort_reason: tuple[EndedBy, str] | None = None
    """Why the ranks are ended, and the detail: what the kill that follows the stacks says."""
    taking_stacks: set[int] = field(default_factory=set)
    """Aborted ranks whose agents have not yet answered ``stacks_taken``: no rank is killed before they do."""
    killed: set[int] = field(default_factory=set)
    """Aborted ranks whose agents were told to kill."""
    exited: dict[int, float] = field(default_factory=dict)
    """Rank -> when its ``child_exited`` arrived."""
    failed_at: dict[int, float] = field(default_factory=dict)
    """Rank -> when its first failure arrived."""
    interrupted: str | None = None
    interrupted_by: dict[int, str] = field(default_factory=dict)
    """Rank -> what it did to end the session (``called pytest.exit('enough')``), for its own report."""
    exit_code: int | None = None
    """``pytest.exit(..., returncode=N)`` on a rank: the session's exit status (None: interrupted, 2)."""
    test_dir: Path | None = None
    """The test's shared tmp_path, made by the controller before the children start."""
    warnings: dict[tuple[str, str, str, int], list[int]] = field(default_factory=dict)
    """Warnings the ranks raised: (category, message, file, line) -> ranks, folded when logged."""
    hosts: dict[int, str] = field(default_factory=dict)
    """Host of each rank's agent, for the per-rank outcomes of the reports."""
    mutant: str | None = None
    """``--sprite-mutate``: the mutant this run plants (a spec string); None for the test's own run."""
    called: dict[int, list[str]] = field(default_factory=dict)
    """``--sprite-mutate``: rank -> the op names its collectives called (from ``collectives_called``)."""

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.n) if r not in self.ends]

    @property
    def stacks_took(self) -> float | None:
        """Seconds from the first abort until the last aborted rank's child had dumped its stacks and exited."""
        done = [self.exited[r] for r in self.aborted if r in self.exited]
        return max(done) - min(self.aborted.values()) if done else None

    @property
    def woken(self) -> list[int]:
        """Ranks whose first failure came after the first abort: the end of a peer may have caused it."""
        if not self.aborted:
            return []
        first = min(self.aborted.values())
        return [r for r, when in self.failed_at.items() if when >= first]

    def note_failure(self, rank: int) -> None:
        self.failed_at.setdefault(rank, monotonic())
        if rank not in self.failed:
            self.failed.append(rank)
        if self.first_failure is None:
            self.first_failure = monotonic()

    def spec(
        self,
        rank: int,
        where: Placement,
        *,
        rendezvous: tuple[str, int],
        basetemp: Path,
        settings: Settings,
        seed: int | str,
        last: bool,
        debugger: DebuggerAddress,
    ) -> RunSpec:
        """What the agent of test rank ``rank`` hands its child: its seat, the rendezvous, the shared folders."""
        assert self.test_dir is not None, "the test's directory is made before its ranks start"
        return RunSpec(
            run_id=self.run_id,
            nodeid=self.item.nodeid,
            rank=rank,
            world_size=self.n,
            local_rank=where.local_rank,
            local_size=where.local_size,
            node=where.node,
            device_index=where.device_index,
            local_devices=list(where.local_devices),
            master_addr=rendezvous[0],
            master_port=rendezvous[1],
            device=settings.device,
            timeout=self.timeout,
            basetemp=str(basetemp),
            tmp_path=str(self.test_dir),
            hypothesis_seed=seed,
            collective_check=settings.collective_check,
            mutant=self.mutant,
            record_collectives=bool(settings.mutate),
            debugger=debugger,
            last=last,
        )
