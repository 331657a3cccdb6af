"""The hypothesis tests against the oldest hypothesis the ``test`` extra allows (issue 20).

CI runs them against the newest release (a new virtual environment); this installs the oldest
allowed one beside it (``pip install --target``, first on ``PYTHONPATH``) and runs them again. It
needs PyPI and about a minute, so it runs with ``--run-slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def oldest_allowed() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"hypothesis>=([0-9.]+)"', text)
    assert found, "the test extra names no hypothesis lower bound"
    return found.group(1)


def test_hypothesis_tests_pass_on_the_oldest_allowed_release(tmp_path: Path) -> None:
    version = oldest_allowed()
    target = tmp_path / "hypothesis"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            f"hypothesis=={version}",
        ],
        check=True,
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])),
    }
    got = subprocess.run(
        [sys.executable, "-c", "import hypothesis; print(hypothesis.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.strip() == version
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-m",
            "cpu",
            "tests/rank/test_given_unit.py",
            "tests/glue/test_ranks_hypothesis.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"hypothesis {version}" in result.stdout
