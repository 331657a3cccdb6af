"""The split ``--sprite-profile`` writes into a session's JSON report, summed and printed for the benches.

``bench/suite.py --profile`` and ``bench/cells.py --profile`` read it from their sessions' reports: the tests'
wall time, the fits' own steps, and every other phase (``docs/how-to/profile.md``), one column a session, so a
baseline's split and this checkout's read side by side.
"""

from __future__ import annotations

import json
from pathlib import Path


def profile_totals(report: Path) -> dict[str, float]:
    """The session's seconds by phase (``--sprite-profile``), summed over its tests, and ``wall``: their durations."""
    totals: dict[str, float] = {}
    for test in json.loads(report.read_text()).get("tests", []):
        if "profile" in test:
            totals["wall"] = totals.get("wall", 0.0) + test["duration"]
            for name, seconds in test["profile"].items():
                totals[name] = totals.get(name, 0.0) + seconds
    return totals


def print_profiles(profiles: dict[str, dict[str, float]], indent: str = "  ") -> None:
    """The sessions' splits side by side, one column a session: the tests' wall time, the fits' own steps,
    the share outside them, then every phase (seconds; a phase a session did not measure shows ``-``)."""
    shown = {label: dict(t) for label, t in profiles.items() if t.get("wall")}
    if not shown:
        return
    phases = [p for t in shown.values() for p in t if p not in ("wall", "steps")]
    phases = sorted(set(phases), key=phases.index)
    width = max(12, *(len(label) for label in shown))
    print(f"{indent}{'profile (s)':<24}" + "".join(f"{label:>{width + 2}}" for label in shown))
    rows: list[tuple[str, list[str]]] = [
        ("tests' wall time", [f"{t['wall']:.1f}" for t in shown.values()]),
        ("the fits' steps", [f"{t.get('steps', 0.0):.1f}" for t in shown.values()]),
        ("outside the steps", [_outside(t) for t in shown.values()]),
    ]
    rows += [(f"  {p}", [f"{t[p]:.1f}" if p in t else "-" for t in shown.values()]) for p in phases]
    for name, cells in rows:
        print(f"{indent}{name:<24}" + "".join(f"{c:>{width + 2}}" for c in cells))


def _outside(totals: dict[str, float]) -> str:
    wall, steps = totals["wall"], totals.get("steps", 0.0)
    return f"{wall - steps:.1f} ({100 * (wall - steps) / wall:.0f}%)"
