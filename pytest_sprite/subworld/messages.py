"""What a sub-world rank tells the process that started it: one typed record per message.

A rank sends them, pickled, over its channel as they happen (so a kill loses nothing sent before it);
the host reads them into the rank's outcome. Records, not tuples, so both ends name the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .plan import KillPoint

__all__ = ["Emitted", "Killed", "Profiled", "Raised", "RankMessage", "Ready", "Recorded", "Returned"]


@dataclass(frozen=True)
class Ready:
    """The rank's process runs and has its function loaded: its start-up ends here."""


@dataclass(frozen=True)
class Emitted:
    """``emit(name, value)`` in the rank's function."""

    name: str
    value: Any


@dataclass(frozen=True)
class Returned:
    """The function returned ``value``."""

    value: Any


@dataclass(frozen=True)
class Raised:
    """The function (or joining the sub-world) raised; ``error`` is the formatted traceback."""

    error: str


@dataclass(frozen=True)
class Killed:
    """The kill plan killed the rank at ``at``, by ``signum``, sent just before the signal."""

    at: KillPoint
    signum: int


@dataclass(frozen=True)
class Recorded:
    """Under ``--sprite-mutate``: what the rank's collectives and fits recorded (``MutationRun.ops``), sent
    before it returns or raises; the host adds it to its own record, which its test sends to the controller."""

    ops: tuple[str, ...]


@dataclass(frozen=True)
class Profiled:
    """Under ``--sprite-profile``: the rank's seconds by phase (``plumbing/phases.py``), sent before it returns
    or raises; the host counts them inside its own ``fork`` phase, which its test reports."""

    totals: dict[str, float]


RankMessage = Ready | Emitted | Recorded | Profiled | Returned | Raised | Killed
