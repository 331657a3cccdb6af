"""The main job with and without the session store of clean results, timed side by side in one run (issue 22).

Runs ``pytest --pyargs pytest_sprite.suite --ranks=W`` twice, with ``--sprite-reuse=off`` and with
``--sprite-reuse=auto``, each in its own basetemp, and prints both wall times, the speed-up, and the arm and role
runs each session computed (counted by the store in ``<basetemp>/sprite-store/runs.log``). It then compares the
two ``--sprite-report`` documents: every test's outcome and every assertion's figures must be the same (times,
paths and sources left out), as reuse changes only what is computed, never what is compared. The load average is
printed before and after: on a shared machine the times move with it.

Usage: ``python bench/suite.py [--ranks 4] [-k EXPR] [--order off,auto]``.
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

from pytest_sprite.recipes.clean_references import STORE_DIR, run_counts, tally

VOLATILE = (
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


def run(mode: str, ranks: int, root: Path, select: str | None) -> dict[str, Any]:
    basetemp, report = root / f"reuse-{mode}", root / f"reuse-{mode}.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "pytest_sprite.suite"]
    cmd += [
        f"--ranks={ranks}",
        f"--sprite-reuse={mode}",
        f"--basetemp={basetemp}",
        f"--sprite-report={report}",
    ]
    if select:
        cmd += ["-k", select]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(f"  --sprite-reuse={mode}: {wall:7.1f} s  exit {done.returncode}  {tail[0]}", flush=True)
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
    return f"{path or '.'}: off {str(a)[:120]!r} / auto {str(b)[:120]!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "-k", dest="select", default=None, help="pytest -k expression (default: the whole suite)"
    )
    parser.add_argument("--order", default="off,auto", help="which session runs first (default off,auto)")
    parser.add_argument("--keep", type=Path, default=None, help="run in this new folder and keep the reports")
    args = parser.parse_args()
    print(
        f"main job: pytest --pyargs pytest_sprite.suite --ranks={args.ranks}"
        + (f" -k {args.select!r}" if args.select else "")
    )
    print(f"  machine: {os.uname().nodename}, {os.cpu_count()} cores, load average {os.getloadavg()} before")
    results: dict[str, dict[str, Any]] = {}
    if args.keep is not None:
        args.keep.mkdir(parents=True)  # a new folder: never mix with (or overwrite) an earlier run's reports
    with tempfile.TemporaryDirectory(prefix="sprite-bench-suite-") as tmp:
        if args.keep is not None:
            tmp = str(args.keep.resolve())
        for mode in args.order.split(","):
            results[mode] = run(mode, args.ranks, Path(tmp), args.select)
        off, auto = results["off"], results["auto"]
        before, after = verdicts(off["report"]), verdicts(auto["report"])
        same = before == after
        differing = sorted(n for n, v in before.items() if after.get(n) != v)
    print(f"  load average {os.getloadavg()} after")
    for mode in ("off", "auto"):
        print(
            f"  {mode:>4}: {results[mode]['wall']:7.1f} s, {tally(results[mode]['counts']) or 'nothing computed'}"
        )
    print(f"  speed-up: {off['wall'] / auto['wall']:.2f}x (target: at least 2.5x)")
    print(
        "  verdicts and figures: "
        + ("the same" if same else f"DIFFER in {len(differing)} tests: {differing[:5]}")
    )
    for nodeid in differing[:3]:
        print(f"    {nodeid}: first difference at {first_difference(before[nodeid], after.get(nodeid))}")
    return 0 if same and off["rc"] == auto["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
