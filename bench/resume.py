"""Wall time of one resume check per strategy, and what its process start-up costs: forks against interpreters.

Runs every role of ``assert_resume_bitexact`` (fit, twin, killed fit, resume, reload, and reshard or export
where the strategy has them) at ``--ranks`` ranks from this process, the way a plain test's sub-worlds run:
each role's ranks are forked from here. For each strategy it prints the check's wall time, the sum of the
roles' start-up (fork until every rank had its rendezvous details), and the verdict. Then it runs the same
roles of one strategy again with every rank started as a new Python interpreter (same rank code, same
roles), side by side with the forks. Figures only, never a timed assertion; on a shared 2-core machine
they are noisy, so read them as an order of magnitude.

    OMP_NUM_THREADS=1 python bench/resume.py [--ranks 4] [--strategies single ddp fsdp fsdp_file]
                                             [--precision 32-true] [--interpreters ddp]
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Loaded here once, so every forked rank starts with them (as a test module's imports do for test children).
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import transformers  # noqa: F401

from pytest_sprite.assertions.resume import judge_resume
from pytest_sprite.recipes._resume import ResumeRecipe
from pytest_sprite.recipes.artifacts import load_resume_run, write_resume_run
from pytest_sprite.recipes.lora_qwen import LoraQwen
from pytest_sprite.recipes.resume_roles import run_resume_roles

# The seed's checkpoint cells on 4 A100s (one run each): verdicts only; the seed prints no timings.
SEED = """\
AC32: A100 n4, FP32  4  8  4 → 2  pass; 12 faults rejected
ACB: A100 n4, BF16   4  8  4 → 2  pass; 12 faults rejected"""


class _Interpreters:
    """Starts each rank as ``python -c ...`` running the same rank code a fork runs (for comparison only)."""

    reaps = False

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.files: list[str] = []

    def spawn(self, request: tuple[Any, ...], channel: Any, host_fds: Sequence[int] = ()) -> int:
        """A new interpreter holds none of ``host_fds``: Python's sockets are not inheritable."""
        fd, path = tempfile.mkstemp(prefix="sprite-bench-payload-")
        os.write(fd, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        os.close(fd)
        self.files.append(path)
        code = (
            "import socket, sys\n"
            "from pytest_sprite.subworld.rank_body import rank_main\n"
            f"rank_main(open({path!r}, 'rb').read(), socket.socket(fileno={channel.fileno()}))\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[channel.fileno()])
        self.procs[proc.pid] = proc
        return proc.pid

    def poll(self) -> dict[int, int]:
        done = {}
        for pid in list(self.procs):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                done[pid] = status
                del self.procs[pid]
                self.procs.pop(pid, None)
        return done

    def waitable(self) -> list[int]:
        return []  # polled: the comparison is of start-up, not of noticing an exit


def one_check(strategy: str, ranks: int, precision: str) -> dict[str, Any]:
    recipe = ResumeRecipe(source=LoraQwen(), global_batch=2 * ranks)
    with tempfile.TemporaryDirectory(prefix="sprite-bench-resume-") as root:
        start = time.perf_counter()
        run = run_resume_roles(
            recipe,
            strategy=strategy,
            precision=precision,
            ranks=ranks,
            directory=root,
            reshard=strategy == "fsdp",
        )
        wall = time.perf_counter() - start
        saved = time.perf_counter()
        stored = write_resume_run(run, root, fresh=False)
        save = time.perf_counter() - saved
        size = stored.stat().st_size
        loaded = time.perf_counter()
        again = judge_resume(load_resume_run(stored))
        reload = time.perf_counter() - loaded
    result = judge_resume(run)
    assert again.to_dict() == result.to_dict(), "the stored run was judged differently"
    return {
        "stored_kb": size / 1024,
        "save": save,
        "reload": reload,
        "wall": wall,
        "startup": sum(s for _, s in run.timings.values()),
        "roles": run.timings,
        "verdict": "pass" if result.passed else "FAIL",
        "result": result,
    }


def one_role(
    strategy: str, ranks: int, precision: str, interpreters: bool = False
) -> tuple[float, float, bool]:
    """One ``fit`` role in a sub-world: its wall time, start-up and whether every rank returned.

    With ``interpreters`` every rank is a new interpreter instead of a fork (the plain-test sub-world's
    host side, given another forker).
    """
    from pytest_sprite.recipes._resume import RoleSpec, run_role
    from pytest_sprite.subworld.host import run_plain_world
    from pytest_sprite.subworld.zygote import DirectForker

    with tempfile.TemporaryDirectory(prefix="sprite-bench-role-") as root:
        spec = RoleSpec(
            role="fit",
            strategy=strategy,
            precision=precision,
            recipe=ResumeRecipe(source=LoraQwen(), global_batch=2 * ranks),
            directory=str(Path(root) / "fit"),
        )
        n = 1 if strategy == "single" else ranks
        forker = _Interpreters() if interpreters else DirectForker()
        result = run_plain_world(run_role, (spec,), {}, size=n, kill=None, timeout=1800, forker=forker)
    return result.wall_s, result.start_s, result.ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--strategies", nargs="*", default=["single", "ddp", "fsdp", "fsdp_file"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument(
        "--interpreters", nargs="*", default=["ddp"], help="strategies to rerun with new interpreters"
    )
    args = parser.parse_args()

    print(f"resume check, {args.ranks} ranks, {args.precision}, tiny Qwen2 on CPU (gloo); sub-worlds by fork")
    print(
        f"{'strategy':<10} {'check s':>8} {'start-up s':>11}  roles (wall s / start-up s)  verdict  stored KB  save s  load+judge s"
    )
    results = {}
    for strategy in args.strategies:
        fig = one_check(strategy, args.ranks, args.precision)
        results[strategy] = fig
        roles = " ".join(f"{k} {w:.1f}/{s:.2f}" for k, (w, s) in fig["roles"].items())
        print(
            f"{strategy:<10} {fig['wall']:>8.1f} {fig['startup']:>11.2f}  {roles}  {fig['verdict']}"
            f"  {fig['stored_kb']:>9.0f}  {fig['save']:>6.3f}  {fig['reload']:>12.3f}",
            flush=True,
        )

    for strategy in args.interpreters:
        print()
        print(f"{strategy} fit role at {args.ranks} ranks: ranks started by fork against new interpreters")
        print(f"{'':<14} {'role s':>8} {'start-up s':>11}")
        for label, interpreters in (("fork", False), ("interpreter", True)):
            wall, startup, ok = one_role(strategy, args.ranks, args.precision, interpreters)
            print(
                f"{label:<14} {wall:>8.1f} {startup:>11.2f}   ({'returned' if ok else 'FAILED'})", flush=True
            )
        print("(start-up: from the call until every rank runs with the role's code loaded; an interpreter")
        print(" imports torch, Lightning, transformers and PEFT there, a fork already has them)")

    print()
    print("verdict tables of this run beside the seed's A100 cells:")
    for fig in results.values():
        print(fig["result"].verdict_table().splitlines()[-1])
    print(SEED)
    print()
    for fig in results.values():
        print(fig["result"].gaps_table())


if __name__ == "__main__":
    main()
