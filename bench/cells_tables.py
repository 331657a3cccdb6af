"""The lightning-sprite seed's Tested table and its per-cell figure tables, as ``bench/cells.py`` prints them.

Copied from the seed ("Tested", "BF16 parity", "Checkpoints"; one run per cell on A100s or Aurora tiles), one row
a line with cells split on ``|``; :func:`seed_figures` parses them per cell. :func:`cell_rows` and
:func:`detail_tables` lay out the seed's tables with this machine's results and figures beside the seed's
(``records``: ``bench/cells.py``'s per-cell results).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- the seed's tables (lightning-sprite seed, "Tested", "BF16 parity" and "Checkpoints"; one run per cell) -----

SEED_TESTED = """\
FP32 parity (AF): DDP and FSDP2 vs 1 device | 4x A100-SXM4-40GB, torch 2.13.0+cu130, Lightning 2.6.5 | pass
FP32 parity (X1F): DDP and FSDP2 vs 1 device | 1 Aurora node, 12 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass
FP32 parity (X2F): DDP and FSDP2 vs 1 device | 2 Aurora nodes, 24 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass
FP32 parity (X4F): DDP and FSDP2 vs 1 device | 4 Aurora nodes, 48 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass
FP32 parity (X8F): DDP and FSDP2 vs 1 device | 8 Aurora nodes, 96 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass
BF16 parity, criterion v2 (A440) | 4x A100-SXM4-40GB, torch 2.13.0+cu130, Lightning 2.6.5 | pass; gate and invariants pass; 8 fault cases rejected
BF16 parity, criterion v2 (A3a) | 3x A100-SXM4-40GB, torch 2.13.0+cu130, Lightning 2.6.5 | pass; gate and invariants pass
BF16 parity, criterion v2 (X1B) | 1 Aurora node, 12 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; gate and invariants pass; 4 fault cases rejected
BF16 parity, criterion v2 (X2B) | 2 Aurora nodes, 24 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; gate and invariants pass
BF16 parity, criterion v2 (X4B) | 4 Aurora nodes, 48 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; gate and invariants pass; 4 fault cases rejected
BF16 parity, criterion v2 (X8B) | 8 Aurora nodes, 96 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; gate and invariants pass; 4 fault cases rejected
Checkpoint save and resume, FP32 (AC32) | 4x A100-SXM4-40GB, torch 2.13.0+cu130, Lightning 2.6.5 | pass; 12 faults rejected
Checkpoint save and resume, BF16 (ACB) | 4x A100-SXM4-40GB, torch 2.13.0+cu130, Lightning 2.6.5 | pass; 12 faults rejected
Checkpoint save and resume, FP32 (X1C32) | 1 Aurora node, 12 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; 12 faults rejected
Checkpoint save and resume, BF16 (X1CB) | 1 Aurora node, 12 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; 12 faults rejected
Checkpoint save and resume, FP32 (X2C32) | 2 Aurora nodes, 24 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; 12 faults rejected
Checkpoint save and resume, BF16 (X2CB) | 2 Aurora nodes, 24 tiles, Max 1550, torch 2.13.0a0 (ALCF frameworks 2026.1.0), Lightning 2.6.5 | pass; 12 faults rejected"""

# Cell | Arm | Ranks | Global batch | Result | Pre-clip norm rel | Post-clip norm rel | Update rel L2 | Frozen changed
SEED_FP32 = """\
AF | ddp | 4 | 8 | pass | 2.40e-6 | 1.55e-7 | 4.17e-6 | 0 of 290
AF | fsdp | 4 | 8 | pass | 2.93e-6 | 1.55e-7 | 4.10e-6 | 0 of 290
X1F | ddp | 12 | 24 | pass | 3.18e-6 | 2.38e-7 | 4.46e-6 | 0 of 290
X1F | fsdp | 12 | 24 | pass | 2.49e-6 | 2.38e-7 | 4.41e-6 | 0 of 290
X2F | ddp | 24 | 48 | pass | 2.56e-6 | 1.56e-7 | 3.99e-6 | 0 of 290
X2F | fsdp | 24 | 48 | pass | 2.36e-6 | 1.23e-7 | 4.06e-6 | 0 of 290
X4F | ddp | 48 | 96 | pass | 3.26e-5 | 1.90e-7 | 9.09e-6 | 0 of 290
X4F | fsdp | 48 | 96 | pass | 2.99e-5 | 1.90e-7 | 8.48e-6 | 0 of 290
X8F | ddp | 96 | 192 | pass | 1.84e-6 | 1.60e-7 | 2.61e-6 | 0 of 290
X8F | fsdp | 96 | 192 | pass | 1.73e-6 | 1.60e-7 | 2.62e-6 | 0 of 290"""

# The seed names its BF16 cells "A100 n4" ... "Aurora 8 nodes" in the matrices; Tested names them A440 ... X8B.
SEED_BF16_NAMES = {
    "A100 n4": "A440",
    "A100 n3": "A3a",
    "Aurora 1 node": "X1B",
    "Aurora 2 nodes": "X2B",
    "Aurora 4 nodes": "X4B",
    "Aurora 8 nodes": "X8B",
}
# Cell | Arm | Pre-clip norm rel | Max tensor gradient gap | Update rel L2 | Max tensor update gap
SEED_BF16_SCORED = """\
A100 n4 | gate | 0 | 0 | 0 | 0
A100 n4 | ddp | 0 | 1.93e-10 | 0 | 0
A100 n4 | fsdp | 0 | 1.69e-10 | 5.63e-7 | 2.01e-5
A100 n3 | gate | 7.20e-9 | 3.47e-7 | 5.79e-7 | 2.05e-5
A100 n3 | ddp | 7.19e-9 | 3.47e-7 | 6.15e-7 | 2.80e-5
A100 n3 | fsdp | 2.58e-9 | 8.17e-8 | 4.21e-7 | 1.76e-5
Aurora 1 node | gate | 3.98e-8 | 1.08e-7 | 6.18e-7 | 3.46e-5
Aurora 1 node | ddp | 8.34e-9 | 7.90e-8 | 5.63e-7 | 5.68e-5
Aurora 1 node | fsdp | 0 | 0 | 0 | 0
Aurora 2 nodes | gate | 3.61e-8 | 1.16e-7 | 5.92e-7 | 7.54e-5
Aurora 2 nodes | ddp | 1.60e-8 | 7.89e-8 | 3.96e-7 | 4.66e-5
Aurora 2 nodes | fsdp | 5.40e-15 | 1.83e-8 | 0 | 0
Aurora 4 nodes | gate | 1.87e-8 | 2.05e-7 | 9.32e-7 | 5.58e-5
Aurora 4 nodes | ddp | 6.88e-9 | 1.58e-7 | 5.84e-7 | 5.09e-5
Aurora 4 nodes | fsdp | 1.00e-12 | 1.62e-8 | 1.42e-12 | 4.15e-10
Aurora 8 nodes | gate | 6.79e-8 | 3.09e-7 | 7.80e-7 | 6.56e-5
Aurora 8 nodes | ddp | 9.12e-9 | 9.87e-8 | 3.87e-7 | 6.56e-5
Aurora 8 nodes | fsdp | 1.19e-11 | 4.24e-8 | 4.66e-8 | 3.82e-6"""

# The seed's three fault tables, on their common columns:
# Cell | Fault | Arm | Status | Rejecting evidence | Pre-clip norm rel | Max tensor gradient gap
SEED_BF16_FAULTS = """\
A100 n4 | missing-rank | ddp | rejected | pre_norm, gradients | 0.238 | 0.526
A100 n4 | missing-rank | fsdp | rejected | pre_norm, gradients | 0.238 | 0.526
A100 n4 | wrong-scale | ddp | rejected | pre_norm, gradients | 3 | 3
A100 n4 | wrong-scale | fsdp | rejected | pre_norm, gradients | 3 | 3
A100 n4 | fp32-backbone | ddp | rejected | dtype | 3.37e-3 | 0.265
A100 n4 | local-adapter | ddp | rejected | synchronized | 1.24e-6 | 1.32
A100 n4 | scale-grad | ddp | rejected | pre_norm, gradients | 3 | 3
A100 n4 | skip-update | ddp | rejected | synchronized | 0 | 1.93e-10
Aurora 1 node | missing-rank | ddp | rejected | pre_norm, gradients | 0.0469 | 0.566
Aurora 1 node | missing-rank | fsdp | rejected | pre_norm, gradients | 0.0469 | 0.566
Aurora 1 node | wrong-scale | ddp | rejected | pre_norm, gradients | 11 | 11.1
Aurora 1 node | wrong-scale | fsdp | rejected | pre_norm, gradients | 11 | 11.1
Aurora 4 nodes | missing-rank | ddp | rejected | pre_norm, gradients | 0.101 | 0.486
Aurora 4 nodes | missing-rank | fsdp | rejected | pre_norm, gradients | 0.101 | 0.486
Aurora 4 nodes | wrong-scale | ddp | rejected | pre_norm, gradients | 47 | 47.5
Aurora 4 nodes | wrong-scale | fsdp | rejected | pre_norm, gradients | 47 | 47.5
Aurora 8 nodes | missing-rank | ddp | rejected | pre_norm, gradients | 0.0412 | 0.341
Aurora 8 nodes | missing-rank | fsdp | rejected | pre_norm, gradients | 0.0412 | 0.341
Aurora 8 nodes | wrong-scale | ddp | rejected | pre_norm, gradients | 95 | 95.9
Aurora 8 nodes | wrong-scale | fsdp | rejected | pre_norm, gradients | 95 | 95.9"""

# Run | Arm | Reported loss gap | pre-clip norm gap | update gap | Adam first-moment gap | Adam second-moment gap
SEED_RESUME_GAPS = """\
AC32 | single | 0 | 0 | 0 | 0 | 0
AC32 | ddp | 5.94e-7 | 3.81e-7 | 5.49e-6 | 1.48e-5 | 7.92e-6
AC32 | fsdp | 0 | 0 | 0 | 0 | 0
AC32 | fsdp_file | 0 | 0 | 0 | 0 | 0
AC32 | fsdp_reshard | 6.80e-6 | 6.07e-6 | 1.68e-5 | 1.59e-5 | 1.98e-5
ACB | single | 0 | 0 | 0 | 0 | 0
ACB | ddp | 0 | 4.81e-13 | 7.44e-9 | 1.44e-8 | 1.58e-9
ACB | fsdp | 0 | 0 | 0 | 0 | 0
ACB | fsdp_file | 0 | 0 | 0 | 0 | 0
ACB | fsdp_reshard | 0.0546 | 0.0403 | 0.135 | 0.306 | 0.219
X1C32 | single | 0 | 0 | 0 | 0 | 0
X1C32 | ddp | 5.68e-7 | 6.19e-7 | 1.12e-6 | 4.37e-6 | 4.84e-6
X1C32 | fsdp | 0 | 0 | 0 | 0 | 0
X1C32 | fsdp_file | 0 | 0 | 0 | 0 | 0
X1C32 | fsdp_reshard | 1.98e-6 | 1.58e-6 | 1.29e-5 | 1.09e-5 | 1.43e-5
X1CB | single | 0 | 0 | 0 | 0 | 0
X1CB | ddp | 0 | 5.23e-9 | 1.03e-8 | 3.45e-8 | 1.98e-8
X1CB | fsdp | 0 | 0 | 0 | 0 | 0
X1CB | fsdp_file | 0 | 0 | 0 | 0 | 0
X1CB | fsdp_reshard | 0.0227 | 8.94e-3 | 0.0204 | 0.0442 | 0.0734
X2C32 | single | 0 | 0 | 0 | 0 | 0
X2C32 | ddp | 1.41e-7 | 1.99e-7 | 2.70e-6 | 6.36e-6 | 3.98e-6
X2C32 | fsdp | 0 | 0 | 0 | 0 | 0
X2C32 | fsdp_file | 0 | 0 | 0 | 0 | 0
X2C32 | fsdp_reshard | 6.69e-7 | 1.29e-7 | 1.21e-5 | 2.39e-5 | 1.64e-5
X2CB | single | 0 | 0 | 0 | 0 | 0
X2CB | ddp | 0 | 2.75e-9 | 1.22e-7 | 4.81e-8 | 6.59e-8
X2CB | fsdp | 0 | 0 | 0 | 0 | 0
X2CB | fsdp_file | 0 | 0 | 0 | 0 | 0
X2CB | fsdp_reshard | 2.68e-3 | 2.80e-3 | 0.0126 | 0.047 | 0.0472"""


@dataclass(frozen=True)
class Cell:
    """One seed cell: what it checks, at how many ranks, the pytest arguments that select its tests."""

    name: str
    kind: str
    """``parity``, ``criterion`` or ``resume``."""
    ranks: int
    tests: tuple[str, ...]
    """pytest arguments that select the cell's tests (``--pyargs ...``, ``-k ...``)."""
    source: str
    """Where that selection comes from."""
    hardware: str
    """The seed's hardware, without its software versions."""
    software: str
    seed_result: str

    def command(self, report: str = "REPORT.json", basetemp: str = "BASETEMP") -> list[str]:
        """The pytest command line of the cell on this machine: a local world of ``ranks`` forked ranks."""
        return [
            *("python", "-m", "pytest", "-p", "no:cacheprovider", "-q", *self.tests),
            f"--ranks={self.ranks}",
            "--sprite-reuse=auto",
            f"--basetemp={basetemp}",
            f"--sprite-report={report}",
        ]


