"""The seed's hardware cells, each run at its world size on this CPU machine, beside the seed's figures.

For each cell of the published hardware matrix (FP32 parity AF..X8F, criterion v2 A440..X8B,
checkpoint resume AC32..X2CB) it runs the cell's checks in one pytest session at the cell's world size as a
local world (``--ranks=N``, forked ranks, gloo, the tiny Qwen2 + LoRA), with the session store of clean results
(``--sprite-reuse=auto``), so fault cases reuse the clean arms. The command of a criterion or resume cell is the
one ``hpc/aurora/README.md`` or ``hpc/slurm/README.md`` gives for the real machine (its ``SPRITE_TESTS`` and
``SPRITE_K``); an FP32 parity cell runs the shipped suite's ``test_lora_parity`` at the cell's size. Verdicts
and figures are read from each session's ``--sprite-report`` JSON. It prints the seed's table with this
machine's results and figures beside the seed's hardware ones, and writes ``docs/measurements/cells.md``
(the figures behind it go to ``cells.json`` beside it; a run replaces the cells it ran and keeps the others).
Figures only, never a timed assertion. ``--profile`` adds ``--sprite-profile``'s split; ``--baseline CHECKOUT``
runs each cell with another checkout first (``bench/baseline.py``), both printed side by side.

    OMP_NUM_THREADS=1 python bench/cells.py [--cells X1B,AF,...] [--max-ranks 48] [--timeout 1200] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from baseline import baseline_env, on_path, print_comparison, takes_option
from cells_tables import (
    CELL_HEADERS,
    MEMORY_HEADERS,
    SEED_TESTED,
    Cell,
    cell_rows,
    detail_tables,
    markdown_table,
    memory_rows,
    parse_rows,
    seed_figures,
    text_report,
)
from process_memory import Watch, roles_record
from profile_split import print_profiles, profile_totals

ROOT = Path(__file__).resolve().parents[1]
READMES = {"aurora": ROOT / "hpc" / "aurora" / "README.md", "slurm": ROOT / "hpc" / "slurm" / "README.md"}
PER_NODE = {"aurora": 12, "slurm": 4}
PAGE = ROOT / "docs" / "measurements" / "cells.md"
KINDS = ("parity", "criterion", "resume")

# -- the cells: the seed's Tested rows, each with the command hpc/ gives it -------------------------------------


def readme_command(cell: str) -> tuple[str, list[str], int]:
    """The cell's one ``qsub``/``sbatch`` line in ``hpc/*/README.md``: (README, its pytest selection, ranks)."""
    for site, readme in READMES.items():
        for line in readme.read_text(encoding="utf-8").splitlines():
            if line.startswith(f"| {cell} |"):
                (command,) = re.findall(r"`((?:sbatch|qsub) [^`]+)`", line)
            elif re.search(rf"#\s*{re.escape(cell)}\s*$", line):
                command = line.split("#")[0].strip()
            else:
                continue
            return f"hpc/{site}/README.md", *_selection(site, shlex.split(command))
    raise ValueError(f"cell {cell}: no command for it in {', '.join(str(p) for p in READMES.values())}")


def _selection(site: str, words: list[str]) -> tuple[list[str], int]:
    """pytest arguments and world size of one job line (its SPRITE_TESTS, SPRITE_K and node count)."""
    if words[0] == "qsub":
        exported = words[words.index("-v") + 1]
        nodes = next((int(w.split("=")[1]) for w in words if w.startswith("select=")), 1)
    else:
        exported = next(w.removeprefix("--export=") for w in words if w.startswith("--export="))
        nodes = int(words[words.index("-N") + 1]) if "-N" in words else 1
    env = dict(p.split("=", 1) for p in exported.split(",") if p != "ALL")
    tests = shlex.split(env["SPRITE_TESTS"]) + (["-k", env["SPRITE_K"]] if env.get("SPRITE_K") else [])
    return tests, nodes * int(env.get("SPRITE_RANKS_PER_NODE", PER_NODE[site]))


