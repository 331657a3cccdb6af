"""The main job timed side by side in one run: without and with reuse, or another checkout and this one.

Runs ``pytest --pyargs pytest_sprite.suite --ranks=W`` twice, each in its own basetemp and folder: by default
with ``--sprite-reuse=off`` and with ``--sprite-reuse=auto``; with ``--baseline CHECKOUT`` (another checkout of
the plugin, e.g. ``git worktree add /tmp/base <commit>``: first on ``PYTHONPATH``, as ``bench/dispatch.py``
runs it) or ``--baseline-python PY`` (a Python whose environment has an earlier pytest-sprite installed, for a
checkout older than an entry point this one installs) that checkout's session and this one's, both with
reuse. It prints both wall times, their ratio and the arm and role runs each session computed (counted by the
store in ``<basetemp>/sprite-store/runs.log``); with ``--profile`` the sessions run with ``--sprite-profile``
(a baseline that has the option too) and the bench prints where their tests' time went, the fits' own steps
against the rest, side by side. It then compares the two ``--sprite-report`` documents: every test's outcome
and every assertion's figures must be the same (times, paths and sources left out). The load average is
printed before and after: on a shared machine the times move with it.

Usage: ``python bench/suite.py [--ranks 4] [-k EXPR] [--order off,auto] [--baseline CHECKOUT | --baseline-python PY]
[--profile]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baseline import baseline_env, checkout_of, print_comparison, takes_option
from profile_split import print_profiles, profile_totals

from pytest_sprite.recipes.clean_references import STORE_DIR, run_counts, tally


@dataclass(frozen=True)
class Session:
    """One session of the bench: what it is called, the Python that runs it, its extra arguments and
    environment (``None``: this one's)."""

    label: str
    python: str
    args: list[str]
    env: dict[str, str] | None = None


def run(session: Session, ranks: int, root: Path, select: str | None) -> dict[str, Any]:
    """One session of the main job; its wall time, store counts and report."""
    root.mkdir(parents=True)
    basetemp, report = root / "basetemp", root / "report.json"
    cmd = [session.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "pytest_sprite.suite"]
    cmd += [f"--ranks={ranks}", f"--basetemp={basetemp}", f"--sprite-report={report}", *session.args]
    if select:
        cmd += ["-k", select]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, env=session.env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(f"  {session.label}: {wall:7.1f} s  exit {done.returncode}  {tail[0]}", flush=True)
    if done.returncode not in (0, 1):
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
    return {"wall": wall, "counts": run_counts(basetemp / STORE_DIR), "report": report, "rc": done.returncode}


def sessions(args: argparse.Namespace, cwd: Path) -> list[Session]:
    """The two sessions: off and on (in ``--order``), or a baseline's and this checkout's, both with reuse."""
    profile = ["--sprite-profile"] if args.profile else []
    if args.baseline is None and args.baseline_python is None:
        return [
            Session(f"--sprite-reuse={m}", sys.executable, [f"--sprite-reuse={m}", *profile])
            for m in args.order.split(",")
        ]
    if args.baseline is not None:
        env, name = baseline_env(args.baseline, dict(os.environ), cwd)
        base = Session(f"baseline {name}", sys.executable, [], env)
        checkout = args.baseline.resolve()
    else:
        base = Session("baseline", args.baseline_python, [])
        checkout = checkout_of(args.baseline_python)
    if profile and takes_option(checkout, "--sprite-profile"):
        base = dataclasses.replace(base, args=profile)
    return [
        dataclasses.replace(base, args=["--sprite-reuse=auto", *base.args]),
        Session("now", sys.executable, ["--sprite-reuse=auto", *profile]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "-k", dest="select", default=None, help="pytest -k expression (default: the whole suite)"
    )
    parser.add_argument("--order", default="off,auto", help="which session runs first (default off,auto)")
    parser.add_argument("--keep", type=Path, default=None, help="run in this new folder and keep the reports")
    against = parser.add_mutually_exclusive_group()
    against.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="another checkout of pytest-sprite (git worktree add /tmp/base <commit>), run first on PYTHONPATH: "
        "its session and this one's, both with --sprite-reuse=auto, instead of off against auto",
    )
    against.add_argument(
        "--baseline-python",
        default=None,
        help="as --baseline, from a Python whose environment has another pytest-sprite installed (a checkout "
        "older than an entry point this one installs)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="the sessions with --sprite-profile, their splits side by side"
    )
    args = parser.parse_args()
    print(
        f"main job: pytest --pyargs pytest_sprite.suite --ranks={args.ranks}"
        + (f" -k {args.select!r}" if args.select else "")
    )
    print(f"  machine: {os.uname().nodename}, {os.cpu_count()} cores, load average {os.getloadavg()} before")
    if args.keep is not None:
        args.keep.mkdir(parents=True)  # a new folder: never mix with (or overwrite) an earlier run's reports
    with tempfile.TemporaryDirectory(prefix="sprite-bench-suite-") as tmp:
        root = Path(tmp) if args.keep is None else args.keep.resolve()
        chosen = sessions(args, root)
        results = [run(s, args.ranks, root / f"s{i}", args.select) for i, s in enumerate(chosen)]
        print(f"  load average {os.getloadavg()} after")
        for session, r in zip(chosen, results, strict=True):
            print(f"  {session.label}: {r['wall']:7.1f} s, {tally(r['counts']) or 'nothing computed'}")
        first, second = results[0], results[-1]
        print(f"  ratio: {second['wall'] / first['wall']:.2f} (second / first)")
        print_profiles({s.label: profile_totals(r["report"]) for s, r in zip(chosen, results, strict=True)})
        same = print_comparison(first["report"], second["report"])
    return 0 if same and first["rc"] == second["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
