"""``--sprite-profile``'s table: each ranks test's time by phase, and how much of it is the fits' own steps.

The phases are counted on rank 0 of each test (``plumbing/phases.py``) and travel on its reports; ``rest``
is what no phase counted (the test's own code, its world's rendezvous, pytest). A test's phases and
``rest`` add up to its duration, the wall time its ranks were held.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pytest_sprite.plumbing.phases import PHASES
from pytest_sprite.report.logged_results import TestEntry

__all__ = ["profile_of", "write_profile_table"]


def profile_of(entry: TestEntry) -> dict[str, float]:
    """The test's seconds by phase, in :data:`PHASES` order (others a project measured after them), and
    ``rest``: its duration less every phase."""
    profile = entry.profile or {}
    named = [p for p in PHASES if p in profile] + [p for p in profile if p not in PHASES]
    seconds = {p: round(profile[p], 3) for p in named}
    seconds["rest"] = round(max(entry.duration - sum(profile.values()), 0.0), 3)
    return seconds


def write_profile_table(
    terminalreporter: Any, entries: Iterable[TestEntry], session_s: float | None = None
) -> None:
    """One row per profiled test, then the session's totals and the share of its time outside the steps;
    with ``session_s`` (the session's wall time so far), the share of that outside the steps too: its start,
    collection and agents are in no test."""
    profiled = [e for e in entries if e.profile is not None]
    if not profiled:
        return
    rows = {e.nodeid: profile_of(e) for e in profiled}
    columns = [p for p in PHASES if any(p in r for r in rows.values())]
    columns += [*sorted({p for r in rows.values() for p in r} - set(columns) - {"rest"}), "rest"]
    width = max(len("test"), *(len(n) for n in rows))
    titles = ["wall s", *columns, "outside steps"]
    terminalreporter.write_sep("=", "sprite profile: seconds by phase (rank 0)")
    terminalreporter.write_line(f"{'test':<{width}}  " + "  ".join(f"{t:>9}" for t in titles))
    totals: dict[str, float] = {}
    wall = 0.0
    for entry in profiled:
        row = rows[entry.nodeid]
        wall += entry.duration
        for c in columns:
            totals[c] = totals.get(c, 0.0) + row.get(c, 0.0)
        terminalreporter.write_line(_line(entry.nodeid, width, entry.duration, row, columns))
    terminalreporter.write_line(_line("all profiled tests", width, wall, totals, columns))
    steps = totals.get("steps", 0.0)
    share = 100.0 * (wall - steps) / wall if wall else 0.0
    terminalreporter.write_line(
        f"sprite: profile: {len(profiled)} ranks tests, {wall:.1f} s; the fits' steps {steps:.1f} s, "
        f"outside them {share:.0f}% of the wall time"
    )
    if session_s:
        terminalreporter.write_line(
            f"sprite: profile: the session {session_s:.1f} s of wall time (its start, collection and agents are "
            f"in no test); the fits' steps {steps:.1f} s, outside them {100.0 * (session_s - steps) / session_s:.0f}%"
        )


def _line(name: str, width: int, wall: float, row: dict[str, float], columns: list[str]) -> str:
    steps = row.get("steps", 0.0)
    outside = f"{100.0 * (wall - steps) / wall:.0f}%" if wall else "-"
    cells = [f"{wall:9.2f}", *(f"{row[c]:9.2f}" if c in row else f"{'-':>9}" for c in columns)]
    cells.append(f"{outside:>13}")
    return f"{name:<{width}}  " + "  ".join(cells)
