"""The main job timed side by side in one run: without and with reuse, or another checkout and this one.

Runs ``pytest --pyargs pytest_sprite.suite --ranks=W`` twice, each in its own basetemp and folder: by default
with ``--sprite-reuse=off`` and with ``--sprite-reuse=auto``; with ``--baseline-python PY`` (a Python whose
environment has an earlier pytest-sprite installed, e.g. a venv with ``pip install -e <worktree of a commit>``)
that installation's session and this one's, both with reuse. It prints both wall times, their ratio and the arm
and role runs each session computed (counted by the store in ``<basetemp>/sprite-store/runs.log``); with
``--profile`` this checkout's sessions run with ``--sprite-profile`` and the bench prints where their tests'
time went, the fits' own steps against the rest. It then compares the two ``--sprite-report`` documents: every
test's outcome and every assertion's figures must be the same (times, paths and sources left out). The load
average is printed before and after: on a shared machine the times move with it.

Usage: ``python bench/suite.py [--ranks 4] [-k EXPR] [--order off,auto] [--baseline-python PY] [--profile]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from profile_split import print_profile, profile_totals

from pytest_sprite.recipes.clean_references import STORE_DIR, run_counts, tally

VOLATILE = (
    "profile",
    "wall",
    "duration",
    "time",
    "timing",
    "start",
    "stop",
    "source",
    "path",
    "dir",
    "created",
    "pid",
    "host",
    "busy",
)
"""Report keys whose values differ between two runs of the same checks (left out of the comparison)."""


def run(
    label: str, python: str, args: list[str], ranks: int, root: Path, select: str | None
) -> dict[str, Any]:
    """One session of the main job with ``python`` and extra ``args``; its wall time, store counts and report."""
    root.mkdir(parents=True)
    basetemp, report = root / "basetemp", root / "report.json"
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "pytest_sprite.suite"]
    cmd += [f"--ranks={ranks}", f"--basetemp={basetemp}", f"--sprite-report={report}", *args]
    if select:
        cmd += ["-k", select]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(f"  {label}: {wall:7.1f} s  exit {done.returncode}  {tail[0]}", flush=True)
    if done.returncode not in (0, 1):
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
    return {"wall": wall, "counts": run_counts(basetemp / STORE_DIR), "report": report, "rc": done.returncode}


def comparable(value: Any) -> Any:
    """The report without the values that differ between two runs of the same checks."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if not any(word in k.lower() for word in VOLATILE)}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def verdicts(report: Path) -> dict[str, Any]:
    document = json.loads(report.read_text())
    return {t["nodeid"]: comparable(t) for t in document.get("tests", [])}


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two report values first differ, as a key path with both values (shortened)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path or '.'}: first {str(a)[:120]!r} / second {str(b)[:120]!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "-k", dest="select", default=None, help="pytest -k expression (default: the whole suite)"
    )
    parser.add_argument("--order", default="off,auto", help="which session runs first (default off,auto)")
    parser.add_argument("--keep", type=Path, default=None, help="run in this new folder and keep the reports")
    parser.add_argument(
        "--baseline-python",
        default=None,
        help="a Python whose environment has another pytest-sprite installed (an earlier commit's venv): "
        "its session and this one's, both with --sprite-reuse=auto, instead of off against auto",
    )
    parser.add_argument(
        "--profile", action="store_true", help="this checkout's sessions with --sprite-profile"
    )
    args = parser.parse_args()
    print(
        f"main job: pytest --pyargs pytest_sprite.suite --ranks={args.ranks}"
        + (f" -k {args.select!r}" if args.select else "")
    )
    print(f"  machine: {os.uname().nodename}, {os.cpu_count()} cores, load average {os.getloadavg()} before")
    profile = ["--sprite-profile"] if args.profile else []
    if args.baseline_python:
        sessions = [("baseline", args.baseline_python, []), ("now", sys.executable, profile)]
        sessions = [
            (f"{label} (--sprite-reuse=auto)", py, ["--sprite-reuse=auto", *extra])
            for label, py, extra in sessions
        ]
    else:
        sessions = [
            (f"--sprite-reuse={m}", sys.executable, [f"--sprite-reuse={m}", *profile])
            for m in args.order.split(",")
        ]
    results: dict[str, dict[str, Any]] = {}
    if args.keep is not None:
        args.keep.mkdir(parents=True)  # a new folder: never mix with (or overwrite) an earlier run's reports
    with tempfile.TemporaryDirectory(prefix="sprite-bench-suite-") as tmp:
        if args.keep is not None:
            tmp = str(args.keep.resolve())
        for i, (label, python, extra) in enumerate(sessions):
            results[label] = run(label, python, extra, args.ranks, Path(tmp) / f"s{i}", args.select)
        first, second = results[sessions[0][0]], results[sessions[-1][0]]
        before, after = verdicts(first["report"]), verdicts(second["report"])
        same = before == after
        differing = sorted(n for n, v in before.items() if after.get(n) != v)
        profiles = {label: profile_totals(r["report"]) for label, r in results.items()}
    print(f"  load average {os.getloadavg()} after")
    for label, r in results.items():
        print(f"  {label}: {r['wall']:7.1f} s, {tally(r['counts']) or 'nothing computed'}")
    print(f"  ratio: {second['wall'] / first['wall']:.2f} (second / first)")
    for label, totals in profiles.items():
        print_profile(label, totals)
    print(
        "  verdicts and figures: "
        + ("the same" if same else f"DIFFER in {len(differing)} tests: {differing[:5]}")
    )
    for nodeid in differing[:3]:
        print(f"    {nodeid}: first difference at {first_difference(before[nodeid], after.get(nodeid))}")
    return 0 if same and first["rc"] == second["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