def seed_cells() -> list[Cell]:
    """The seed's 17 hardware cells in its order, each with its command and world size."""
    cells = []
    for check, hardware, result in parse_rows(SEED_TESTED, 3):
        name = re.search(r"\((\w+)\)", check).group(1)  # type: ignore[union-attr]
        kind = "parity" if check.startswith("FP32") else "criterion" if "criterion" in check else "resume"
        where, _, software = hardware.partition(", torch")
        if kind == "parity":
            ranks = int(seed_figures()[name]["fp32"][0][1])
            tests = [
                "--pyargs",
                "pytest_sprite.suite.test_parity",
                "-k",
                f"test_lora_parity and ranks{ranks}",
            ]
            source = "the shipped suite's FP32 test (`hpc/*/sprite.pbs` runs the whole suite)"
        else:
            source, tests, ranks = readme_command(name)
        cells.append(Cell(name, kind, ranks, tuple(tests), source, where, "torch" + software, result))
    return cells


def select(cells: list[Cell], names: str | None, max_ranks: int) -> list[Cell]:
    """The cells to run, smallest world first; unknown names and cells over ``max_ranks`` are refused."""
    known = {c.name: c for c in cells}
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise SystemExit(
                f"--cells: unknown cell {', '.join(unknown)}; the seed's cells are {', '.join(known)}"
            )
        over = [n for n in wanted if known[n].ranks > max_ranks]
        if over:
            raise SystemExit(
                f"--cells: {', '.join(f'{n} ({known[n].ranks} ranks)' for n in over)} over --max-ranks={max_ranks}; "
                f"pass --max-ranks={max(known[n].ranks for n in over)} to run it"
            )
        chosen = [known[n] for n in wanted]
    else:
        chosen = [c for c in cells if c.ranks <= max_ranks]
    order = {c.name: i for i, c in enumerate(cells)}
    return sorted(chosen, key=lambda c: (c.ranks, KINDS.index(c.kind), order[c.name]))


