"""Diagnosis at scale (issue 27): the diagnosis ranks file at several world sizes, its figures side by side.

Runs ``tests/launch/diagnosis_suite.py`` (a hang with one odd rank, a rank that leaves a collective, tests that
pass, fail and crash) at each ``--ranks`` size in a local world and prints, per size: the session's wall time,
how long the hang alone held its world against its timeout, the roll call's length and whether it names the odd rank, how many
ranks' stacks were taken and how long the dump took (the harness's own figure), the ranks it names as missing
stacks, whether the leaver is named as the cause, and whether any leftover-process warning appeared (none may:
no test starts a process). The load average is printed before and after: on a shared machine times move with it.

Usage: ``python bench/diagnosis.py [--ranks 4,48,96] [--hang-timeout 60]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "launch"))

from diagnosis_suite import SUITE  # noqa: E402

HELD = re.compile(r"ranks was \d+% busy \(.* x ([\d.]+)s held\)")
NO_STACK = re.compile(r"^--- (.+): no stack ---$")
ROLL_CALL = re.compile(
    r"^where the (\d+) ranks were \(stacks of (\d+) of the \d+ ranks ended, taken within ([\d.]+)s\)"
)


def run(ranks: int, hang_timeout: int, root: Path) -> dict[str, Any]:
    """One session of the diagnosis file at ``ranks`` ranks; its figures."""
    folder = root / f"ranks{ranks}"
    folder.mkdir()
    (folder / "test_suite.py").write_text(SUITE.replace("HANG_TIMEOUT", str(hang_timeout)))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--ranks={ranks}", "--rank-grace=3"]
    cmd += ["--sprite-report=report.json", "test_suite.py"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    out = done.stdout
    (folder / "output.txt").write_text(out + done.stderr)
    lines = out.splitlines()
    header = next((i for i, line in enumerate(lines) if ROLL_CALL.match(line)), None)
    roll: list[str] = []
    stacks = dump = "-"
    if header is not None:
        end = next((i for i in range(header + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
        roll = lines[header:end]
        match = ROLL_CALL.match(lines[header])
        assert match is not None
        stacks, dump = f"{match.group(2)} of {match.group(1)}", f"{float(match.group(3)):.1f} s"
    # The hang alone, as its own session: how long its world was held, against its timeout (the session's
    # own start-up, long on a loaded machine, is left out).
    alone = subprocess.run(
        [*cmd[:-2], "test_suite.py", "-k", "hang"], cwd=folder, capture_output=True, text=True
    )
    held = HELD.search(alone.stdout)
    missing = [m.group(1) for m in (NO_STACK.match(line) for line in lines) if m]
    return {
        "ranks": ranks,
        "wall": f"{wall:.1f} s",
        "exit": done.returncode,
        "hang held its world": f"{held.group(1) if held else '?'} s (timeout {hang_timeout} s)",
        "roll call lines": len(roll),
        "odd rank named": any("rank 1: elsewhere" in line and "odd one out" in line for line in roll),
        "stacks taken": stacks,
        "dump took": dump,
        "no stack (named, with why)": "; ".join(missing) or "none",
        "leaver is the cause": any("rank 1 ended the test (passed) while" in line for line in lines),
        "leftover warnings": out.count("LeftoverProcessWarning"),
        "outcomes": lines[-1].strip("= ") if lines else "(no output)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4,48", help="comma-separated world sizes (default 4,48)")
    parser.add_argument("--hang-timeout", type=int, default=60, help="the hang test's timeout in seconds")
    args = parser.parse_args()
    sizes = [int(s) for s in args.ranks.split(",")]
    print(f"machine: {os.uname().nodename}, {os.cpu_count()} cores, load average {os.getloadavg()} before")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sprite-diagnosis-") as tmp:
        for n in sizes:
            rows.append(run(n, args.hang_timeout, Path(tmp)))
            print(f"  {n} ranks: {rows[-1]}", flush=True)
    print(f"load average {os.getloadavg()} after\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
