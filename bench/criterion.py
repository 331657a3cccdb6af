"""Wall time of the 4-rank BF16 criterion v2 run (six arms), of its eight fault cases, and of each arm.

Runs the issue's example tests in one fresh pytest session (the way a user runs them): the clean criterion,
then the seed's eight arm/fault cases, each test running its six arms. Prints the session's wall time, the
clean test body and every arm's time, each fault case's body time and their sum, and this run's scored
step-0 figures and fault table next to the seed's four-rank A100 cell (A100 n4 / A440). Figures only, never
a timed assertion; on a shared machine they are noisy (the load average is printed with them).

    OMP_NUM_THREADS=1 python bench/criterion.py [--ranks 4] [--faults all|none]
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
    from pytest_sprite import CriterionError, assert_criterion_v2, expect_fault_rejected

    ARMS = ("ref32", "ref", "split", "split_premul", "ddp", "fsdp")
    CASES = {cases!r}

    def arms_of(lora_qwen, fault=None, on=None):
        return {{a: lora_qwen.run(a, precision="bf16-mixed", fault=fault if a == on else None) for a in ARMS}}

    def write(world, name, data):
        if world.rank == 0:
            with open(os.path.join(os.environ["SPRITE_BENCH_OUT"], name + ".json"), "w") as fh:
                json.dump(data, fh)

    @pytest.mark.ranks({ranks})
    def test_clean(world, lora_qwen):
        start = time.perf_counter()
        arms = arms_of(lora_qwen)
        result = assert_criterion_v2(arms)
        body = time.perf_counter() - start
        write(world, "clean", dict(body=body, arms={{a: r.wall_s for a, r in arms.items()}},
                                   scored=result.scored_table(), diagnostics=result.diagnostics.table()))

    @pytest.mark.ranks({ranks})
    @pytest.mark.parametrize(("fault", "arm"), CASES)
    def test_fault(world, lora_qwen, fault, arm):
        start = time.perf_counter()
        arms = arms_of(lora_qwen, fault, arm)
        with expect_fault_rejected(fault) as rejection:
            assert_criterion_v2(arms)
        body = time.perf_counter() - start
        (row,) = rejection.evidence.result.rejection_rows()
        write(world, f"fault-{{fault}}-{{arm}}", dict(body=body, arms={{a: r.wall_s for a, r in arms.items()}}, row=row))
    """
)

CASES = [
    ("missing-rank", "ddp"),
    ("missing-rank", "fsdp"),
    ("wrong-scale", "ddp"),
    ("wrong-scale", "fsdp"),
    ("fp32-backbone", "ddp"),
    ("local-adapter", "ddp"),
    ("scale-grad", "ddp"),
    ("skip-update", "ddp"),
]

# The seed's A100 four-rank cells (4x A100-SXM4-40GB, Qwen2.5-0.5B, global batch 8; one run each).
SEED_A100_N4 = """\
Arm   Pre-clip norm rel  Max tensor gradient gap  Update rel L2  Max tensor update gap
gate  0                  0                        0              0
ddp   0                  1.93e-10                 0              0
fsdp  0                  1.69e-10                 5.63e-7        2.01e-5"""
SEED_A100_N3 = """\
Arm   Pre-clip norm rel  Max tensor gradient gap  Update rel L2  Max tensor update gap
gate  7.20e-9            3.47e-7                  5.79e-7        2.05e-5
ddp   7.19e-9            3.47e-7                  6.15e-7        2.80e-5
fsdp  2.58e-9            8.17e-8                  4.21e-7        1.76e-5"""
SEED_FAULTS = """\
Fault          Arm   Status    Rejecting evidence   Pre-clip norm rel  Max tensor gradient gap  Tensors over
missing-rank   ddp   rejected  pre_norm, gradients  0.238              0.526                    194/194 gradients, 194/194 updates
missing-rank   fsdp  rejected  pre_norm, gradients  0.238              0.526                    194/194 gradients, 194/194 updates
wrong-scale    ddp   rejected  pre_norm, gradients  3                  3                        194/194 gradients, 0/194 updates
wrong-scale    fsdp  rejected  pre_norm, gradients  3                  3                        194/194 gradients, 0/194 updates
fp32-backbone  ddp   rejected  dtype                3.37e-3            0.265                    360/361 invalid Linear sites per rank and step; 20 rank-step obs.
local-adapter  ddp   rejected  synchronized         1.24e-6            1.32                     gradient replica disagreements 15/20; parameter 15/20
scale-grad     ddp   rejected  pre_norm, gradients  3                  3                        194/194 gradients, 0/194 updates
skip-update    ddp   rejected  synchronized         0                  1.93e-10                 gradient replica disagreements 0/20; parameter 3/20"""


