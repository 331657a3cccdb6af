"""Dispatch cost of a ranks test, measured side by side in one run.

The same 20 trivial 2-rank tests (one all_reduce each) run four ways:

- pytest-sprite: one pytest session, a fresh forked process per rank per test;
- torch's MultiProcContinuousTest: warm worker processes, no per-test isolation;
- a cold spawn per test: two new Pythons import torch, rendezvous and all_reduce;
- the floor: one pool of two processes that does 20 all_reduces.

The sprite session also runs with ``--collective-check`` (an extra fingerprint collective before each
collective), with ``--pack=off``, and with tests that use a feature (each writes to ``tmp_path``; each
starts a 2-rank sub-world), so what a feature costs shows on the tests that use it and nowhere else.

The marginal cost of one more sprite test is a session of ``--marginal-tests`` tests (default 61) minus
a 1-test session run just before it, over the difference: the median of ``--runs`` such pairs (over 20
tests the figure moved by 20 ms between two quiet runs), packed, with ``--pack=off`` and with
``SPRITE_HUGE_PAGES=0`` (the heap the ranks are forked from left in 4 KiB pages), with its CPU and minor
page faults counted over every process of the session (a shared machine moves them less than it moves
wall time). ``--spawns`` cold spawns (default 5) follow each pair, and the ratio of one cold spawn to
one more test is the median of the rounds' own ratios. The ways (packed, ``--pack=off``, 4 KiB pages)
run round by round, one pair of each in turn.

``--cov`` adds a way to the marginal cost: both sessions under pytest-cov (``--cov=.``, the test module
measured in every rank, no report), so what coverage adds to one more test is read beside the packed way.

``--baseline CHECKOUT`` runs another checkout of the plugin (an earlier release, say: ``git worktree add
/tmp/base <commit>``) first on ``PYTHONPATH``: its 20-test session and its marginal pair join the rounds, in
turns with this checkout's, so a change in what a test costs is read side by side, not across days
(``bench/baseline.py``, which ``bench/suite.py`` and ``bench/cells.py`` share).

Sessions are the median of ``--runs`` runs (default 3); the 20-test sessions (packed and ``--pack=off``)
and torch's harness run in turns, and each ratio to torch's is the median of the rounds' ratios; the
one-pool floor runs once. The fork floor (``--marginal-tests`` - 1 tests, median of ``--runs``) is what a
test costs this design with no harness at all (its median test): two ranks forked from a process that
imported torch, a fresh gloo group, one all_reduce, exit. The load average is printed before and after:
on a shared machine the figures move with it.

Usage: ``python bench/dispatch.py [--tests 20] [--runs 3] [--marginal-tests 61] [--spawns 5] [--cov] [--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from baseline import baseline_env

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

TMP_PATH_TEST = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("i", range({n}))
    def test_all_reduce(world, tmp_path, i):
        (tmp_path / f"rank{{world.rank}}").write_text("x")
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == 2.0
    """
)

