"""Packing: which ranks tests start now, and on which agents.

The world (``--ranks`` agents) is an allocation the user pays for; a ``ranks(2)`` test on agents 0-1
of a world of 24 leaves 22 of them idle. The scheduler places each test on free agents so that
small tests run side by side. It is pure: it knows agents, the queue in collection order and the
tests in flight, and nothing of processes or clocks, so every rule below is unit-tested without them.

Policy (README "Packing"):

- **Collection order is the start order.** A test starts only after every test queued before it has
  started. When the head of the queue needs more agents than are free, nothing behind it starts until
  it has started: the head reserves the world as it frees up. So a whole-world test is never starved
  by a stream of small ones, and it waits at most for the tests already in flight, each bounded by its
  timeout. The price is idle agents during that wait; the utilisation line measures it.
- **One node when the test fits a node.** A ``ranks(n)`` test with ``n`` no larger than a node takes
  ``n`` free agents of one node, so its collectives stay on the node, as they do when it runs alone on
  agents ``0..n-1``. Of the nodes with room it takes the one with the fewest free agents (best fit), so
  that larger holes stay for larger tests, and there its lowest ranks. A test larger than every node
  takes whole nodes first, the freest first, so it spans as few nodes as it can.
- **Test ranks follow the agents' order**: test rank ``r`` runs on ``agents[r]``, agents sorted by
  node, then rank, so a test's consecutive ranks share a node as a launcher places them.
- ``pack=False`` (``--pack=off``) runs one test at a time on agents ``0..n-1``, exactly as before
  packing existed.
- ``stop()`` (``-x``, ``--maxfail``, an interrupt): the tests in flight finish; nothing queued starts.
- **Agents join as they connect** (``join``). Until the whole world has joined, a test starts only on
  agents of one node that have joined (which shows that it fits a node); a test larger than every node
  seen so far, a whole-world test, and with ``pack=False`` a test whose agents ``0..n-1`` have not all
  joined wait for the rest. So a straggling agent delays only the tests that need it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Scheduler", "Slot", "Start", "Utilisation"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One rank agent as the scheduler sees it."""

    rank: int
    """The agent's rank in the launched world."""
    node: int
    """The node it runs on, as an index (agents with the same index share a node)."""


@dataclass(frozen=True)
class Start(Generic[K]):
    """A test to start now: test rank ``r`` runs on agent ``agents[r]``."""

    key: K
    agents: tuple[int, ...]


