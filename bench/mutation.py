"""What ``--sprite-mutate`` costs: one suite with and without it, side by side in one run.

The suite is ``--tests`` two-rank tests, each one all-reduce whose value it checks (every all-reduce mutant
applies and is killed). It runs at ``--ranks=4`` without the option and with the four all-reduce mutants
(``skip_allreduce,allreduce_sum_as_mean,allreduce_mean_of_world_plus_one,stale_allreduce``). Printed: each
session's wall time, the extra seconds per test, and per mutant run (tests x mutants). Timing on a shared
machine is noisy; ``--runs N`` takes the median of N sessions per mode.
Usage: ``python bench/mutation.py [--tests 10] [--runs 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MUTANTS = "skip_allreduce,allreduce_sum_as_mean,allreduce_mean_of_world_plus_one,stale_allreduce"
TEST = textwrap.dedent(
    """
    @pytest.mark.ranks(2)
    def test_allreduce_{i}(world):
        t = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0
    """
)


def session(folder: Path, *args: str) -> float:
    """Seconds one pytest session of the suite takes; fails loudly when the session does."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ranks=4", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"the session failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        )
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sprite-mutation-bench-") as tmp:
        folder = Path(tmp)
        body = "import pytest\nimport torch\nimport torch.distributed as dist\n"
        body += "".join(TEST.format(i=i) for i in range(args.tests))
        (folder / "test_bench.py").write_text(body)
        plain: list[float] = []
        mutated: list[float] = []
        for _ in range(args.runs):  # the two modes alternate, so drift on the machine falls on both
            plain.append(session(folder))
            mutated.append(session(folder, f"--sprite-mutate={MUTANTS}"))
    p, m = statistics.median(plain), statistics.median(mutated)
    mutants = len(MUTANTS.split(","))
    print(f"tests: {args.tests}, mutants each: {mutants}, sessions per mode: {args.runs}")
    print(f"without --sprite-mutate: {p:.2f} s")
    print(f"with --sprite-mutate:    {m:.2f} s")
    print(
        f"extra per test: {(m - p) / args.tests:.2f} s; per mutant run: {(m - p) / (args.tests * mutants):.2f} s"
    )


if __name__ == "__main__":
    main()
