"""``bench/cells.py`` without its fits: the seed's cells and their commands, verdicts read from a report, the page.

The bench runs each cell of the seed's Tested table at its world size (minutes to tens of minutes each); these tests
check what surrounds the runs on hand-made ``--sprite-report`` documents, in well under a second.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]

SEED_RANKS = {
    **{"AF": 4, "X1F": 12, "X2F": 24, "X4F": 48, "X8F": 96},
    **{"A440": 4, "A3a": 3, "X1B": 12, "X2B": 24, "X4B": 48, "X8B": 96},
    **{"AC32": 4, "ACB": 4, "X1C32": 12, "X1CB": 12, "X2C32": 24, "X2CB": 24},
}


@pytest.fixture
def cells(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("cells")


def test_every_seed_cell_at_its_world_size_with_the_command_hpc_gives_it(cells: ModuleType) -> None:
    by_name = {c.name: c for c in cells.seed_cells()}
    assert {n: c.ranks for n, c in by_name.items()} == SEED_RANKS
    assert by_name["X1B"].tests == (
        "--pyargs",
        "pytest_sprite.suite.test_criterion_v2",
        "-k",
        "clean or loss",
    )
    assert by_name["X2B"].tests[-2:] == ("-k", "clean")
    assert by_name["A440"].tests == ("--pyargs", "pytest_sprite.suite.test_criterion_v2")  # all 8 fault cases
    assert by_name["A3a"].source == "hpc/slurm/README.md"  # SPRITE_RANKS_PER_NODE=3 on one node
    assert by_name["X2CB"].tests == ("--pyargs", "pytest_sprite.suite.test_resume", "-k", "bf16-mixed")
    assert by_name["AC32"].tests[-1] == "32-true" and by_name["X1C32"].source == "hpc/aurora/README.md"
    assert by_name["X4F"].tests[-1] == "test_lora_parity and ranks48"
    command = by_name["X1B"].command("r.json", "bt")
    assert command[-4:] == ["--ranks=12", "--sprite-reuse=auto", "--basetemp=bt", "--sprite-report=r.json"]
    assert by_name["X1B"].hardware == "1 Aurora node, 12 tiles, Max 1550"
    expected = {n: cells.expected_tests(c) for n, c in by_name.items()}
    assert (expected["A440"], expected["X1B"], expected["X2B"], expected["AF"], expected["ACB"]) == (
        9,
        5,
        1,
        1,
        16,
    )


def test_selection_runs_small_worlds_first_and_refuses_what_it_cannot_run(cells: ModuleType) -> None:
    seed = cells.seed_cells()
    default = cells.select(seed, None, 48)
    assert [c.name for c in default][:2] == ["A3a", "AF"]
    assert {"X8F", "X8B"}.isdisjoint(c.name for c in default) and len(default) == 15
    assert [c.ranks for c in default] == sorted(c.ranks for c in default)
    assert [c.name for c in cells.select(seed, "X1B, AF", 48)] == ["AF", "X1B"]
    with pytest.raises(SystemExit, match=r"unknown cell X9B; the seed's cells are AF, X1F"):
        cells.select(seed, "X9B", 48)
    with pytest.raises(SystemExit, match=r"X8B \(96 ranks\) over --max-ranks=48; pass --max-ranks=96"):
        cells.select(seed, "X8B", 48)


def test_the_dry_run_prints_each_cells_command(cells: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert cells.main(["--dry-run", "--cells", "X2B,AC32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("AC32") and "-k 32-true --ranks=4" in lines[0]
    assert (
        lines[1].startswith("X2B")
        and "-k clean --ranks=24" in lines[1]
        and "hpc/aurora/README.md" in lines[1]
    )


def _test(nodeid: str, outcome: str = "passed", *payloads: dict[str, Any]) -> dict[str, Any]:
    return {"nodeid": f"test_criterion_v2.py::{nodeid}", "outcome": outcome, "assertions": list(payloads)}


def _arm(role: str, pre: float) -> dict[str, Any]:
    figures = {"max_gradient_gap": 1e-7, "update_rel_l2": 0.0, "max_update_gap": 2.5e-5}
    return {"role": role, "passed": True, "pre_norm_rel": pre, **figures}


def _criterion(faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kind": "criterion_v2",
        "verdict": "fail" if faults else "pass",
        "gate": _arm("gate", 3.2e-8),
        "scored": [_arm("ddp", 0.0), _arm("fsdp", 1.234e-9)],
        "invariants": [{"name": "dtype", "passed": True}],
        "faults": faults,
    }


def _fault_test(fault: str, arm: str, status: str = "rejected", outcome: str = "passed") -> dict[str, Any]:
    row = {"fault": fault, "arm": f"{arm} (fault {fault})", "status": status}
    row |= {"rejecting_evidence": ["pre_norm", "gradients"], "pre_norm_rel": 11.0, "max_gradient_gap": 11.1}
    return _test(f"test_criterion_v2_fault[loss-{fault}-{arm}]", outcome, _criterion([row]))


def x1b_report(*, drop: int = 0, outcome: str = "passed") -> dict[str, Any]:
    faults = [_fault_test(f, a) for f in ("missing-rank", "wrong-scale") for a in ("ddp", "fsdp")]
    faults[-1] = _fault_test(
        "wrong-scale", "fsdp", "not rejected" if outcome != "passed" else "rejected", outcome
    )
    tests = [_test("test_criterion_v2_clean", "passed", _criterion([])), *faults]
    return {"tests": tests[: len(tests) - drop]}


def test_a_criterion_cell_in_the_seeds_words_with_its_figures(cells: ModuleType) -> None:
    cell = {c.name: c for c in cells.seed_cells()}["X1B"]
    judged = cells.judge(cell, x1b_report())
    assert judged["result"] == "pass; gate and invariants pass; 4 fault cases rejected"
    assert judged["tests"] == {"passed": 5}
    assert judged["figures"]["scored"][0] == ["gate", "3.20e-8", "1.00e-7", "0", "2.50e-5"]
    assert judged["figures"]["scored"][2][:2] == ["fsdp", "1.23e-9"]
    assert judged["figures"]["faults"][1] == [
        "missing-rank",
        "fsdp",
        "rejected",
        "pre_norm, gradients",
        "11",
        "11.1",
    ]


def test_a_failed_or_missing_test_fails_the_cell_by_name(cells: ModuleType) -> None:
    cell = {c.name: c for c in cells.seed_cells()}["X1B"]
    failed = cells.judge(cell, x1b_report(outcome="failed"))["result"]
    assert failed.startswith("FAIL: test_criterion_v2_fault[loss-wrong-scale-fsdp] failed"), failed
    short = cells.judge(cell, x1b_report(drop=2))["result"]
    assert short == "FAIL: ran 3 tests, the seed's cell has 5", short


def test_resume_and_parity_cells_read_their_payloads(cells: ModuleType) -> None:
    by_name = {c.name: c for c in cells.seed_cells()}
    gaps = {"loss": 0.0, "pre_clip_norm": 5.23e-9, "update": 0.0204, "adam_m": 0.0, "adam_v": 0.0}
    resume = [
        {"nodeid": f"m::test_resume[ranks12-{s}-bf16-mixed]", "outcome": "passed", "assertions": [
            {"kind": "resume", "passed": True, "ranks": 12, "global_batch": 24,
             "reshard_ranks": 6 if s == "fsdp" else None, "gaps": [{"arm": s, **gaps}]}]}
        for s in ("single", "ddp", "fsdp", "fsdp_file")
    ] + [{"nodeid": f"m::test_resume_fault_is_rejected[{i}]", "outcome": "passed"} for i in range(12)]  # fmt: skip
    judged = cells.judge(by_name["X1CB"], {"tests": resume})
    assert judged["result"] == "pass; 12 faults rejected"
    assert judged["figures"]["gaps"][1] == ["ddp", "0", "5.23e-9", "0.0204", "0", "0"]
    assert judged["figures"]["shape"] == [["12", "24", "12 → 6"]]
    arm = {
        "label": "ddp",
        "ranks": 4,
        "global_batch": 8,
        "passed": True,
        "frozen_changed": 0,
        "frozen_total": 26,
    }
    arm |= {"pre_norm_rel": 2.4e-6, "post_norm_rel": "inf", "update_rel_l2": 4.17e-6}
    parity = {
        "tests": [
            _test("test_lora_parity[ranks4]", "passed", {"kind": "parity", "passed": True, "arms": [arm]})
        ]
    }
    judged = cells.judge(by_name["AF"], parity)
    assert judged["result"] == "pass"
    assert judged["figures"]["fp32"] == [["ddp", "4", "8", "pass", "2.40e-6", "inf", "4.17e-6", "0 of 26"]]


def _record(cells: ModuleType, **fields: Any) -> dict[str, Any]:
    env = {
        "machine": "2 cores",
        "versions": {"torch": "2.13.0+cpu"},
        "commit": "abc1234",
        "bench": "python b",
    }
    base = {"date": "2026-12-02 07:00 UTC", "wall_s": 95.0, "peak_pss_gb": 2.31, "load": [1.0, 2.0]}
    return {**env, **base, **fields}


def test_the_page_puts_this_machines_figures_beside_the_seeds(cells: ModuleType) -> None:
    seed = cells.seed_cells()
    x1b = cells.judge({c.name: c for c in seed}["X1B"], x1b_report())
    records = {
        "X1B": _record(cells, cell="X1B", status="measured", **x1b),
        "X2C32": _record(cells, cell="X2C32", status="not run", reason="stopped after 20 min (--timeout)"),
    }
    text = cells.page(seed, records)
    assert "- Date: 2026-12-02 07:00 UTC to 2026-12-02 07:00 UTC" in text
    assert "Load average before / after each cell: X1B 1.0 / 2.0, X2C32 1.0 / 2.0." in text
    seed_result = "pass; gate and invariants pass; 4 fault cases rejected"
    assert (
        f"| X1B | criterion | 1 Aurora node, 12 tiles, Max 1550 | 12 | {seed_result} | {seed_result} | 95 | 2.3 |"
        in text
    )
    assert (
        "| X2C32 | resume | 2 Aurora nodes, 24 tiles, Max 1550 | 24 | pass; 12 faults rejected | not run here: stopped after 20 min (--timeout) | 95 | 2.3 |"
        in text
    )
    assert (
        "| X8B | criterion | 8 Aurora nodes, 96 tiles, Max 1550 | 96 |" in text
        and "| not run | - | - | - |" in text
    )
    assert "| X1B | gate | 3.98e-8 / 3.20e-8 | 1.08e-7 / 1.00e-7 | 6.18e-7 / 0 | 3.46e-5 / 2.50e-5 |" in text
    assert (
        "| X1B | wrong-scale | fsdp | rejected / rejected | pre_norm, gradients / pre_norm, gradients | 11 / 11 | 11.1 / 11.1 |"
        in text
    )
    assert "| X4B | gate | 1.87e-8 / - |" in text  # the seed's figures of a cell not run here, ours empty
    assert (
        "| AC32 | `python -m pytest -p no:cacheprovider -q --pyargs pytest_sprite.suite.test_resume -k 32-true --ranks=4"
        in text
    )
    printed = cells.text_report(seed, records)
    assert "X1B    criterion" in printed and "3.98e-8 / 3.20e-8" in printed


def test_the_committed_page_is_what_its_figures_render(cells: ModuleType) -> None:
    data = cells.PAGE.with_suffix(".json")
    if not data.exists():
        pytest.skip("no cells measured yet: docs/measurements/cells.json is written by python bench/cells.py")
    assert cells.page(cells.seed_cells(), cells.load_records(data)) == cells.PAGE.read_text(), (
        "docs/measurements/cells.md differs from what bench/cells.py renders from cells.json: "
        "edit bench/cells.py, not the page, and render it again"
    )