def _figure(value: float | str) -> str:
    from pytest_sprite.assertions.tables import format_figure

    return format_figure(value) if isinstance(value, float) else str(value)


def run_session(ranks: int, cases: list[tuple[str, str]], workdir: Path) -> dict[str, Any]:
    """One pytest session of the clean test and the fault cases; its wall time and what the tests measured."""
    (workdir / "test_bench_criterion.py").write_text(TEST.format(ranks=ranks, cases=cases))
    out = workdir / "figures"
    out.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "SPRITE_BENCH_OUT": str(out),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "test_bench_criterion.py",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--ranks={ranks}",
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    session = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-3000:])
        raise SystemExit(f"the criterion tests failed (exit {proc.returncode}); see their output above")
    figures = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return {"session": session, **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the criterion tests (default 4)")
    parser.add_argument("--faults", choices=("all", "none"), default="all", help="also run the 8 fault cases")
    args = parser.parse_args(argv)
    cases = CASES if args.faults == "all" else []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sprite-bench-criterion-") as tmp:
        figures = run_session(args.ranks, cases, Path(tmp))
    load_after = os.getloadavg()[0]
    import torch

    clean = figures["clean"]
    print(
        f"BF16 criterion v2, {args.ranks} ranks, tiny Qwen2 + LoRA on CPU (gloo), torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, {os.cpu_count()} cores, "
        f"load average {load_before:.1f} before / {load_after:.1f} after (shared machine: figures are noisy)"
    )
    print()
    print(f"  pytest session (start, agents, {1 + len(cases)} tests, exit)   {figures['session']:7.2f} s")
    print(f"  clean test body (6 arms + assert_criterion_v2)      {clean['body']:7.2f} s")
    for arm, seconds in clean["arms"].items():
        print(f"    arm {arm:<13}                                 {seconds:7.2f} s")
    if cases:
        total = 0.0
        print("  fault cases (6 arms + assert_criterion_v2 each):")
        for fault, arm in cases:
            body = figures[f"fault-{fault}-{arm}"]["body"]
            total += body
            print(f"    {fault:<14} on {arm:<5}                        {body:7.2f} s")
        print(f"    all {len(cases)} fault cases                               {total:7.2f} s")
    print()
    print("Scored step-0 comparisons of this run (against split; gate is split_premul):")
    print(textwrap.indent(clean["scored"], "  "))
    print()
    if args.ranks == 3:
        print("Seed anchor, cell A100 n3 (3x A100-SXM4-40GB, Qwen2.5-0.5B, global batch 6):")
        print(textwrap.indent(SEED_A100_N3, "  "))
    else:
        print("Seed anchor, cell A100 n4 (4x A100-SXM4-40GB, Qwen2.5-0.5B, global batch 8):")
        print(textwrap.indent(SEED_A100_N4, "  "))
    print()
    print("Diagnostics of this run (never scored):")
    print(textwrap.indent(clean["diagnostics"], "  "))
    if cases:
        print()
        print("Fault table of this run:")
        for fault, arm in cases:
            row = figures[f"fault-{fault}-{arm}"]["row"]
            pre, gap = (_figure(row[k]) for k in ("pre_norm_rel", "max_gradient_gap"))
            print(
                f"  {fault:<14} {arm:<5} {row['status']:<9} {', '.join(row['rejecting_evidence']):<20} "
                f"pre-norm rel {pre:<9} max grad gap {gap:<9} {row['tensors_over']}; {row['supporting_observations']}"
            )
        print()
        print("Seed anchor, A440 fault table (A100 n4):")
        print(textwrap.indent(SEED_FAULTS, "  "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