class Scheduler(Generic[K]):
    """Places queued ranks tests on free agents; see the module docstring for the policy."""

    def __init__(self, slots: Iterable[Slot], *, pack: bool = True, world_size: int | None = None) -> None:
        """``slots``: the agents that have joined; ``world_size``: how many the world has (default: those)."""
        self.pack = pack
        self._node_of: dict[int, int] = {}
        self._capacity: dict[int, int] = {}
        self._largest_node = 0
        self._free: set[int] = set()
        self._world_size = world_size
        for slot in slots:
            self.join(slot)
        if self._world_size is None:
            self._world_size = len(self._node_of)
        if self._world_size < 1:
            raise ValueError("a scheduler needs at least one agent")
        self._queue: deque[tuple[K, int]] = deque()
        self._queued: set[K] = set()
        self._running: dict[K, tuple[int, ...]] = {}
        self.stopped = False

    # -- state -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Agents the world has, joined or not."""
        return self._world_size or len(self._node_of)

    @property
    def complete(self) -> bool:
        """True once every agent of the world has joined."""
        return len(self._node_of) == self.world_size

    @property
    def free(self) -> frozenset[int]:
        """Agents running no test."""
        return frozenset(self._free)

    @property
    def in_flight(self) -> Mapping[K, tuple[int, ...]]:
        """Tests started and not finished, with their agents."""
        return dict(self._running)

    @property
    def pending(self) -> tuple[K, ...]:
        """Tests queued and not started, in start order."""
        return tuple(key for key, _ in self._queue)

    @property
    def done(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self._queue and not self._running

    # -- changes -----------------------------------------------------------------------------

    def join(self, slot: Slot) -> None:
        """An agent has connected: it takes tests from now on."""
        if slot.rank in self._node_of:
            raise ValueError(f"agent rank {slot.rank} is given twice")
        if self._world_size is not None and len(self._node_of) >= self._world_size:
            raise ValueError(f"agent rank {slot.rank} joins a world of {self._world_size} that is complete")
        self._node_of[slot.rank] = slot.node
        self._capacity[slot.node] = self._capacity.get(slot.node, 0) + 1
        self._largest_node = max(self._largest_node, self._capacity[slot.node])
        self._free.add(slot.rank)

    def submit(self, key: K, size: int) -> None:
        """Queue a test that needs ``size`` agents, behind every test queued before it."""
        if size < 1 or size > self.world_size:
            raise ValueError(
                f"test {key!r} needs {size} ranks; a world of {self.world_size} can place 1 to {self.world_size}"
            )
        if key in self._queued or key in self._running:
            raise ValueError(f"test {key!r} is already queued or running")
        self._queue.append((key, size))
        self._queued.add(key)

    def starts(self) -> list[Start[K]]:
        """Take the tests that can start now off the queue, in order, and mark their agents busy."""
        started: list[Start[K]] = []
        while self._queue and not self.stopped:
            if not self.pack and self._running:
                break
            key, size = self._queue[0]
            agents = self._place(size)
            if agents is None:
                break  # the head reserves: nothing behind it starts before it
            self._queue.popleft()
            self._queued.discard(key)
            self._free.difference_update(agents)
            self._running[key] = agents
            started.append(Start(key, agents))
        return started

    def finish(self, key: K) -> tuple[int, ...]:
        """A test in flight ended: its agents are free again. Returns them."""
        agents = self._running.pop(key, None)
        if agents is None:
            raise ValueError(f"test {key!r} is not in flight")
        self._free.update(agents)
        return agents

    def stop(self) -> list[K]:
        """Start nothing more (``-x``); the tests in flight finish. Returns the tests that will not start."""
        self.stopped = True
        dropped = [key for key, _ in self._queue]
        self._queue.clear()
        self._queued.clear()
        return dropped

    # -- placement ---------------------------------------------------------------------------

    def _place(self, size: int) -> tuple[int, ...] | None:
        """The agents for a test of ``size`` ranks now, or None when it must wait."""
        if not self.pack:
            wanted = tuple(sorted(self._node_of)[:size])
            if not self.complete and wanted != tuple(range(size)):
                return None  # agents 0..n-1 have not all joined
            return wanted if self._free.issuperset(wanted) else None
        by_node: dict[int, list[int]] = {}
        for rank in sorted(self._free):
            by_node.setdefault(self._node_of[rank], []).append(rank)
        if size <= self._largest_node:
            roomy = [node for node, ranks in by_node.items() if len(ranks) >= size]
            if not roomy:
                return None
            best = min(roomy, key=lambda node: (len(by_node[node]), node))
            return tuple(by_node[best][:size])
        if not self.complete or len(self._free) < size:
            return None
        chosen: list[int] = []
        for node in sorted(by_node, key=lambda node: (-len(by_node[node]), node)):
            chosen.extend(by_node[node][: size - len(chosen)])
            if len(chosen) == size:
                break
        return tuple(sorted(chosen, key=lambda rank: (self._node_of[rank], rank)))


class Utilisation:
    """What the world did: busy rank-seconds over world x held time, and the most tests side by side.

    The caller passes the times (the controller's monotonic clock), so the arithmetic is tested
    without one. The world is held from ``open`` (the launch) to ``close`` (the agents are shut down);
    a session that replaces a lost world holds several in turn and their times add up.
    """

    def __init__(self) -> None:
        self._open: tuple[int, float] | None = None
        self._running: dict[Hashable, tuple[int, float]] = {}
        self.held_rank_seconds = 0.0
        self.held_seconds = 0.0
        self.busy_rank_seconds = 0.0
        self.tests = 0
        self.max_side_by_side = 0
        self.world_size = 0

    def open(self, world_size: int, now: float) -> None:
        """A world of ``world_size`` agents was launched at ``now``."""
        if self._open is not None:
            raise ValueError("the world is already open; close it first")
        self._open = (world_size, now)
        self.world_size = max(self.world_size, world_size)

    def started(self, key: Hashable, size: int, now: float) -> None:
        """A test of ``size`` ranks started at ``now``."""
        if self._open is None:
            raise ValueError(f"test {key!r} started while no world is open")
        if key in self._running:
            raise ValueError(f"test {key!r} started twice")
        self._running[key] = (size, now)
        self.tests += 1
        self.max_side_by_side = max(self.max_side_by_side, len(self._running))

    def finished(self, key: Hashable, now: float) -> None:
        """A test that started ended at ``now``."""
        size, began = self._running.pop(key)
        self.busy_rank_seconds += size * max(0.0, now - began)

    def close(self, now: float) -> None:
        """The world was shut down at ``now``; tests still counted as running end here."""
        if self._open is None:
            return
        for key in list(self._running):
            self.finished(key, now)
        world, began = self._open
        self._open = None
        self.held_seconds += max(0.0, now - began)
        self.held_rank_seconds += world * max(0.0, now - began)

    @property
    def ratio(self) -> float | None:
        """Busy over held rank-seconds; None before any world was held."""
        if self.held_rank_seconds <= 0:
            return None
        return self.busy_rank_seconds / self.held_rank_seconds

    def line(self, *, pack: bool = True) -> str | None:
        """The end-of-session line; None when no ranks test ran."""
        ratio = self.ratio
        if ratio is None or self.tests == 0:
            return None
        tests = f"{self.tests} ranks test{'s' if self.tests != 1 else ''}"
        how = f"at most {self.max_side_by_side} side by side" + ("" if pack else " (--pack=off)")
        return (
            f"sprite: the world of {self.world_size} ranks was {ratio:.0%} busy "
            f"({self.busy_rank_seconds:.1f} busy rank-seconds of {self.world_size} x {self.held_seconds:.1f}s held); "
            f"{tests}, {how}"
        )
