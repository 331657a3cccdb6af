"""The evidence an assertion failure carries, so a planted fault can be told apart from any other failure.

Every sprite assertion raises an :class:`AssertionFailure` (an ``AssertionError``) whose ``failed``
lists the checks that failed, per arm, with the fault that arm carried. ``expect_fault_rejected``
reads only this, so later assertions (criterion v2, resume) plug in by raising the same type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ArmsResult", "AssertionFailure", "FailedCheck", "attributes"]


def attributes(obj: Any, *names: str) -> dict[str, Any]:
    """``{name: obj.name}`` for each of ``names``, in order: the plain part of a result's JSON-ready form."""
    return {name: getattr(obj, name) for name in names}


@dataclass(frozen=True, kw_only=True)
class FailedCheck:
    """One check that one arm failed."""

    arm: str
    """The arm's label as shown in the table, e.g. ``ddp (fault missing-rank)``."""
    check: str
    """Check name, e.g. ``pre_norm``; ``by=`` in ``expect_fault_rejected`` names these."""
    fault: str | None
    """Fault the failing arm carried (None for a clean arm)."""
    detail: str
    """Where and by how much: step, rank, value against the limit."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for reports."""
        return {"arm": self.arm, "check": self.check, "fault": self.fault, "detail": self.detail}


class ArmsResult:
    """A result that passes when every one of its ``arms`` passed (each arm has ``passed`` and ``failed``)."""

    arms: tuple[Any, ...]

    @property
    def passed(self) -> bool:
        """True when every arm passed every check."""
        return all(a.passed for a in self.arms)

    @property
    def failed(self) -> tuple[FailedCheck, ...]:
        """Every failed check of every arm, arm by arm."""
        return tuple(f for a in self.arms for f in a.failed)


class AssertionFailure(AssertionError):
    """A sprite assertion failed; ``failed`` says which checks on which arms, ``result`` holds all figures."""

    def __init__(self, message: str, *, failed: tuple[FailedCheck, ...], result: Any) -> None:
        super().__init__(message)
        self.failed = failed
        self.result = result
