"""Session start-up cost of each launcher: one 4-rank session per launcher, one run each, one table.

Each session collects one trivial ``ranks(4)`` test (a barrier) and runs it, so its wall time is interpreter start,
collection, the launch (W agents importing torch and connecting back) and one 4-rank test. The column
"over local" is the launch's own cost against ``--launcher=local``, whose agents are forks of the
controller. pals runs against the PALS-like fake (``tests/fakes/pals/mpiexec``: MPICH underneath plus one
Python shim per rank) and srun against the stand-in (``tests/fakes/slurm/srun``), so their figures say what
this plugin adds, not what Aurora's PALS or a real Slurm step costs.

    OMP_NUM_THREADS=1 python bench/launchers.py [--ranks 4] [--launchers local,mpiexec,...]

A figure, never an assertion: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"

TEST = """
import pytest
import torch.distributed as dist

@pytest.mark.ranks({ranks})
def test_trivial(world):
    dist.barrier()
    assert world.size == {ranks}
"""


def session_env(launcher: str) -> dict[str, str]:
    """Environment for one launcher's session (the fakes go first on PATH; srun needs an allocation, pals a job)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if launcher == "pals":
        env["PATH"] = f"{FAKES / 'pals'}{os.pathsep}{env['PATH']}"
        env.setdefault("PBS_JOBID", "bench")
    if launcher == "srun":
        env["PATH"] = f"{FAKES / 'slurm'}{os.pathsep}{env['PATH']}"
        env.setdefault("SLURM_JOB_ID", "bench")
    return env


def run_session(launcher: str, ranks: int, workdir: Path) -> tuple[float, str]:
    """Wall seconds of one session and its outcome line."""
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--launcher={launcher}",
        f"--ranks={ranks}",
    ]
    started = time.perf_counter()
    proc = subprocess.run(
        argv, cwd=workdir, env=session_env(launcher), capture_output=True, text=True, timeout=600
    )
    wall = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    outcome = lines[-1].strip("= ") if lines else f"exit {proc.returncode}"
    if proc.returncode != 0:
        outcome = f"FAILED (exit {proc.returncode}): {outcome}"
    return wall, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--launchers", default="local,mpiexec,torchrun,pals,srun")
    args = parser.parse_args()
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    if not shutil.which("mpiexec"):
        launchers = [name for name in launchers if name not in ("mpiexec", "pals")]
        print("mpiexec not on PATH (pip install mpich): skipping mpiexec and pals", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sprite-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "test_trivial.py").write_text(TEST.format(ranks=args.ranks))
        for launcher in launchers:
            wall, outcome = run_session(launcher, args.ranks, workdir)
            rows.append((launcher, wall, outcome))
    base = next((wall for name, wall, _ in rows if name == "local"), None)
    print(f"session start-up cost, {args.ranks}-rank session, one run each ({os.cpu_count()} CPUs)")
    print(f"{'launcher':<10} {'session s':>10} {'over local s':>13}  outcome")
    for name, wall, outcome in rows:
        over = f"{wall - base:+.1f}" if base is not None and name != "local" else "-"
        shown = {"pals": "pals*", "srun": "srun*"}.get(name, name)
        print(f"{shown:<10} {wall:>10.1f} {over:>13}  {outcome}")
    print("* pals against tests/fakes/pals/mpiexec (MPICH underneath), srun against tests/fakes/slurm/srun")


if __name__ == "__main__":
    main()
