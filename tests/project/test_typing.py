"""The package type-checks under ``mypy --strict`` (typed public APIs and typed protocol payloads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 92 s of CI; `mypy --strict pytest_sprite` is in the development commands
def test_mypy_strict_over_the_package(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    # The cache provider may be disabled (-p no:cacheprovider): then the cache lives in tmp_path.
    cache_plugin = getattr(request.config, "cache", None)
    cache = cache_plugin.mkdir("mypy") if cache_plugin is not None else tmp_path
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "pytest_sprite"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
