"""The job scripts under hpc/ only pass options that pytest with this plugin accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "hpc" / "aurora" / "sprite.pbs", ROOT / "hpc" / "slurm" / "sprite.sbatch"]


def pytest_arguments(script: Path, tmp_path: Path) -> list[str]:
    """The script's ``python -m pytest`` arguments, with its shell variables given sample values."""
    text = script.read_text().replace("\\\n", " ")
    command = re.search(r'(?:python|"\$\{PYTHON\}") -m pytest (.*?)(?:\| | 2>&1)', text)
    assert command, f"{script} has no python -m pytest command"
    line = command.group(1).replace("${TESTS}", "")
    line = line.replace('${SPRITE_K:+-k "${SPRITE_K}"}', '-k "clean or loss"')
    line = re.sub(r"\$\{(RANKS|RANKS_PER_NODE)\}", "2", line)
    line = re.sub(r"\$\{OUT\}", str(tmp_path), line)
    line = line.replace("${DEVICE}", "cpu")
    return shlex.split(line)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_pytest_command_line_is_accepted(pytester: pytest.Pytester, script: Path) -> None:
    args = pytest_arguments(script, pytester.path)
    assert {a.split("=")[0] for a in args} >= {"--ranks", "--launcher", "--ppn", "--sprite-device"}
    config = pytester.parseconfig(*args)  # raises UsageError on an unknown option
    assert config.getoption("sprite_ranks") == "2"
    assert config.getoption("keyword") == "clean or loss"  # SPRITE_K stays one -k word
    # a test's ranks share tmp_path across nodes: the basetemp is in the job's folder on the shared filesystem
    assert config.getoption("basetemp") == str(pytester.path / "tmp")


SUITE = ROOT / "pytest_sprite" / "suite" / "test_criterion_v2.py"
CELLS = {
    "A440": (ROOT / "hpc" / "slurm" / "README.md", 9),
    "A3a": (ROOT / "hpc" / "slurm" / "README.md", 1),
    "X1B": (ROOT / "hpc" / "aurora" / "README.md", 5),
    "X2B": (ROOT / "hpc" / "aurora" / "README.md", 1),
    "X4B": (ROOT / "hpc" / "aurora" / "README.md", 5),
    "X8B": (ROOT / "hpc" / "aurora" / "README.md", 5),
}
"""The seed's BF16 cells, where their command is, and how many criterion tests each runs (clean + faults)."""


def criterion_test_ids() -> list[str]:
    """Names and parameter ids of the suite's criterion tests, read from the source (no torch import)."""
    text = SUITE.read_text()
    ids = re.findall(r'id="([^"]+)"', text)
    return ["test_criterion_v2_clean"] + [f"test_criterion_v2_fault[{i}]" for i in ids]


def cell_variables(readme: Path, cell: str) -> dict[str, str]:
    """SPRITE_* variables of the cell's one command in the README's table (sbatch --export= or qsub -v)."""
    row = next(line for line in readme.read_text().splitlines() if line.startswith(f"| {cell} |"))
    (command,) = re.findall(r"`((?:sbatch|qsub) [^`]+)`", row)
    words = shlex.split(command)
    if words[0] == "qsub":
        exported = words[words.index("-v") + 1]
    else:
        exported = next(w.removeprefix("--export=") for w in words if w.startswith("--export="))
    return dict(p.split("=", 1) for p in exported.split(",") if p != "ALL")


@pytest.mark.parametrize("cell", list(CELLS))
def test_each_bf16_cell_is_one_command_that_selects_its_criterion_tests(
    pytester: pytest.Pytester, cell: str
) -> None:
    readme, expected = CELLS[cell]
    env = cell_variables(readme, cell)
    assert env["SPRITE_TESTS"] == "--pyargs pytest_sprite.suite.test_criterion_v2"
    script = ROOT / "hpc" / ("slurm/sprite.sbatch" if "slurm" in str(readme) else "aurora/sprite.pbs")
    text = script.read_text().replace("\\\n", " ")
    command = re.search(r'(?:python|"\$\{PYTHON\}") -m pytest (.*?)(?:\| | 2>&1)', text)
    assert command
    k = env.get("SPRITE_K")
    line = command.group(1).replace("${TESTS}", env["SPRITE_TESTS"])
    line = line.replace('${SPRITE_K:+-k "${SPRITE_K}"}', f'-k "{k}"' if k else "")
    line = re.sub(r"\$\{(RANKS|RANKS_PER_NODE)\}", "3", line).replace("${OUT}", str(pytester.path))
    config = pytester.parseconfig(*shlex.split(line))
    assert config.getoption("keyword") == (k or "")
    # -k over the suite's test ids: each word names some test, and the cell runs the tests the seed lists
    ids = criterion_test_ids()
    words = k.split(" or ") if k else []
    assert all(any(w in i for i in ids) for w in words), (k, ids)
    selected = [i for i in ids if not words or any(w in i for w in words)]
    assert len(selected) == expected, selected
    if cell == "A3a":
        assert env["SPRITE_RANKS_PER_NODE"] == "3" and "--ntasks-per-node=3" in readme.read_text()
