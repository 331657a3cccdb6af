"""Packing small ranks tests side by side in a big world (issue 14), measured side by side in one run.

One suite, 24 two-rank tests and 4 four-rank tests (collected in that order: the two-rank ones first),
each of which does one all_reduce and then waits 1 s, as a test on a device does while its host is idle.
It runs twice at ``--ranks=8``: with ``--pack=off`` (one ranks test at a time, as before packing) and
with ``--pack=on`` (the default). For each: wall time of the whole pytest session, the session's own
utilisation line (busy rank-seconds over 8 x the time the world was held) and the most tests side by side.

Ideal figures: one at a time holds the world for 28 x 1 s; packed, (24 x 2 + 4 x 4) rank-seconds fill
8 ranks for 8 s, so 3.5x. Target: at least 3x. That ideal is the world's: the wall time of a session also
holds what no harness packs (pytest's start-up, collection with the test module's torch import, exit), the
same in both modes; the bench prints it and the wall ratio a harness without any per-test cost would reach. Timing on a shared machine is noisy; ``--runs N`` takes
the median of N sessions; ``--seconds S`` makes each body wait S s instead (the harness's own cost per test
then weighs less). Usage: ``python bench/packing.py [--runs 1] [--ranks 8] [--launcher local] [--seconds 1]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SUITE = textwrap.dedent(
    """\
    import time

    import pytest
    import torch
    import torch.distributed as dist


    def body(world, n):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world.size == n
        time.sleep({seconds})


    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("i", range(24))
    def test_two(world, i):
        body(world, 2)


    @pytest.mark.ranks(4)
    @pytest.mark.parametrize("i", range(4))
    def test_four(world, i):
        body(world, 4)
    """
)

LINE = re.compile(r"was (\d+)% busy \(.* of \d+ x ([\d.]+)s held\).* at most (\d+) side by side")


def session(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, int, float, int, str]:
    """Wall seconds, utilisation %, seconds the world was held, most side by side, and the line itself."""
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or "28 passed" not in proc.stdout:
        raise SystemExit(
            f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
        )
    found = [line for line in proc.stdout.splitlines() if LINE.search(line)]
    if not found:
        raise SystemExit(f"no utilisation line in the output of {' '.join(argv)}:\n{proc.stdout[-3000:]}")
    match = LINE.search(found[-1])
    assert match is not None
    return wall, int(match.group(1)), float(match.group(2)), int(match.group(3)), found[-1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1, help="median of this many sessions of each mode")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--launcher", default="local")
    parser.add_argument(
        "--seconds", type=float, default=1.0, help="how long each test body waits (the issue's suite: 1)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sprite-bench-packing-"))
    (work / "test_packing_suite.py").write_text(SUITE.format(seconds=args.seconds))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    base = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_sprite.plugin",
        "--sprite-device=cpu",
        f"--ranks={args.ranks}",
        f"--launcher={args.launcher}",
        "test_packing_suite.py",
    ]
    results = {}
    for mode in ("off", "on"):
        runs = [session([*base, f"--pack={mode}"], work, env) for _ in range(args.runs)]
        wall = statistics.median(r[0] for r in runs)
        chosen = min(runs, key=lambda r: abs(r[0] - wall))
        results[mode] = (wall, chosen[1], chosen[2], chosen[3], chosen[4])

    print(
        f"cpu cores: {os.cpu_count()}, --ranks={args.ranks}, --launcher={args.launcher}, "
        f"sessions: median of {args.runs}; timings on a shared machine are noisy"
    )
    title = f"suite: 24 ranks(2) + 4 ranks(4), {args.seconds:g} s each"
    print(f"{title:44} {'wall s':>8} {'held s':>8} {'busy':>6} {'side by side':>13}")
    for mode, label in (("off", "--pack=off (one at a time)"), ("on", "--pack=on (packed)")):
        wall, busy, held, side, _ = results[mode]
        print(f"{label:44} {wall:8.2f} {held:8.2f} {busy:5d}% {side:13d}")
    ideal = (24 * 2 + 4 * 4) * args.seconds / args.ranks
    print()
    print(
        f"speed-up, off / on: wall {results['off'][0] / results['on'][0]:.2f}x, world held "
        f"{results['off'][2] / results['on'][2]:.2f}x   (target >= 3x; ideal "
        f"{28 * args.seconds:g} s / {ideal:g} s = {28 * args.seconds / ideal:.1f}x)"
    )
    print(
        "wall: the whole pytest session; held: launch of the agents to their shutdown (the utilisation line)"
    )
    outside = {mode: results[mode][0] - results[mode][2] for mode in ("off", "on")}
    bound = (outside["off"] + 28 * args.seconds) / (outside["on"] + ideal)
    print(
        f"outside the world (pytest start-up, collection with its imports, exit): {outside['off']:.1f} s off, "
        f"{outside['on']:.1f} s on; with these, a harness with no per-test cost at all would reach "
        f"{bound:.2f}x on the wall"
    )
    for mode in ("off", "on"):
        print(f"  --pack={mode}: {results[mode][4]}")


if __name__ == "__main__":
    main()
