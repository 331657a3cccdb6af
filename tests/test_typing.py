"""The package type-checks under ``mypy --strict`` (typed public APIs and typed protocol payloads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_strict_over_the_package(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    cache = request.config.cache.mkdir("mypy") if request.config.cache is not None else tmp_path
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "pytest_sprite"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
