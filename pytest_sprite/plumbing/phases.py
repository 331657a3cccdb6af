"""Where a ranks test's time goes, by phase: one clock per process, for ``--sprite-profile``.

A phase is a named stretch of a rank's wall time: starting a sub-world, joining its process group,
building Lightning's ``Trainer``, a fit's set-up, its steps, its teardown, reading and sharing records,
building the probe model, judging. Phases nest; each second is counted once, in the innermost phase open at
the time, so the totals add up to the time they cover. A sub-world rank's totals travel back to the rank
that started it (:func:`absorb`), which counts them inside its own open phase instead of twice.

Off (the default) :func:`phase` costs one flag check; nothing is recorded or sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from .timing import perf_counter

__all__ = [
    "PHASES",
    "PROFILE_PROPERTY",
    "absorb",
    "enable",
    "enabled",
    "enter",
    "leave",
    "phase",
    "take",
    "take_lifetime",
]

PHASES = {
    "fork": "starting a sub-world's processes, their start-up, waiting for the slowest rank (a plain test's: the exits)",
    "join": "a sub-world rank joining its process group",
    "sub-world other": "a sub-world rank's time in no other phase (its model and rows, the function's own code)",
    "trainer": "building Lightning's Trainer and its strategy",
    "fit setup": "a fit up to its first step (process groups, wrapping the model, the optimizer)",
    "steps": "the fit's own training steps",
    "teardown": "a fit after its last step",
    "probe": "drawing the recipe's rows and building its probe model",
    "records": "gathering, reading and sharing records between ranks and the session store",
    "judging": "comparing the records against the rule",
}
"""The phases the harness measures, in the order a report lists them; the rest of a test is ``rest``."""

PROFILE_PROPERTY = "sprite.profile"
"""The user property a rank's report carries its phase totals in (setup, call and teardown each their own)."""


@dataclass
class _Open:
    name: str
    started: float
    inner: float = 0.0
    """Seconds of this phase spent in phases nested in it (counted there)."""


@dataclass
class _Clock:
    on: bool = False
    totals: dict[str, float] = field(default_factory=dict)
    stack: list[_Open] = field(default_factory=list)


_clock = _Clock()


def enable(on: bool) -> None:
    """Turn the clock on or off for this process (and the processes it forks); clears what it held."""
    _clock.on = on
    _clock.totals = {}
    _clock.stack = []


def enabled() -> bool:
    return _clock.on


def enter(name: str) -> None:
    """Open phase ``name`` (for hooks that start and end in different calls, as Lightning's callbacks do)."""
    if _clock.on:
        _clock.stack.append(_Open(name, perf_counter()))


def leave(name: str) -> None:
    """Close phase ``name`` and any phase opened inside it and left open (a fit that raised mid-step)."""
    if not _clock.on or not any(o.name == name for o in _clock.stack):
        return
    now = perf_counter()
    while _clock.stack:
        done = _clock.stack.pop()
        spent = now - done.started
        _count(done.name, spent - done.inner)
        if _clock.stack:
            _clock.stack[-1].inner += spent
        if done.name == name:
            return


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the wall time of the block as ``name`` (less what nested phases count)."""
    if not _clock.on:
        yield
        return
    enter(name)
    try:
        yield
    finally:
        leave(name)


def absorb(totals: Mapping[str, float]) -> None:
    """Add another process's totals, spent while this one waited in its open phase (a sub-world rank's)."""
    if not _clock.on:
        return
    for name, seconds in totals.items():
        _count(name, seconds)
    if _clock.stack:
        _clock.stack[-1].inner += sum(totals.values())


def take_lifetime(started: float, rest: str) -> dict[str, float]:
    """:func:`take`, with the time since ``started`` that no phase counted under ``rest``."""
    totals = take()
    totals[rest] = round(max(perf_counter() - started - sum(totals.values()), 0.0), 6)
    return totals


def take() -> dict[str, float]:
    """The totals so far (phases still open are left running), and a fresh start for the next ones."""
    totals, _clock.totals = _clock.totals, {}
    return {name: round(seconds, 6) for name, seconds in totals.items()}


def _count(name: str, seconds: float) -> None:
    _clock.totals[name] = _clock.totals.get(name, 0.0) + max(seconds, 0.0)
