"""Wall time of the 4-rank FP32 parity test (single, ddp, fsdp) and of each arm, on the tiny model.

Runs the issue's example test in a fresh pytest session (the way a user runs it) and prints the session's
wall time, the test body's time and every arm's time, with the parity figures next to the seed's 4-rank
A100 cell (AF) for comparison. Figures only, never a timed assertion.

    OMP_NUM_THREADS=1 python bench/parity.py [--ranks 4] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

TEST = textwrap.dedent(
    """
    import json, os, time
    import pytest
    import lightning.pytorch, peft, transformers  # loaded once by the agents, inherited by test children
    from pytest_sprite import assert_parity

    @pytest.mark.ranks({ranks})
    def test_lora_parity(world, lora_qwen):
        start = time.perf_counter()
        ref = lora_qwen.run("single")
        ddp = lora_qwen.run("ddp")
        fsdp = lora_qwen.run("fsdp")
        result = assert_parity(ref, ddp, fsdp)
        body = time.perf_counter() - start
        if world.rank == 0:
            with open(os.environ["SPRITE_BENCH_OUT"], "w") as fh:
                json.dump(dict(body=body, arms={{r.arm: r.wall_s for r in (ref, ddp, fsdp)}},
                               table=result.table()), fh)
    """
)

# The seed's FP32 cell AF: 4x A100, Qwen2.5-0.5B, global batch 8 (one run).
SEED_AF = """\
Arm   Ranks  Global batch  Result  Pre-clip norm rel  Post-clip norm rel  Update rel L2  Frozen changed
ddp   4      8             pass    2.40e-6            1.55e-7             4.17e-6        0 of 290
fsdp  4      8             pass    2.93e-6            1.55e-7             4.10e-6        0 of 290"""


def run_once(ranks: int, workdir: Path) -> dict[str, Any]:
    """One pytest session of the parity test; its wall time plus what the test measured inside."""
    test_file = workdir / "test_bench_parity.py"
    test_file.write_text(TEST.format(ranks=ranks))
    out = workdir / "figures.json"
    out.unlink(missing_ok=True)
    env = {
        **os.environ,
        "SPRITE_BENCH_OUT": str(out),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(test_file),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--ranks={ranks}",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False)
    session = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the parity test failed (exit {proc.returncode}); see its output above")
    figures = json.loads(out.read_text())
    figures["session"] = session
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the parity test (default 4)")
    parser.add_argument("--repeat", type=int, default=1, help="sessions to run; the fastest is reported")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="sprite-bench-parity-") as tmp:
        for _ in range(args.repeat):
            runs.append(run_once(args.ranks, Path(tmp)))
    best = min(runs, key=lambda r: r["session"])
    import torch

    print(
        f"FP32 parity test, {args.ranks} ranks, tiny Qwen2 + LoRA on CPU (gloo), torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, {os.cpu_count()} cores, "
        f"best of {len(runs)}"
    )
    print()
    print(f"  pytest session (start, agents, 1 test, exit)  {best['session']:6.2f} s")
    print(f"  test body (3 arms + assert_parity)            {best['body']:6.2f} s")
    for arm in ("single", "ddp", "fsdp"):
        print(f"    arm {arm:<6}                                  {best['arms'][arm]:6.2f} s")
    print()
    print("Figures of this run:")
    print(textwrap.indent(best["table"], "  "))
    print()
    print("Seed anchor, cell AF (4x A100-SXM4-40GB, Qwen2.5-0.5B):")
    print(textwrap.indent(SEED_AF, "  "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
