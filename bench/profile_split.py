"""The split ``--sprite-profile`` writes into a session's JSON report, summed and printed for the benches.

``bench/suite.py --profile`` and ``bench/cells.py --profile`` read it from their sessions' reports: the tests'
wall time, the fits' own steps, and every other phase (``docs/how-to/profile.md``), one column a session, so a
baseline's split and this checkout's read side by side.
"""

from __future__ import annotations

import json
from pathlib import Path


def profile_totals(report: Path) -> dict[str, float]:
    """The session's seconds by phase (``--sprite-profile``), summed over its tests, ``wall``: their durations,
    and ``session``: the session's own wall time (its start, collection and agents are in no test)."""
    document = json.loads(report.read_text())
    totals: dict[str, float] = {}
    for test in document.get("tests", []):
        if "profile" in test:
            totals["wall"] = totals.get("wall", 0.0) + test["duration"]
            for name, seconds in test["profile"].items():
                totals[name] = totals.get(name, 0.0) + seconds
    if totals and document.get("duration"):
        totals["session"] = document["duration"]
    return totals


def print_profiles(profiles: dict[str, dict[str, float]], indent: str = "  ") -> None:
    """The sessions' splits side by side, one column a session: the tests' wall time, the shares outside
    the fits (Trainer, set-up, steps, teardown) and outside their steps, the steps, then every phase
    (seconds; a phase a session did not measure shows ``-``)."""
    shown = {label: dict(t) for label, t in profiles.items() if t.get("wall")}
    if not shown:
        return
    phases = [p for t in shown.values() for p in t if p not in ("wall", "steps", "session")]
    phases = sorted(set(phases), key=phases.index)
    width = max(12, *(len(label) for label in shown))
    print(f"{indent}{'profile (s)':<24}" + "".join(f"{label:>{width + 2}}" for label in shown))
    rows: list[tuple[str, list[str]]] = [
        ("session wall time", [f"{t['session']:.1f}" if "session" in t else "-" for t in shown.values()]),
        ("  outside the fits", [_outside(t, "session", FIT_PHASES) for t in shown.values()]),
        ("  outside the steps", [_outside(t, "session") for t in shown.values()]),
        ("tests' wall time", [f"{t['wall']:.1f}" for t in shown.values()]),
        ("  outside the fits", [_outside(t, "wall", FIT_PHASES) for t in shown.values()]),
        ("  outside the steps", [_outside(t, "wall") for t in shown.values()]),
        ("the fits' steps", [f"{t.get('steps', 0.0):.1f}" for t in shown.values()]),
        ("the tests' other phases", ["" for _ in shown]),
    ]
    rows += [(f"  {p}", [f"{t[p]:.1f}" if p in t else "-" for t in shown.values()]) for p in phases]
    for name, cells in rows:
        print((f"{indent}{name:<24}" + "".join(f"{c:>{width + 2}}" for c in cells)).rstrip())


FIT_PHASES = ("trainer", "fit setup", "steps", "teardown")
"""A fit, from building its ``Trainer`` to its teardown: what the phases outside it are measured against."""


def _outside(totals: dict[str, float], of: str, inside: tuple[str, ...] = ("steps",)) -> str:
    """The seconds of ``of`` (the session's or the tests' wall time) outside the ``inside`` phases (the fits'
    steps by default), and their share."""
    if not totals.get(of):
        return "-"
    wall = totals[of]
    fits = sum(totals.get(name, 0.0) for name in inside)
    return f"{wall - fits:.1f} ({100 * (wall - fits) / wall:.0f}%)"
