"""Dispatch cost of a ranks test, measured side by side in one run.

The same 20 trivial 2-rank tests (one all_reduce each) run four ways:

- pytest-sprite: one pytest session, a fresh forked process per rank per test;
- torch's MultiProcContinuousTest: warm worker processes, no per-test isolation;
- a cold spawn per test: two new Pythons import torch, rendezvous and all_reduce;
- the floor: one pool of two processes that does 20 all_reduces.

The sprite session also runs with ``--collective-check`` (an extra fingerprint collective before each
collective). It also prints the marginal cost of one more sprite test (a 21-test session minus a 1-test
session, over 20) against one cold spawn. Sessions are the median of ``--runs`` runs (default 3); the
cold spawns and the floor run once. Usage: ``python bench/dispatch.py [--tests 20] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SPRITE_TEST = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("i", range({n}))
    def test_all_reduce(world, i):
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == 2.0
    """
)

MPCT_TEST = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import MultiProcContinuousTest
    from torch.testing._internal.common_utils import run_tests

    class AllReduce(MultiProcContinuousTest):
        world_size = 2

        @classmethod
        def backend_str(cls):
            return "gloo"

        @classmethod
        def device_type(cls):
            return "cpu"

    def _make(i):
        def test(self):
            t = torch.ones(4)
            dist.all_reduce(t)
            assert t[0].item() == 2.0
        return test

    for i in range({n}):
        setattr(AllReduce, f"test_all_reduce_{{i:02d}}", _make(i))

    if __name__ == "__main__":
        run_tests()
    """
)

WORKER = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    rank, port, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for _ in range(rounds):
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == 2.0
    os._exit(0)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return elapsed


def median_of(runs: int, argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Median wall time of ``runs`` runs: one run of a few seconds is at the mercy of a shared machine."""
    return statistics.median(timed(argv, cwd, env) for _ in range(runs))


def pair(worker: Path, rounds: int, env: dict[str, str]) -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(r), port, str(rounds)], env=env) for r in (0, 1)
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("cold spawn worker failed")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3, help="median of this many runs of each session")
    args = parser.parse_args()
    n, runs = args.tests, args.runs
    env = dict(os.environ, OMP_NUM_THREADS="1")
    work = Path(tempfile.mkdtemp(prefix="sprite-bench-"))
    for name, count in (("sprite_n", n), ("sprite_1", 1), ("sprite_n1", n + 1)):
        (work / name).mkdir()
        (work / name / "test_dispatch.py").write_text(SPRITE_TEST.format(n=count))
    (work / "test_mpct.py").write_text(MPCT_TEST.format(n=n))
    worker = work / "worker.py"
    worker.write_text(WORKER)
    # CPU ranks everywhere, as in the other three ways (a GPU machine would otherwise give the ranks its GPU).
    # Only this plugin is loaded: other installed pytest plugins cost their own import time (hypothesis's
    # alone is about 0.7 s here), which is not dispatch; the session with every plugin is printed beside it.
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--sprite-device=cpu"]
    only_sprite = dict(env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    sprite_argv = [*pytest_argv, "-p", "pytest_sprite.plugin"]

    results: dict[str, float] = {}
    results["sprite"] = median_of(runs, [*sprite_argv, "sprite_n"], work, only_sprite)
    results["sprite_1"] = median_of(runs, [*sprite_argv, "sprite_1"], work, only_sprite)
    results["sprite_n1"] = median_of(runs, [*sprite_argv, "sprite_n1"], work, only_sprite)
    results["sprite_all_plugins"] = median_of(runs, [*pytest_argv, "sprite_n"], work, env)
    results["sprite_collective_check"] = median_of(
        runs, [*sprite_argv, "--collective-check", "sprite_n"], work, only_sprite
    )
    results["mpct"] = median_of(runs, [sys.executable, "test_mpct.py"], work, env)
    start = time.perf_counter()
    for _ in range(n):
        pair(worker, 1, env)
    results["cold"] = time.perf_counter() - start
    start = time.perf_counter()
    pair(worker, n, env)
    results["floor"] = time.perf_counter() - start

    marginal = (results["sprite_n1"] - results["sprite_1"]) / n
    cold_one = results["cold"] / n
    rows = [
        (f"pytest-sprite, {n} tests (fresh processes per test)", results["sprite"]),
        ("  the same with every installed pytest plugin loaded", results["sprite_all_plugins"]),
        (
            "  the same with --collective-check (torch's fingerprint checks)",
            results["sprite_collective_check"],
        ),
        (f"torch MultiProcContinuousTest, {n} tests (warm, shared)", results["mpct"]),
        (f"cold spawn per test, {n} tests", results["cold"]),
        (f"floor: one pool, {n} all_reduces", results["floor"]),
        ("pytest-sprite marginal cost of one more test", marginal),
        ("cold spawn, one test", cold_one),
    ]
    print(f"cpu cores: {os.cpu_count()}, torch threads per rank: 1, sessions: median of {runs} runs")
    print(f"{'what':58} {'wall s':>8}")
    for what, seconds in rows:
        print(f"{what:58} {seconds:8.2f}")
    print()
    print(f"sprite / MultiProcContinuousTest: {results['sprite'] / results['mpct']:.2f}   (target <= 0.50)")
    print(f"sprite marginal / cold spawn:     1/{cold_one / marginal:.0f}   (target <= 1/30)")
    print(f"sprite / floor:                   {results['sprite'] / results['floor']:.2f}")


if __name__ == "__main__":
    main()
