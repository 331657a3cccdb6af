"""How one rank's child ended a test, as its agent or the controller saw it, and what that says.

The merge of a test's reports and each rank's entry in the reports both read it: a rank that did not end
cleanly gets a made-up report for the phase it was in, saying why (:func:`describe_end`), and lasting
as long as that phase held it (:func:`held_until_end`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pytest import TestReport

from ..plumbing.collectives import waiting_collective
from ..plumbing.protocol import EndedBy
from ..plumbing.stacks import Stacks
from ..plumbing.timing import wall

__all__ = ["PHASES", "RankEnd", "describe_end", "held_until_end", "phase_in_progress", "signal_name"]


PHASES = ("setup", "call", "teardown")
Phase = Literal["setup", "call", "teardown"]


@dataclass(frozen=True, kw_only=True)
class RankEnd:
    """How one rank's child ended, as its agent saw it."""

    rank: int
    exitcode: int | None = None
    """Exit status when it exited by itself."""
    signal: int | None = None
    """Signal number when it was killed."""
    ended_by: EndedBy | None = None
    """Why the harness ended it (None: it ended by itself)."""
    detail: str = ""
    """Human-readable context for ``ended_by`` (timeout value, which ranks failed first)."""
    output_tail: str = ""
    """The last lines the child printed (uncaptured output, captured output of the running phase)."""
    stacks: Stacks = field(default_factory=Stacks)
    """Python stacks of every thread at the moment it was ended (faulthandler), as its agent read them."""
    interrupted: str = ""
    """What the rank did to end the session, when it did (``called pytest.exit('enough')``); empty otherwise."""
    ended_at: float = field(default_factory=wall, compare=False)
    """Wall-clock time (:func:`~pytest_sprite.plumbing.timing.wall`) when the controller learned of the end: the phase the rank was in
    held it until then, so a rank that timed out, crashed or was lost reports that phase's true duration."""

    @classmethod
    def of_exit(cls, rank: int, payload: Mapping[str, Any], *, interrupted: str = "") -> RankEnd:
        """Test rank ``rank``'s end, from its agent's ``child_exited`` frame (the frame's own rank is the agent's)."""
        return cls(
            rank=rank,
            interrupted=interrupted,
            stacks=Stacks.from_dict(payload["stacks"]),
            **{
                f.name: payload[f.name]
                for f in dataclasses.fields(cls)
                if f.name not in ("rank", "ended_at", "interrupted", "stacks")
            },
        )

    @property
    def clean(self) -> bool:
        """True when the child ran to its normal end."""
        return self.ended_by is None and self.signal is None and self.exitcode == 0


def phase_in_progress(reports: Sequence[TestReport]) -> Phase:
    """The phase a child was in when it ended, given the reports it had already sent."""
    done = [r.when for r in reports]
    if not done:
        return "setup"
    last = reports[-1]
    if last.when == "setup":
        return "call" if last.passed else "teardown"
    return "teardown"


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number with no name."""
    import signal as _signal

    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_end(end: RankEnd, phase: str) -> str:
    """One-paragraph explanation of an abnormal end, naming the rank, phase and cause."""
    who = f"rank {end.rank}"
    collective = waiting_collective(end.stacks)
    waiting = f", waiting in {collective}" if collective else ""
    if end.ended_by == "timeout":
        head = f"{who} was still running {end.detail} (during {phase}){waiting}; its Python stacks at that moment follow"
    elif end.ended_by == "peer_failed":
        head = (
            f"{who} was ended during {phase} {end.detail}{waiting}: it lost its peer; "
            "its Python stacks at that moment follow"
        )
    elif end.ended_by == "agent_lost":
        head = f"{who}: its rank agent was lost during {phase} ({end.detail})"
    elif end.ended_by == "agent_error":  # often every rank's, for one reason: the text folds over ranks
        head = f"its rank agent could not run the test: {end.detail}"
    elif end.interrupted:  # its own doing, not a crash: the session ends after this test
        head = f"{who} {end.interrupted} during {phase}, which ends the session"
    elif end.signal is not None:
        head = f"{who} CRASHED with signal {end.signal} ({signal_name(end.signal)}) during {phase}"
    else:
        head = f"{who} exited with code {end.exitcode} during {phase} before reporting its result"
    parts = [head]
    if end.stacks.present:
        parts.append(f"--- stacks of {who} (most recent call first) ---\n{end.stacks.text().rstrip()}")
    if end.output_tail.strip():
        parts.append(f"--- last output of {who} ---\n{end.output_tail.rstrip()}")
    return "\n".join(parts)


def held_until_end(
    reports: Sequence[TestReport], end: RankEnd, started_at: float | None
) -> tuple[float, float]:
    """When the phase a rank never finished began and ended: from its last report (else the test's start)
    until its end was known, the wall time that phase held the rank."""
    begun = reports[-1].stop if reports and reports[-1].stop else started_at
    if not begun:
        return (end.ended_at, end.ended_at)
    return (begun, max(begun, end.ended_at))