SUBWORLD_TEST = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist
    from pytest_sprite import run_subworld
    from subfns import reduce_ones

    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("i", range({n}))
    def test_all_reduce(world, i):
        assert run_subworld(reduce_ones).values() == [2.0, 2.0]
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == 2.0
    """
)

SUBWORLD_FNS = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    def reduce_ones(world):
        t = torch.ones(4)
        dist.all_reduce(t)
        return t[0].item()
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

FORK_FLOOR = textwrap.dedent(
    """
    import gc, os, socket, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from pytest_sprite.plumbing.process import collapse_heap_once

    def rank(r, port, fd):
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=r == 0, timeout=timedelta(seconds=60), wait_for_workers=False,
            **({{"world_size": 2, "master_listen_fd": fd}} if r == 0 else {{}}),
        )
        dist.init_process_group("gloo", store=store, rank=r, world_size=2)
        t = torch.ones(4)
        dist.all_reduce(t)
        os._exit(0 if t[0].item() == 2.0 else 1)

    def one_test():
        listener = socket.create_server(("127.0.0.1", 0))
        port, pids = listener.getsockname()[1], []
        for r in range(2):
            pid = os.fork()
            if pid == 0:
                rank(r, port, listener.fileno() if r == 0 else None)
            pids.append(pid)
        listener.close()
        if any(os.waitpid(pid, 0)[1] != 0 for pid in pids):
            raise SystemExit("a rank failed")

    gc.freeze()
    collapse_heap_once(forks=2 * {n})
    one_test()
    times = []
    before = os.times()
    for _ in range({n}):
        start = time.perf_counter()
        one_test()
        times.append(time.perf_counter() - start)
    after = os.times()
    cpu = sum(after[i] - before[i] for i in range(4)) / {n}
    times.sort()
    print(times[len(times) // 2], cpu)
    """
)
"""The design's floor, no pytest: a process that imported torch forks the two ranks of each test, which join
a fresh gloo group on a store rank 0 hosts on a socket bound before the fork, all_reduce once and exit; the
tests one after another, the heap in huge pages as the controller's is. What is left of a test's cost when
the harness costs nothing. The median test: one in about 60 here waits 5 s for a reverse DNS answer that
this machine's resolver dropped (torch's store client names the address it connects to)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


STALL = 4.5
"""Seconds of one test phase that mark a stall, not the harness: glibc waits 5 s for a DNS answer that never
came (torch's store client asks for the name of ``::ffff:127.0.0.1``; this machine's resolver drops between one
query in 50 and one in 400). pytest's ``--durations`` names such phases; the bench counts the sessions that had one."""
_PHASE = re.compile(r"^\s*(\d+\.\d+)s (setup|call|teardown)\s+(\S+)", re.MULTILINE)
stalled: list[str] = []
"""Every pytest session of the run that had a phase of :data:`STALL` seconds or more, and that phase."""
sessions = 0


def counted(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, int]:
    """Wall seconds, and the CPU seconds and minor page faults of every process of the run.

    ``RUSAGE_CHILDREN`` holds what each descendant used once its parent waited for it: the harness reaps its
    agents, the agents their test children. CPU and faults are counted, not timed, so a busy machine
    moves them less than it moves the wall time.
    """
    global sessions
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if "pytest" in argv:
        sessions += 1
        stalled.extend(
            f"{' '.join(argv[argv.index('pytest') + 1 :])}: {m[3]} {m[2]} {m[1]} s"
            for m in _PHASE.finditer(proc.stdout)
            if float(m[1]) >= STALL
        )
    return elapsed, cpu, after.ru_minflt - before.ru_minflt


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    return counted(argv, cwd, env)[0]


def median_of(runs: int, argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Median wall time of ``runs`` runs: one run of a few seconds is at the mercy of a shared machine."""
    return statistics.median(timed(argv, cwd, env) for _ in range(runs))


@dataclass(frozen=True)
class Marginal:
    """One more test, from a short and a long session run in turns, with cold spawns beside each pair."""

    short: float
    long: float
    wall: float
    """Median difference of the pairs' wall times (the long session's extra tests' total)."""
    cpu: float
    faults: float
    spawns_per_test: float
    """Median over the rounds of (one cold spawn / one more test), each round's own spawns against its pair."""
    round_spawns_per_test: list[float]
    """Each round's (one cold spawn / one more test), in the order run: how far the rounds spread."""
    spawns: list[float]
    set_aside: int
    """Pairs run again because one of their sessions stalled (:data:`STALL`): they are not in the medians."""


Round = tuple[tuple[float, float, int], tuple[float, float, int], list[float]]
"""One round of a way of the marginal cost: the short and the long session (wall, CPU, faults), its cold spawns."""


@dataclass(frozen=True)
class Sessions:
    """One way of running the marginal cost's two sessions: its command lines and its environment."""

    name: str
    short: list[str]
    long: list[str]
    env: dict[str, str]


def marginal_of(
    runs: int,
    ways: list[Sessions],
    cwd: Path,
    *,
    extra_tests: int,
    spawn: Callable[[], float],
    spawns: int,
) -> dict[str, Marginal]:
    """Medians of a short and a long session, and of their differences (wall, CPU, page faults), run in turns.

    Run one after the other, each pair sees the same machine: the median of the differences drifts less
    with a shared machine's speed than the difference of two medians taken minutes apart. Each round runs
    one pair of every way in turn, so the ways are compared side by side too. ``spawns`` cold spawns follow
    each pair, so the ratio of the two is taken within a round: this machine's cold spawn took 1.4 s in one
    run and 1.8 s in another the same morning. A pair in which a session stalled is set aside and run
    again, at most ``runs`` times in all for each way (a 61-test session makes 122 reverse lookups; one
    dropped adds 5 s, 83 ms a test, to the difference).
    """
    rounds: dict[str, list[Round]] = {way.name: [] for way in ways}
    set_aside = dict.fromkeys(rounds, 0)
    while any(len(done) < runs for done in rounds.values()):
        for way in ways:
            if len(rounds[way.name]) == runs:
                continue
            before = len(stalled)
            a, b = counted(way.short, cwd, way.env), counted(way.long, cwd, way.env)
            if len(stalled) > before and set_aside[way.name] < runs:
                set_aside[way.name] += 1
                continue
            rounds[way.name].append((a, b, [spawn() for _ in range(spawns)]))
    return {name: _marginal(done, extra_tests, set_aside[name]) for name, done in rounds.items()}


def _marginal(rounds: list[Round], extra_tests: int, set_aside: int) -> Marginal:
    shares = [
        statistics.mean(c) / ((b[0] - a[0]) / extra_tests) if b[0] > a[0] else float("inf")
        for a, b, c in rounds
    ]
    return Marginal(
        short=statistics.median(a[0] for a, _, _ in rounds),
        long=statistics.median(b[0] for _, b, _ in rounds),
        wall=statistics.median(b[0] - a[0] for a, b, _ in rounds),
        cpu=statistics.median(b[1] - a[1] for a, b, _ in rounds),
        faults=statistics.median(b[2] - a[2] for a, b, _ in rounds),
        spawns_per_test=statistics.median(shares),
        round_spawns_per_test=shares,
        spawns=[t for _, _, c in rounds for t in c],
        set_aside=set_aside,
    )


def pair(worker: Path, rounds: int, env: dict[str, str]) -> float:
    """Wall seconds of two new Pythons that import torch, join a gloo group and all_reduce ``rounds`` times."""
    start = time.perf_counter()
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(r), port, str(rounds)], env=env) for r in (0, 1)
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("cold spawn worker failed")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3, help="median of this many runs of each session")
    parser.add_argument(
        "--spawns", type=int, default=5, help="cold spawns after each pair of sessions of the marginal cost"
    )
    parser.add_argument(
        "--marginal-tests",
        type=int,
        default=61,
        help="the long session of the marginal cost (minus a 1-test one)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="another checkout of pytest-sprite (an earlier release, say) whose 20-test session and marginal "
        "cost run in turns with this one's",
    )
    parser.add_argument(
        "--cov",
        action="store_true",
        help="also the marginal cost under pytest-cov (--cov=., no report): what coverage adds to a test",
    )
    args = parser.parse_args()
    n, runs, m = args.tests, args.runs, args.marginal_tests
    if m < 2:
        parser.error(f"--marginal-tests must be at least 2, not {m}")
    if args.spawns < 1:
        parser.error(f"--spawns must be at least 1, not {args.spawns}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    work = Path(tempfile.mkdtemp(prefix="sprite-bench-"))
    for name, text, count in (
        ("sprite_n", SPRITE_TEST, n),
        ("sprite_1", SPRITE_TEST, 1),
        ("sprite_n1", SPRITE_TEST, m),
        ("sprite_tmp_path", TMP_PATH_TEST, n),
        ("sprite_subworld", SUBWORLD_TEST, n),
    ):
        (work / name).mkdir()
        (work / name / "test_dispatch.py").write_text(text.format(n=count))
    (work / "sprite_subworld" / "subfns.py").write_text(SUBWORLD_FNS)
    (work / "test_mpct.py").write_text(MPCT_TEST.format(n=n))
    worker = work / "worker.py"
    worker.write_text(WORKER)
    # CPU ranks everywhere, as in the other three ways (a GPU machine would otherwise give the ranks its GPU).
    # Only this plugin is loaded: other installed pytest plugins cost their own import time (hypothesis's
    # alone is about 0.7 s here), which is not dispatch; the session with every plugin is printed beside it.
    pytest_argv = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--sprite-device=cpu"),
        *("--durations=3", f"--durations-min={STALL}"),
    ]
    only_sprite = dict(env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    sprite_argv = [*pytest_argv, "-p", "pytest_sprite.plugin"]

    # Python caches the bytecode of what it imports, so a user's sessions after the first load the plugin
    # compiled. Where PYTHONDONTWRITEBYTECODE is set (this project's CPU machine sets it), nothing is cached
    # and every session would compile the plugin again (0.1-0.2 s there): cached once here, as a first
    # session would elsewhere. torch's own modules come compiled with its wheel.
    import compileall

    import pytest_sprite

    compileall.compile_dir(Path(pytest_sprite.__file__).parent, quiet=1)
    baseline: tuple[dict[str, str], str] | None = None
    if args.baseline is not None:
        baseline = baseline_env(args.baseline, only_sprite, work)
        compileall.compile_dir(args.baseline / "pytest_sprite", quiet=1)
    load_before = os.getloadavg()
    results: dict[str, float] = {}
    spawns_per_test: dict[str, float] = {}
    round_shares: dict[str, list[float]] = {}
    spawn_times: list[float] = []
    set_aside = 0
    # The heap the ranks are forked from, left in 4 KiB pages: what huge pages save on every fork and exit.
    small_pages = dict(only_sprite, SPRITE_HUGE_PAGES="0")
    ways = [
        Sessions(suffix, [*sprite_argv, *extra, "sprite_1"], [*sprite_argv, *extra, "sprite_n1"], environ)
        for suffix, extra, environ in (
            ("", [], only_sprite),
            ("_off", ["--pack=off"], only_sprite),
            ("_4k", [], small_pages),
            *(
                (("_cov", ["-p", "pytest_cov.plugin", "--cov=.", "--cov-report="], only_sprite),)
                if args.cov
                else ()
            ),
            *((("_base", [], baseline[0]),) if baseline else ()),
        )
    ]
    marginals = marginal_of(
        runs, ways, work, extra_tests=m - 1, spawn=lambda: pair(worker, 1, env), spawns=args.spawns
    )
    for suffix, one in marginals.items():
        results["sprite_1" + suffix], results["sprite_n1" + suffix] = one.short, one.long
        results["marginal" + suffix] = one.wall / (m - 1)
        results["marginal_cpu" + suffix] = one.cpu / (m - 1)
        results["marginal_faults" + suffix] = one.faults / (m - 1)
        spawns_per_test[suffix] = one.spawns_per_test
        round_shares[suffix] = one.round_spawns_per_test
        set_aside += one.set_aside
        spawn_times += one.spawns
    # The 20-test sessions, packed and not, and torch's harness in turns: each ratio is taken within a round.
    twenty = {
        "sprite_n": ([*sprite_argv, "sprite_n"], only_sprite),
        "sprite_n_off": ([*sprite_argv, "--pack=off", "sprite_n"], only_sprite),
        **({"sprite_n_base": ([*sprite_argv, "sprite_n"], baseline[0])} if baseline else {}),
        "mpct": ([sys.executable, "test_mpct.py"], env),
    }
    rounds = [
        {name: timed(argv, work, environ) for name, (argv, environ) in twenty.items()} for _ in range(runs)
    ]
    for name in twenty:
        results[name] = statistics.median(r[name] for r in rounds)
    ratio = statistics.median(r["sprite_n"] / r["mpct"] for r in rounds)
    ratio_off = statistics.median(r["sprite_n_off"] / r["mpct"] for r in rounds)
    results["sprite"] = results["sprite_n"]
    results["sprite_tmp_path"] = median_of(runs, [*sprite_argv, "sprite_tmp_path"], work, only_sprite)
    results["sprite_subworld"] = median_of(runs, [*sprite_argv, "sprite_subworld"], work, only_sprite)
    results["sprite_all_plugins"] = median_of(runs, [*pytest_argv, "sprite_n"], work, env)
    results["sprite_collective_check"] = median_of(
        runs, [*sprite_argv, "--collective-check", "sprite_n"], work, only_sprite
    )
    floor_script = work / "fork_floor.py"
    floor_script.write_text(FORK_FLOOR.format(n=m - 1))
    floor_runs = [
        [
            float(x)
            for x in subprocess.run(
                [sys.executable, str(floor_script)], env=env, check=True, capture_output=True, text=True
            ).stdout.split()
        ]
        for _ in range(runs)
    ]
    results["fork_floor"] = statistics.median(r[0] for r in floor_runs)
    results["fork_floor_cpu"] = statistics.median(r[1] for r in floor_runs)
    results["floor"] = pair(worker, n, env)

    marginal, marginal_off, marginal_4k = (results[f"marginal{s}"] for s in ("", "_off", "_4k"))
    cold_one = statistics.median(spawn_times)

    def share(spawns: float) -> str:
        return f"1/{spawns:.0f}" if spawns != float("inf") else "below the noise"

    def share_of(spawns: float) -> str:
        """The share and the unrounded number of tests a cold spawn pays for."""
        return share(spawns) if spawns == float("inf") else f"{share(spawns)} ({spawns:.1f})"

    def verdict(met: bool) -> str:
        """Judged on the unrounded figure: 0.304 prints as 0.30 and 1/59.6 as 1/60, and both miss."""
        return "met" if met else "missed"

    rows = [
        (f"pytest-sprite, {n} tests (fresh processes per test)", results["sprite"]),
        ("  the same with every installed pytest plugin loaded", results["sprite_all_plugins"]),
        (
            "  the same with --collective-check (torch's fingerprint checks)",
            results["sprite_collective_check"],
        ),
        ("  the same with --pack=off", results["sprite_n_off"]),
        ("  the same, each test writing to tmp_path", results["sprite_tmp_path"]),
        ("  the same, each test starting a 2-rank sub-world", results["sprite_subworld"]),
        (f"torch MultiProcContinuousTest, {n} tests (warm, shared)", results["mpct"]),
        (f"floor: one pool, {n} all_reduces", results["floor"]),
        (f"pytest-sprite marginal cost of one more test ({m} tests - 1, over {m - 1})", marginal),
        ("  the same with --pack=off", marginal_off),
        ("  the same with SPRITE_HUGE_PAGES=0 (4 KiB pages)", marginal_4k),
        *((("  the same under pytest-cov (--cov=.)", results["marginal_cov"]),) if args.cov else ()),
        ("  its CPU, every process of the session (counted)", results["marginal_cpu"]),
        ("  the same with SPRITE_HUGE_PAGES=0", results["marginal_cpu_4k"]),
        *((("  the same under pytest-cov", results["marginal_cpu_cov"]),) if args.cov else ()),
        ("  tmp_path, per test that uses it", (results["sprite_tmp_path"] - results["sprite"]) / n),
        (
            "  a 2-rank sub-world, per test that starts one",
            (results["sprite_subworld"] - results["sprite"]) / n,
        ),
        (
            f"fork floor, median test: 2 forked ranks, a fresh gloo group, one all_reduce, no pytest ({m - 1} tests)",
            results["fork_floor"],
        ),
        ("  its CPU per test, the forking process and both ranks (counted)", results["fork_floor_cpu"]),
        (
            f"cold spawn, one test (median of {len(spawn_times)}, {args.spawns} after each pair above)",
            cold_one,
        ),
    ]
    load_after = os.getloadavg()
    print(f"cpu cores: {os.cpu_count()}, torch threads per rank: 1, sessions: median of {runs} runs")
    print(
        "load average (1, 5, 15 min): before {:.1f} {:.1f} {:.1f}, after {:.1f} {:.1f} {:.1f}".format(
            *load_before, *load_after
        )
    )
    print(f"{'what':58} {'wall s':>8}")
    for what, seconds in rows:
        print(f"{what:58} {seconds:8.3f}")
    print(
        f"(minor page faults of one more test, every process: {results['marginal_faults']:.0f}; "
        f"with SPRITE_HUGE_PAGES=0 {results['marginal_faults_4k']:.0f})"
    )
    print(
        f"(the {m}-test and 1-test sessions of the marginal cost, in turns: {results['sprite_n1']:.2f} s and "
        f"{results['sprite_1']:.2f} s; the marginal cost is the median of their {runs} differences, over {m - 1})"
    )
    if args.cov:
        print(
            f"(under pytest-cov: {results['sprite_n1_cov']:.2f} s and {results['sprite_1_cov']:.2f} s; one more "
            f"test's minor page faults {results['marginal_faults_cov']:.0f})"
        )
    print()
    for label, value in (("sprite / MultiProcContinuousTest:", ratio), ("  with --pack=off:", ratio_off)):
        print(f"{label:44}{value:.3f}  (target <= 0.30: {verdict(value <= 0.3)})")
    print(f"  the median of {runs} rounds, each running the two sprite sessions and torch's in turns:")
    for r in rounds:
        sprite_s, off_s, torch_s = r["sprite_n"], r["sprite_n_off"], r["mpct"]
        print(
            f"    {sprite_s:.2f} s, --pack=off {off_s:.2f} s, torch's {torch_s:.2f} s: "
            f"{sprite_s / torch_s:.3f} and {off_s / torch_s:.3f}"
        )
    for label, suffix in (("sprite marginal / cold spawn:", ""), ("  with --pack=off:", "_off")):
        spawns = spawns_per_test[suffix]
        print(f"{label:44}{share_of(spawns)}  (target <= 1/60: {verdict(spawns >= 60)})")
    print(f"  with SPRITE_HUGE_PAGES=0:                 {share_of(spawns_per_test['_4k'])}")
    print(f"  the median of {runs} rounds, each a pair of sessions and {args.spawns} cold spawns in turns:")
    for label, suffix in (("packed", ""), ("--pack=off", "_off"), ("4 KiB pages", "_4k")):
        print(f"    {label}: " + ", ".join(share_of(x) for x in round_shares[suffix]))
    print(
        f"fork floor / cold spawn:                    {share(cold_one / results['fork_floor'])}   (no harness at all)"
    )
    print(f"sprite marginal / fork floor:               {marginal / results['fork_floor']:.2f}")
    print(f"sprite / floor:                             {results['sprite'] / results['floor']:.2f}")
    if baseline:
        print()
        print(f"baseline {baseline[1]} ({args.baseline}), run in turns with this checkout's sessions:")
        print(f"{'':44}{'baseline':>10}{'this':>10}")
        for label, base, this, digits in (
            (f"{n} tests, s", results["sprite_n_base"], results["sprite_n"], 3),
            (
                "  / torch's harness (median of the rounds)",
                statistics.median(r["sprite_n_base"] / r["mpct"] for r in rounds),
                ratio,
                3,
            ),
            ("one more test, s", results["marginal_base"], marginal, 3),
            ("  its CPU, every process, s", results["marginal_cpu_base"], results["marginal_cpu"], 3),
            ("  its minor page faults", results["marginal_faults_base"], results["marginal_faults"], 0),
            ("  cold spawns it takes to equal one", spawns_per_test["_base"], spawns_per_test[""], 1),
        ):
            print(f"{label:44}{base:10.{digits}f}{this:10.{digits}f}")
        print(
            f"  rounds, cold spawns a test: {', '.join(share_of(x) for x in round_shares['_base'])} (baseline)"
        )
    print()
    print(
        f"pytest sessions with a test phase of {STALL} s or more (a dropped reverse DNS query, not the harness): "
        f"{len(stalled)} of {sessions}"
    )
    for line in stalled:
        print(f"  {line}")
    print(f"pairs of the marginal cost set aside for a stall and run again: {set_aside}")


if __name__ == "__main__":
    main()