def parse_rows(text: str, width: int) -> list[list[str]]:
    """The rows of one of the seed blocks above: cells split on ``|``, each row ``width`` cells wide."""
    rows = [[c.strip() for c in line.split("|")] for line in text.splitlines() if line.strip()]
    bad = [r for r in rows if len(r) != width]
    if bad:
        raise ValueError(f"seed row with {len(bad[0])} cells, expected {width}: {bad[0]!r}")
    return rows


def seed_figures() -> dict[str, dict[str, list[list[str]]]]:
    """Per cell: the seed's detail rows (``fp32``, ``scored``, ``faults``, ``gaps``), cell name first dropped."""
    out: dict[str, dict[str, list[list[str]]]] = {}

    def add(cell: str, table: str, row: list[str]) -> None:
        out.setdefault(cell, {}).setdefault(table, []).append(row)

    for row in parse_rows(SEED_FP32, 9):
        add(row[0], "fp32", row[1:])
    for row in parse_rows(SEED_BF16_SCORED, 6):
        add(SEED_BF16_NAMES[row[0]], "scored", row[1:])
    for row in parse_rows(SEED_BF16_FAULTS, 7):
        add(SEED_BF16_NAMES[row[0]], "faults", row[1:])
    for row in parse_rows(SEED_RESUME_GAPS, 7):
        add(row[0], "gaps", row[1:])
    return out


