"""A pytest process ends without the C++ static destructors of what it loaded, with its own exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's on_exit"),
]

# An exit handler registered while the session runs, the way a loaded C++ library registers each static
# destructor (__cxa_atexit): abort() makes it visible (the process would end by SIGABRT, not its status).
CONFTEST = textwrap.dedent(
    """
    import ctypes

    libc = ctypes.CDLL(None)
    libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    assert libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p).value, None, None) == 0
    """
)
TESTS = textwrap.dedent(
    """
    def test_passes():
        pass

    def test_fails():
        assert 1 == 2
    """
)


def _session(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_exit.py").write_text(TESTS)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "pytest_sprite.plugin", "-q"]
    environ = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **env}
    return subprocess.run(argv, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)


def test_the_exit_skips_handlers_loaded_before_it_and_keeps_the_status(tmp_path: Path) -> None:
    done = _session(tmp_path)
    assert done.returncode == 1, done.stderr  # one test failed: pytest's status, not abort()'s signal
    assert "1 failed, 1 passed" in done.stdout  # Python's finalization flushed everything first


def test_sprite_fast_exit_0_runs_them(tmp_path: Path) -> None:
    done = _session(tmp_path, SPRITE_FAST_EXIT="0")
    assert done.returncode == -6, (done.returncode, done.stderr)  # the C library ran abort() at exit
    assert "1 failed, 1 passed" in done.stdout
