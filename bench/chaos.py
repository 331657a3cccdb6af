"""Crash points per minute of the 2-rank ddp crash matrix, forks against a fresh interpreter per run.

The same matrix (the lora_qwen recipe's Lightning fit under XPUDDPStrategy on 2 CPU ranks, killed at every
file event of its saves, resumed with ``fit(ckpt_path="last")``) runs twice in one process:

- pytest-sprite's way: every run (fault-free, crashed, resumed) is 2 processes forked from this one, which
  imported torch, Lightning and the model once;
- the seed's way (ckpt-chaos ``run``): every run is 2 fresh interpreters that import everything again and
  get the injector through ``sitecustomize``.

Both give the same matrix (it prints both summaries); the figures are wall time, crash points, crash points
per minute and the ratio. On a shared machine the figures are noisy. Usage: ``python bench/chaos.py [--ranks 2]
[--strategy ddp] [--out DIR]`` (DIR must not exist; default a fresh temporary folder).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pytest_sprite import CrashConsistencyError, CrashMatrix, assert_crash_consistent
from pytest_sprite.save_crashes.crash_targets import MatrixTarget
from pytest_sprite.save_crashes.inject import CRASH_EXIT_CODE, PLAN_ENV
from pytest_sprite.save_crashes.lora import LoraQwenTarget
from pytest_sprite.save_crashes.target_run import RankOutcome, RunOutcome, RunRequest, rank_envs
from pytest_sprite.save_crashes.targets import load_weights, write_sitecustomize

ENTRY = (
    "import sys, torch\n"
    "from pathlib import Path\n"
    "from pytest_sprite.save_crashes.lora import _train_entry\n"
    "weights = _train_entry(Path(sys.argv[1]), sys.argv[2])\n"
    "if sys.argv[3]:\n"
    "    torch.save(weights, sys.argv[3])\n"
)


@dataclass(frozen=True, kw_only=True)
class InterpreterPerRun:
    """The lora target, but every rank of every run a fresh ``python`` (the seed's ``run`` mode)."""

    strategy: str
    ranks: int
    inject_dir: Path

    @property
    def label(self) -> str:
        return f"lora_qwen {self.strategy}, an interpreter per run"

    def run(self, request: RunRequest) -> RunOutcome:
        train_dir, plans, outputs = request.train_dir, request.plans, request.outputs
        timeout, grace, kill = request.timeout, request.grace, request.kill
        start = time.monotonic()
        train_dir.mkdir(parents=True, exist_ok=True)
        result = train_dir.parent / f"{train_dir.name}.result.pt"
        result.unlink(missing_ok=True)
        procs = []
        for rank, (plan, env_add) in enumerate(zip(plans, rank_envs(self.ranks), strict=True)):
            env = {
                **os.environ,
                **env_add,
                "PYTHONPATH": os.pathsep.join([str(self.inject_dir), os.getcwd()]),
            }
            if plan is not None:  # an interpreter is no sub-world rank: its injector carries the kill plan
                env[PLAN_ENV] = replace(plan, kill=kill).to_json()
            out = open(outputs[rank], "ab")
            argv = [
                sys.executable,
                "-c",
                ENTRY,
                str(train_dir),
                self.strategy,
                str(result) if rank == 0 else "",
            ]
            procs.append(
                (
                    subprocess.Popen(
                        argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    ),
                    out,
                )
            )
        deadline = start + timeout
        codes: list[int | None] = [None] * len(procs)
        while any(c is None for c in codes) and time.monotonic() < deadline:
            for i, (p, _) in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
                    if codes[i] is not None and codes[i] != 0:
                        deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
        ranks: list[RankOutcome] = []
        for i, (p, out) in enumerate(procs):
            if codes[i] is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                ranks.append(RankOutcome(rank=i, status="timeout", error="killed after the run's deadline"))
            elif codes[i] == CRASH_EXIT_CODE and kill is not None:
                ranks.append(RankOutcome(rank=i, status="crashed", crashed_at=kill.at))
            elif codes[i] != 0:
                ranks.append(RankOutcome(rank=i, status="raised", error=f"exited with status {codes[i]}"))
            else:
                value = load_weights(result) if i == 0 else None
                ranks.append(RankOutcome(rank=i, status="returned", value=value))
            out.close()
        return RunOutcome(ranks=tuple(ranks), wall_s=time.monotonic() - start)


def _matrix(target: object, out: Path) -> tuple[CrashMatrix, float]:
    start = time.monotonic()
    try:
        matrix = assert_crash_consistent(MatrixTarget(target), out_dir=out)
    except CrashConsistencyError as exc:
        matrix = exc.result
    return matrix, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="sprite-bench-chaos-")) / "bench"
    root.mkdir(parents=True)
    target = LoraQwenTarget(strategy=args.strategy, ranks=args.ranks)
    start = time.monotonic()
    target.prewarm()  # the forking way's one-time cost: import Lightning, transformers, PEFT; build the model
    warm_s = time.monotonic() - start
    forks, runs_s = _matrix(target, root / "forks")
    forks_s = warm_s + runs_s
    inject = write_sitecustomize(root / "inject").parent
    cold_target = InterpreterPerRun(strategy=args.strategy, ranks=args.ranks, inject_dir=inject)
    cold, cold_s = _matrix(cold_target, root / "interpreters")
    rows = [
        ("forked runs (pytest-sprite)", forks, forks_s),
        ("interpreter per run (ckpt-chaos run mode)", cold, cold_s),
    ]
    print(
        f"crash matrix of lora_qwen {args.strategy} at {args.ranks} ranks (figures noisy on a shared machine)"
    )
    print(f"{'way':44} {'wall s':>8} {'runs':>5} {'points':>7} {'points/min':>11}  matrix")
    per_min = []
    for name, matrix, wall in rows:
        points = len(matrix.rows)
        runs = (
            2 + matrix.flake_runs + 2 * points + 1
        )  # two fault-free, flake, a crash + a resume per point, control
        per_min.append(points / (wall / 60))
        print(f"{name:44} {wall:8.1f} {runs:5d} {points:7d} {per_min[-1]:11.2f}  {matrix.summary()}")
    print(f"ratio: {per_min[0] / per_min[1]:.1f}x the crash points per minute (target >= 10x)")
    runs_only = len(forks.rows) / (runs_s / 60)
    print(
        f"  the forked wall includes {warm_s:.1f} s of one-time warm-up in this process; without it "
        f"({runs_s:.1f} s of runs) {runs_only / per_min[1]:.1f}x, which a longer matrix approaches"
    )
    same = [r.verdict for r in forks.rows] == [r.verdict for r in cold.rows]
    print(f"same verdicts both ways: {same}")


if __name__ == "__main__":
    main()
