"""The split ``--sprite-profile`` writes into a session's JSON report, summed and printed for the benches.

``bench/suite.py --profile`` and ``bench/cells.py --profile`` read it from their sessions' reports: the tests'
wall time, the fits' own steps, and every other phase (``docs/how-to/profile.md``).
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


def print_profile(label: str, totals: dict[str, float]) -> None:
    wall = totals.pop("wall", 0.0)
    if not wall:
        return
    steps = totals.get("steps", 0.0)
    split = ", ".join(f"{name} {seconds:.1f}" for name, seconds in totals.items())
    print(
        f"  {label}: tests {wall:.1f} s, the fits' steps {steps:.1f} s, outside them {100 * (wall - steps) / wall:.0f}%"
    )
    print(f"    by phase (s): {split}")
