"""What a sub-world hands back: every rank's outcome, the same on every rank of the test that ran it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pytest_sprite.errors import SpriteError
from pytest_sprite.plumbing.collectives import whereabouts
from pytest_sprite.plumbing.process import exit_text
from pytest_sprite.plumbing.ranges import fold_ranks
from pytest_sprite.plumbing.roll_call import roll_call_lines
from pytest_sprite.plumbing.stacks import Stacks

from .plan import KillPoint

__all__ = ["RankOutcome", "Status", "SubworldError", "SubworldResult"]


Status = Literal["returned", "raised", "killed", "crashed", "ended", "timeout"]


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one rank of a sub-world ended, and everything it sent back."""

    rank: int
    """The rank in the sub-world."""
    status: Status
    """``returned``; ``raised`` (an exception, in ``error``); ``killed`` at its kill point; ``crashed``
    (died by a signal or exit code nobody planned); ``ended`` by the harness because another rank died;
    ``timeout``."""
    value: Any = None
    """What the function returned (``returned`` only)."""
    error: str = ""
    """The traceback (``raised``), or why the rank was ended."""
    events: tuple[tuple[str, Any], ...] = ()
    """Every ``emit(name, value)`` of the rank, in order, up to its end."""
    killed_at: KillPoint | None = None
    """Where a planned kill struck."""
    signum: int | None = None
    """Signal that ended the process, if any."""
    exitcode: int | None = None
    """Exit status, if it exited."""
    output: str = ""
    """Tail of what the rank printed (and its stacks on a timeout)."""
    stacks: Stacks = field(default_factory=Stacks)
    """Its stacks when the timeout took them (threads of frames: file, line, function), or why none came."""

    @property
    def ok(self) -> bool:
        """True when the function returned."""
        return self.status == "returned"

    def emitted(self, name: str) -> list[Any]:
        """The values emitted under ``name``, in order."""
        return [v for n, v in self.events if n == name]

    def describe(self) -> str:
        """One line: ``killed at step 4 (signal 9)``, ``raised ValueError: ...``."""
        if self.status == "returned":
            return "returned"
        if self.status == "killed" and self.killed_at is not None:
            return f"killed at {self.killed_at.describe()}" + (
                f" (signal {self.signum})" if self.signum else ""
            )
        if self.status == "raised":
            last = self.error.strip().splitlines()[-1] if self.error.strip() else "an exception"
            return f"raised {last}"
        if self.status == "crashed":
            return f"crashed ({exit_text(self.exitcode, self.signum)})"
        return f"{self.status}: {self.error}" if self.error else self.status

    def place(self) -> str:
        """Where the rank was when the sub-world ended, for the roll call: ``waiting in all_reduce (f.py:9)``.

        A rank that timed out is placed by its stack (no stack: why none came); any other by how it ended.
        """
        if self.status != "timeout":
            return self.describe()
        if self.stacks.missing is not None:
            return f"no stack: {self.stacks.missing}"
        where = whereabouts(self.stacks)
        return where.text() if where is not None else "no frame of its own in its stack"


class SubworldError(SpriteError, RuntimeError):
    """A sub-world's function did not return on every rank; ``result`` says what happened rank by rank."""

    def __init__(self, message: str, result: SubworldResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True, kw_only=True)
class SubworldResult:
    """Every rank's outcome, the same on every rank of the test that ran the sub-world."""

    name: str
    """What ran (the function's qualified name)."""
    outcomes: tuple[RankOutcome, ...]
    """One per sub-world rank, in rank order."""
    wall_s: float = 0.0
    """Seconds from the call to the last rank's end."""
    start_s: float = 0.0
    """Seconds from the call until every rank's process ran with the function loaded (the start-up cost)."""

    @property
    def size(self) -> int:
        """Ranks in the sub-world."""
        return len(self.outcomes)

    @property
    def ok(self) -> bool:
        """True when every rank returned."""
        return all(o.ok for o in self.outcomes)

    def values(self) -> list[Any]:
        """What every rank returned, in rank order; raises :class:`SubworldError` unless all returned."""
        if not self.ok:
            raise SubworldError(self.report(), self)
        return [o.value for o in self.outcomes]

    def killed(self) -> list[int]:
        """Ranks that died at their planned kill point."""
        return [o.rank for o in self.outcomes if o.status == "killed"]

    def report(self) -> str:
        """What happened, folded by rank: ``sub-world fit (4 ranks): ranks 0-3 killed at step 4``."""
        groups: dict[str, list[int]] = {}
        for o in self.outcomes:
            groups.setdefault(o.describe(), []).append(o.rank)
        lines = [f"sub-world {self.name} ({self.size} rank{'s' if self.size != 1 else ''}):"]
        lines += [f"  {fold_ranks(ranks)}: {what}" for what, ranks in groups.items()]
        if any(
            o.status == "timeout" for o in self.outcomes
        ):  # where each was, as a ranks test's timeout says
            lines += roll_call_lines({o.rank: o.place() for o in self.outcomes})
        for o in self.outcomes:
            if o.status in ("raised", "crashed", "timeout") and (o.error or o.output):
                lines.append(f"--- rank {o.rank} ---")
                if o.error:
                    lines.append(o.error.rstrip())
                if o.output.strip():
                    lines.append(o.output.rstrip())
        return "\n".join(lines)
