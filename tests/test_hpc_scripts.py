"""The job scripts under hpc/ only pass options that pytest with this plugin accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / "hpc" / "aurora" / "sprite.pbs", ROOT / "hpc" / "slurm" / "sprite.sbatch"]


def pytest_arguments(script: Path, tmp_path: Path) -> list[str]:
    """The script's ``python -m pytest`` arguments, with its shell variables given sample values."""
    text = script.read_text().replace("\\\n", " ")
    command = re.search(r"python -m pytest (.*?)(?:\| | 2>&1)", text)
    assert command, f"{script} has no python -m pytest command"
    line = command.group(1).replace("${TESTS}", "")
    line = re.sub(r"\$\{(RANKS|RANKS_PER_NODE)\}", "2", line)
    line = re.sub(r"\$\{OUT\}", str(tmp_path), line)
    return shlex.split(line)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_pytest_command_line_is_accepted(pytester: pytest.Pytester, script: Path) -> None:
    args = pytest_arguments(script, pytester.path)
    assert {a.split("=")[0] for a in args} >= {"--ranks", "--launcher", "--ppn", "--sprite-device"}
    config = pytester.parseconfig(*args)  # raises UsageError on an unknown option
    assert config.getoption("sprite_ranks") == "2"