# -- a seed row and this machine's side by side ----------------------------------------------------------------


def _pair(seed: str | None, here: str | None) -> str:
    return f"{seed or '-'} / {here or '-'}"


def side_by_side(
    cell: str, seed: list[list[str]], here: list[list[str]], key: int, fixed: int = 0
) -> list[list[str]]:
    """Rows keyed by their first ``key`` cells (arm, or fault and arm), seed order first: the next ``fixed``
    cells from whichever side has the row, every later cell as ``seed / here``."""
    mine = {tuple(r[:key]): r for r in here}
    theirs = {tuple(r[:key]): r for r in seed}
    rows = []
    for k in [*theirs, *(k for k in mine if k not in theirs)]:
        s, h = theirs.get(k), mine.get(k)
        width = len(s or h)  # type: ignore[arg-type]
        base = (s or h)[: key + fixed]  # type: ignore[index]
        rows.append([cell, *base, *(_pair(s and s[i], h and h[i]) for i in range(key + fixed, width))])
    return rows


def markdown_table(headers: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    def line(cells: list[str] | tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(r) for r in rows)])


# -- the seed's tables with this machine's figures beside them ----------------------------------------------------


def cell_rows(cells: list[Cell], records: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The seed's Tested rows with this machine's result beside each."""
    rows = []
    for c in cells:
        r = records.get(c.name)
        if r is None:
            here, wall, memory, when = "not run", "-", "-", "-"
        elif r["status"] != "measured":
            here, wall, when = f"not run here: {r['reason']}", f"{r['wall_s']:.0f}", r["date"]
            memory = f"{r['peak_pss_gb']:.1f}"  # measured until it was stopped
        else:
            here, wall, when = r["result"], f"{r['wall_s']:.0f}", r["date"]
            memory = f"{r['peak_pss_gb']:.1f}"
        rows.append([c.name, c.kind, c.hardware, str(c.ranks), c.seed_result, here, wall, memory, when])
    return rows


CELL_HEADERS = (
    "Cell",
    "Check",
    "Hardware",
    "Ranks",
    "Published result",
    "Here (CPU, local world)",
    "Wall s",
    "Peak PSS GB",
    "Date",
)


def detail_tables(
    cells: list[Cell], records: dict[str, dict[str, Any]]
) -> list[tuple[str, list[str], list[list[str]]]]:
    """The seed's per-cell figure tables, each figure as ``seed / here``."""
    seed = seed_figures()
    sides = " (published / here)"
    specs = [
        ("FP32 comparisons against the single-device reference", "parity", "fp32", 1, 1,
         ["Cell", "Arm", "Ranks", "Global batch", "Result", "Pre-clip norm rel", "Post-clip norm rel",
          "Update rel L2", "Frozen changed"]),
        ("BF16 criterion v2: scored step-0 comparisons against split (gate is split_premul)", "criterion",
         "scored", 1, 0,
         ["Cell", "Arm", "Pre-clip norm rel", "Max tensor gradient gap", "Update rel L2", "Max tensor update gap"]),
        ("BF16 criterion v2: fault cases", "criterion", "faults", 2, 0,
         ["Cell", "Fault", "Arm", "Status", "Rejecting evidence", "Pre-clip norm rel", "Max tensor gradient gap"]),
        ("Checkpoint resume: reported continuation and reshard gaps (not required)", "resume", "gaps", 1, 0,
         ["Run", "Arm", "Loss gap", "Pre-clip norm gap", "Update gap", "Adam first-moment gap",
          "Adam second-moment gap"]),
    ]  # fmt: skip
    tables = []
    for title, kind, table, key, fixed, headers in specs:
        rows = []
        for c in (c for c in cells if c.kind == kind):
            here = records.get(c.name, {}).get("figures", {}).get(table, [])
            rows += side_by_side(c.name, seed.get(c.name, {}).get(table, []), here, key, fixed)
        split = 1 + key + fixed
        tables.append((title, headers[:split] + [h + sides for h in headers[split:]], rows))
    return tables


MEMORY_HEADERS = [
    "Cell",
    "Process",
    "Processes",
    "PSS MB",
    "PSS MB each",
    "of it written (anon)",
    "of it files",
]


def memory_rows(cells: list[Cell], records: dict[str, dict[str, Any]]) -> list[list[str]]:
    """At each cell's memory peak: its processes by role, what they hold together and each."""
    rows = []
    for c in cells:
        for name, r in records.get(c.name, {}).get("memory_at_peak", {}).items():
            n = r["processes"]
            rows.append([c.name, name, str(n), f"{r['pss_mb']:.0f}", f"{r['pss_mb'] / n:.0f}",
                         f"{r['pss_anon_mb']:.0f}", f"{r['pss_file_mb']:.0f}"])  # fmt: skip
    return rows


def text_report(cells: list[Cell], records: dict[str, dict[str, Any]]) -> str:
    from pytest_sprite.assertions.tables import render_table

    parts = ["The seed's cells (hardware: the seed's, one run each; here: this machine)", ""]
    parts += [render_table(CELL_HEADERS, cell_rows(cells, records))]
    for title, headers, rows in detail_tables(cells, records):
        if rows:
            parts += ["", title + ":", render_table(headers, rows)]
    if memory := memory_rows(cells, records):
        parts += ["", "Memory at the peak, by process:", render_table(MEMORY_HEADERS, memory)]
    return "\n".join(parts)