# -- running one cell -------------------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C the session as a user would (the harness ends its worlds), then harder if it does not exit."""
    for signum, grace in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_cell(
    cell: Cell, workdir: Path, timeout: float, tree: Path | None = None, profile: bool = False
) -> dict[str, Any]:
    """One pytest session of the cell's tests; its wall time, peak memory, load and the report it wrote.

    ``tree``: a folder holding another ``pytest_sprite`` (the committed one, a baseline checkout), put first on
    the session's path.
    """
    report, basetemp, log = workdir / f"{cell.name}.json", workdir / cell.name, workdir / f"{cell.name}.log"
    command = [*cell.command(str(report), str(basetemp)), *(["--sprite-profile"] if profile else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if tree is not None:
        env = on_path(tree, env)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *command[1:]], cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        watch = Watch(proc.pid)
        watch.start()
        try:
            exitcode: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            exitcode = None
            _stop(proc)
    wall = time.perf_counter() - start
    watch.done.set()
    watch.join()
    leftovers = watch.end_leftovers()
    record: dict[str, Any] = {
        "cell": cell.name,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(cell.command()),
        "wall_s": round(wall, 1),
        "peak_pss_gb": round(watch.peak_kb / 2**20, 2),
        "memory_at_peak": roles_record(watch.peak_roles),
        "load": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "exitcode": exitcode,
        "leftovers_ended": leftovers,
    }
    if exitcode not in (0, None):
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
    if exitcode is None:
        reason = f"stopped after {timeout / 60:.0f} min (--timeout)"
        if report.exists():  # an interrupted session still writes its report: what had passed by then
            passed = sum(t["outcome"] == "passed" for t in json.loads(report.read_text()).get("tests", []))
            reason += f", {passed} of {expected_tests(cell)} tests passed by then"
        return {**record, "status": "not run", "reason": reason}
    if not report.exists():
        tail = log.read_text(errors="replace")[-3000:]
        return {
            **record,
            "status": "not run",
            "reason": f"no report (exit {exitcode}): {tail.strip()[-300:]}",
        }
    if profile:
        record["profile"] = {k: round(v, 1) for k, v in profile_totals(report).items()}
    return {**record, "status": "measured", **judge(cell, json.loads(report.read_text()))}


# -- verdicts and figures, read from the session's --sprite-report document ----------------------------------------


def _figure(value: float | str | None) -> str:
    from pytest_sprite.assertions.tables import figure_cell

    return figure_cell(value)


def _tests(document: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [t for t in document.get("tests", []) if t["nodeid"].split("::")[-1].startswith(name)]


def _payload(test: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The test's last recorded assertion of ``kind`` (None when the test ended before asserting)."""
    found = [a for a in test.get("assertions", []) if a.get("kind") == kind]
    return found[-1] if found else None


def _why(test: dict[str, Any]) -> str:
    phase = next((test[p] for p in ("setup", "call", "teardown") if test.get(p, {}).get("longrepr")), {})
    return f"{test['nodeid'].split('::')[-1]} {test['outcome']}" + (
        f" ({str(phase['longrepr'])[:160]})" if phase else ""
    )


def expected_tests(cell: Cell) -> int:
    """How many tests the seed's cell runs: parity 1; criterion clean + its fault cases; resume 4 + 12 faults."""
    faults = re.search(r"(\d+) fault", cell.seed_result)
    if cell.kind == "resume":
        return 4 + (int(faults.group(1)) if faults else 0)
    return 1 + (int(faults.group(1)) if faults and cell.kind == "criterion" else 0)


def judge(cell: Cell, document: dict[str, Any]) -> dict[str, Any]:
    """The cell's result in the seed's words, the test counts and the figures the seed's tables show."""
    tests = document.get("tests", [])
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    result, figures = {"parity": _parity, "criterion": _criterion, "resume": _resume}[cell.kind](document)
    problems = [_why(t) for t in tests if t["outcome"] != "passed"]
    if len(tests) != expected_tests(cell):
        problems.insert(0, f"ran {len(tests)} tests, the seed's cell has {expected_tests(cell)}")
    if problems:
        result = (
            "FAIL: "
            + "; ".join(problems[:4])
            + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
        )
    return {"tests": counts, "result": result, "figures": figures}


def _parity(document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    payloads = [p for t in _tests(document, "test_lora_parity") if (p := _payload(t, "parity"))]
    rows = [
        [
            arm["label"],
            str(arm["ranks"]),
            str(arm["global_batch"]),
            "pass" if arm["passed"] else "FAIL",
            *(_figure(arm[k]) for k in ("pre_norm_rel", "post_norm_rel", "update_rel_l2")),
            f"{arm['frozen_changed']} of {arm['frozen_total']}",
        ]
        for p in payloads
        for arm in p["arms"]
    ]
    passed = bool(payloads) and all(p["passed"] for p in payloads)
    return ("pass" if passed else "FAIL"), {"fp32": rows}


def _criterion(document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    clean = [p for t in _tests(document, "test_criterion_v2_clean") if (p := _payload(t, "criterion_v2"))]
    scored = [
        [("gate" if c is p["gate"] else c["role"]), *(_figure(c[k]) for k in _SCORED)]
        for p in clean
        for c in (p["gate"], *p["scored"])
    ]
    faults, rejected = [], 0
    for test in _tests(document, "test_criterion_v2_fault"):
        payload = _payload(test, "criterion_v2")
        for row in payload["faults"] if payload else []:
            faults.append(
                [
                    *(row["fault"], row["arm"].split(" ")[0], row["status"]),
                    ", ".join(row["rejecting_evidence"]) or "-",
                    *(_figure(row["pre_norm_rel"]), _figure(row["max_gradient_gap"])),
                ]
            )
            rejected += test["outcome"] == "passed" and row["status"] == "rejected"
    if not clean:
        return "FAIL: no criterion v2 result", {"scored": scored, "faults": faults}
    p = clean[0]
    invariants = all(i["passed"] for i in p["invariants"])
    result = p["verdict"] if p["verdict"] != "pass" else "pass"
    if p["gate"]["passed"] and invariants:
        result += "; gate and invariants pass"
    if faults:
        result += f"; {rejected} fault cases rejected"
    return result, {"scored": scored, "faults": faults}


_SCORED = ("pre_norm_rel", "max_gradient_gap", "update_rel_l2", "max_update_gap")
_GAPS = ("loss", "pre_clip_norm", "update", "adam_m", "adam_v")


def _resume(document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    clean = [p for t in _tests(document, "test_resume[") if (p := _payload(t, "resume"))]
    gaps = [[g["arm"], *(_figure(g[k]) for k in _GAPS)] for p in clean for g in p["gaps"]]
    shape = [
        [str(p["ranks"]), str(p["global_batch"]), f"{p['ranks']} → {p['reshard_ranks']}"]
        for p in clean
        if p["reshard_ranks"]
    ]
    rejected = sum(t["outcome"] == "passed" for t in _tests(document, "test_resume_fault_is_rejected"))
    passed = len(clean) == 4 and all(p["passed"] for p in clean)
    return f"{'pass' if passed else 'FAIL'}; {rejected} faults rejected", {"gaps": gaps, "shape": shape}


# -- the page ---------------------------------------------------------------------------------------------------


def environment(committed: bool) -> dict[str, Any]:
    """This machine, the versions the cells ran with, and the commit (with or without the working tree's changes)."""
    model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    memory = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "pytest_sprite"], cwd=ROOT, capture_output=True, text=True
    )
    changes = "" if committed or not dirty.stdout.strip() else " + uncommitted changes"
    versions = {"Python": platform.python_version()}
    for name in ("torch", "lightning", "transformers", "peft", "pytest", "pytest-sprite"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    cpu = f"{os.cpu_count()} cores ({model.group(1) if model else platform.machine()})"
    ram = f"{int(memory.group(1)) / 2**20:.0f} GiB" if memory else "?"
    return {
        "machine": f"{cpu}, {ram} RAM",
        "versions": versions,
        "commit": (commit.stdout.strip() or "?") + changes,
    }


INTRO = """\
# The hardware cells on CPU

FP32 parity, criterion v2 and the checkpoint resume check were published with a hardware matrix
([where the rules come from](../explanation/where-the-rules-come-from.md)): FP32 parity AF to X8F, BF16 criterion v2 A440 to X8B, checkpoint resume AC32 to
X2CB. This page runs each of them at its world size on a CPU machine.

## What a cell is

A **cell** is one check at one world size on one machine: X2B is criterion v2 at 24 ranks on 2 Aurora nodes (12
tiles each), AC32 the FP32 checkpoint resume at 4 ranks on 4 A100s. The names are those of the published
matrix; the first table below gives each cell's check, hardware and world size. Each cell is one command of the job scripts (`hpc/aurora/README.md`,
`hpc/slurm/README.md`); what ran on the real machines is on [Tested](../tested.md).
"""

METHOD = """\
## How the cells ran here

One pytest session per cell, a local world of forked ranks (`--ranks=N`, gloo, the tiny Qwen2 + LoRA of
`lora_qwen`), the clean results shared through the session store (`--sprite-reuse=auto`) so fault cases reuse the
clean arms. A criterion or resume cell runs the command `hpc/aurora/README.md` or `hpc/slurm/README.md` gives for
its machine (the same tests and `-k`); an FP32 parity cell runs the shipped suite's `test_lora_parity` at its size.
Results and figures come from each session's `--sprite-report` JSON. The hardware cells have not run with
pytest-sprite yet, so the "published" column is the published run (Qwen2.5-0.5B on A100s or Aurora tiles).

Read the "here" column as "the same checks pass at the same world size"; the figures are not the published
magnitudes (another model, CPU kernels, gloo). Wall time and memory are this machine's: 2 cores shared by every
rank (and, on a shared machine, by other work: the load average is given with each cell; above 2, the times are a
loaded machine's, an order of magnitude at best). Peak PSS is the summed proportional set size of the session's
processes, sampled every 10 s (forked ranks share their pages; a shorter peak between samples is missed). A cell
stopped at `--timeout` (20 minutes by default) is listed as not run here, with the reason.
"""


MEMORY_NOTE = """\
Sampled with the peak: the session's processes summed by the name pytest-sprite gives each
(`python` is the pytest controller; per rank a `sprite-agent`, its `sprite-test` child running the test
and the `sprite-spare` child forked for the next test (counted with `sprite-test` where a cell has no
`sprite-spare` row: it was measured before the spare had a name of its own), a `sprite-pristine` zygote and the test's `sprite-zygote`, from which the `sprite-subworld` ranks of an arm
or role are forked). PSS splits each shared page between the processes sharing it. "Written (anon)" is
memory a process wrote (Python objects, tensors, gloo's buffers, and what it still shares with the
process it was forked from); "files" is its share of mapped files, mostly the shared libraries of torch."""


def page(cells: list[Cell], records: dict[str, dict[str, Any]]) -> str:
    """The whole of ``docs/measurements/cells.md``: what was measured, when, where, and the tables."""
    measured = [records[c.name] for c in cells if c.name in records]
    dates = sorted(r["date"] for r in measured)
    machines = sorted({r["machine"] for r in measured})
    versions = sorted({", ".join(f"{k} {v}" for k, v in r["versions"].items()) for r in measured})
    commands = sorted({r["bench"] for r in measured})
    loads = ", ".join(f"{r['cell']} {r['load'][0]} / {r['load'][1]}" for r in measured)
    lines = [
        INTRO,
        "## The cells",
        "",
        markdown_table(CELL_HEADERS, cell_rows(cells, records)),
        "",
        METHOD,
        "- Command: " + ("; ".join(f"`{c}`" for c in commands) or "`OMP_NUM_THREADS=1 python bench/cells.py`")
        + " (each cell's pytest command is in the last table).",
        f"- Date: {dates[0]} to {dates[-1]} (each cell's in its row)." if dates else "- Date: nothing measured yet.",
        "- Machine: " + ("; ".join(machines) or "-") + f". Load average before / after each cell: {loads or '-'}.",
        "- Versions: " + ("; ".join(versions) or "-")
        + f"; commit {', '.join(sorted({r['commit'] for r in measured})) or '-'}.",
    ]  # fmt: skip
    for title, headers, rows in detail_tables(cells, records):
        lines += ["", f"## {title}", "", markdown_table(headers, rows)]
    if memory := memory_rows(cells, records):
        lines += [
            "",
            "## Memory at the peak, by process",
            "",
            MEMORY_NOTE,
            "",
            markdown_table(MEMORY_HEADERS, memory),
        ]
    command_rows = [
        [c.name, f"`{records.get(c.name, {}).get('command') or shlex.join(c.command())}`", c.source]
        for c in cells
    ]
    lines += [
        "",
        "## The command of each cell",
        "",
        markdown_table(["Cell", "Command here", "From"], command_rows),
    ]
    return "\n".join(lines) + "\n"


def _committed_tree(folder: Path) -> Path:
    """HEAD's ``pytest_sprite`` in ``folder`` (others' uncommitted work in the tree stays out of the run)."""
    folder.mkdir()
    archive = subprocess.run(
        ["git", "archive", "HEAD", "pytest_sprite"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def _print_cell(label: str, record: dict[str, Any]) -> None:
    print(f"  {label + ': ' if label else ''}{record['wall_s']:.0f} s, peak PSS {record['peak_pss_gb']:.1f} GB: "
          f"{record.get('result') or 'not run here: ' + record['reason']}", flush=True)  # fmt: skip
    if "profile" in record and not label:
        print_profiles({record["cell"]: dict(record["profile"])})


def _baseline_cell(cell: Cell, workdir: Path, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The cell run with the baseline checkout first on the path (profiled when it has the option too)."""
    workdir.mkdir()
    profile = args.profile and takes_option(args.baseline.resolve(), "--sprite-profile")
    record = {**run_cell(cell, workdir, args.timeout, args.baseline.resolve(), profile), "commit": name}
    _print_cell(f"baseline {name}", record)
    return record


def _side_by_side(before: dict[str, Any], now: dict[str, Any], report: Path) -> dict[str, Any]:
    """Print the baseline's and this checkout's cell together; what the cell's record keeps of the baseline."""
    print(f"  ratio: {now['wall_s'] / max(before['wall_s'], 0.1):.2f} (now / baseline)")
    print_profiles({f"baseline {before['commit']}": before.get("profile", {}), "now": now.get("profile", {})})
    same = report.exists() and (report.parent / "baseline" / report.name).exists()
    same = same and print_comparison(report.parent / "baseline" / report.name, report, indent="  ")
    keep = ("commit", "wall_s", "peak_pss_gb", "load", "status", "result", "profile")
    return {**{k: before[k] for k in keep if k in before}, "same_verdicts": same}


def load_records(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    records: dict[str, dict[str, Any]] = json.loads(path.read_text())["cells"]
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", help="comma-separated cell names (default: every cell up to --max-ranks)")
    parser.add_argument(
        "--max-ranks", type=int, default=48, help="largest world to run (default 48; 96: X8F, X8B)"
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds a cell may take (default 1200)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    parser.add_argument("--render", action="store_true", help="only write the page again from its .json")
    parser.add_argument(
        "--committed",
        action="store_true",
        help="run HEAD's pytest_sprite (git archive), not the working tree's",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each cell with --sprite-profile and print where its time went",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="another checkout of pytest-sprite (git worktree add /tmp/base <commit>): each cell runs with it "
        "first, then with this one, both printed side by side (the page keeps this one's figures)",
    )
    parser.add_argument(
        "--page", type=Path, default=PAGE, help=f"page to write (default {PAGE.relative_to(ROOT)})"
    )
    args = parser.parse_args(argv)
    cells = seed_cells()
    chosen = select(cells, args.cells, args.max_ranks)
    if args.dry_run:
        for c in chosen:
            print(f"{c.name:<6} {c.kind:<9} {c.ranks:>3} ranks  {shlex.join(c.command())}  [{c.source}]")
        return 0
    data = args.page.with_suffix(".json")
    records = load_records(data)
    if args.render:
        args.page.write_text(page(cells, records))
        print(text_report(cells, records))
        return 0
    env = {
        **environment(args.committed),
        "bench": "OMP_NUM_THREADS=1 " + shlex.join(["python", "bench/cells.py", *(argv or sys.argv[1:])]),
    }
    print(f"{env['machine']}; load average {os.getloadavg()[0]:.1f} before", flush=True)
    with tempfile.TemporaryDirectory(prefix="sprite-bench-cells-") as tmp:
        tree = _committed_tree(Path(tmp) / "tree") if args.committed else None
        base = None if args.baseline is None else baseline_env(args.baseline, dict(os.environ), Path(tmp))[1]
        for c in chosen:
            print(f"{c.name}: {c.ranks} ranks, {shlex.join(c.tests)} ...", flush=True)
            workdir = Path(tmp) / c.name
            workdir.mkdir()
            before = None if base is None else _baseline_cell(c, workdir / "baseline", args, base)
            record = {**run_cell(c, workdir, args.timeout, tree, args.profile), **env}
            _print_cell("now" if before else "", record)
            if before is not None:
                record["baseline"] = _side_by_side(before, record, workdir / f"{c.name}.json")
            records[c.name] = record
            data.write_text(json.dumps({"cells": records}, indent=1, ensure_ascii=False) + "\n")
            args.page.write_text(page(cells, records))
    print(f"load average {os.getloadavg()[0]:.1f} after; wrote {args.page} and {data}")
    print()
    print(text_report(cells, records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
