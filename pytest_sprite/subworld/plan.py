"""Kill plans: where a sub-world rank may die, and the rule that decides whether it dies there."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pytest_sprite.errors import SpriteUsageError

__all__ = ["KillAt", "KillPlan", "KillPoint"]


@dataclass(frozen=True, kw_only=True)
class KillPoint:
    """A point a sub-world rank reached: what a kill plan decides on."""

    rank: int
    """The rank in the sub-world."""
    event: str
    """What kind of point: ``"step"``, ``"file"``, or any name the code under test uses."""
    count: int
    """How many times this rank has reached ``event``, this time included (1-based)."""
    index: int | None
    """The index the code passed (``kill_point("step", 4)``), None when it passed none."""
    detail: str
    """Free text the code passed (a file name, a phase)."""

    def describe(self) -> str:
        """``step 4`` / ``file #3 (shard_0.distcp)``."""
        where = f"{self.event} {self.index}" if self.index is not None else f"{self.event} #{self.count}"
        return f"{where} ({self.detail})" if self.detail else where


@runtime_checkable
class KillPlan(Protocol):
    """Decides, at every kill point, whether this rank dies there. Must be picklable (module-level class)."""

    def should_kill(self, point: KillPoint) -> bool:
        """True to kill the rank at ``point``."""
        ...


@dataclass(frozen=True, kw_only=True)
class KillAt:
    """Kill at the ``at``-th point named ``event`` (its index when the code passes one), on ``ranks`` (all).

    ``KillAt(event="step", at=4)`` kills every rank at ``kill_point("step", 4)``;
    ``KillAt(event="file", at=3, ranks=(1,))`` kills rank 1 the third time it reaches ``kill_point("file")``.
    """

    event: str
    """Kill point name to match."""
    at: int
    """Index to match (the count of the event when the code passes no index)."""
    ranks: tuple[int, ...] | None = None
    """Sub-world ranks that die there; None for all."""
    signum: int = signal.SIGKILL
    """Signal the rank sends itself."""

    def __post_init__(self) -> None:
        if not isinstance(self.event, str) or not self.event:
            raise SpriteUsageError(f"KillAt(event={self.event!r}): give the kill point's name, e.g. 'step'")
        if not isinstance(self.at, int) or self.at < 0:
            raise SpriteUsageError(
                f"KillAt(at={self.at!r}): a non-negative int (an index or a 1-based count)"
            )

    def should_kill(self, point: KillPoint) -> bool:
        if point.event != self.event or (self.ranks is not None and point.rank not in self.ranks):
            return False
        return (point.index if point.index is not None else point.count) == self.at
