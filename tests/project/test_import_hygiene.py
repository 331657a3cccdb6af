"""Loading the plugin imports no torch; the code under test never imports the plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu


def python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_loading_the_plugin_imports_no_torch() -> None:
    out = python(
        "import sys, pytest_sprite, pytest_sprite.plugin, pytest_sprite.fixtures, pytest_sprite.launch.controller;"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    assert out == "[]"


@pytest.mark.slow  # 17 s (a fresh interpreter imports Lightning); test_layering.py checks the arrows in CI
def test_code_under_test_does_not_load_the_plugin() -> None:
    out = python(
        "import sys, pytest_sprite.lightning;"
        "print(sorted(m for m in sys.modules if m in ('pytest', '_pytest') or m.startswith(('pytest_sprite.plugin',"
        " 'pytest_sprite.launch', 'pytest_sprite.rank', 'pytest_sprite.assertions', '_pytest.', 'pytest.'))))"
    )
    assert out == "[]"


def test_rank_side_does_not_import_the_controller_side() -> None:
    out = python(
        "import sys, pytest_sprite.rank.agent, pytest_sprite.rank.child, pytest_sprite.rank.main;"
        "print(sorted(m for m in sys.modules if m.startswith('pytest_sprite.launch')))"
    )
    assert out == "[]"


def test_controller_side_does_not_import_the_rank_side() -> None:
    """Only the local launcher's forked agent reaches pytest_sprite.rank; the controller never imports it."""
    out = python(
        "import sys, pytest_sprite.plugin, pytest_sprite.launch.controller, pytest_sprite.launch.pool,"
        " pytest_sprite.launch.merge, pytest_sprite.launch.launchers.local;"
        "from pytest_sprite.launch.launchers import LauncherRegistry, pytest_sprite_add_launchers;"
        "registry = LauncherRegistry(); pytest_sprite_add_launchers(registry);"
        "[registry.create(name) for name in registry.names];"
        "print(sorted(m for m in sys.modules if m.startswith('pytest_sprite.rank')))"
    )
    assert out == "[]"


def test_the_protocol_module_imports_only_the_standard_library() -> None:
    out = python(
        "import sys; before = set(sys.modules); import pytest_sprite.plumbing.protocol;"
        "new = set(sys.modules) - before - {'pytest_sprite', 'pytest_sprite.plumbing', 'pytest_sprite.plumbing.protocol'};"
        "print(sorted(m for m in new if m.split('.')[0] not in sys.stdlib_module_names))"
    )
    assert out == "[]"


def test_a_collect_only_session_starts_no_agents(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_x(world):
            pass
        """
    )
    result = run_pytest(pytester, "--co", "-q", timeout=120, fresh=True)
    result.stdout.fnmatch_lines(["*test_x*", "*1 test collected*"])
    assert result.ret == 0


def test_a_local_ranks_session_leaves_the_rank_side_out_of_the_controller(pytester: pytest.Pytester) -> None:
    """The agents fork from the controller and import the rank side there; the controller itself never does."""
    pytester.makeconftest(
        """
        import sys

        def pytest_sessionfinish(session):
            loaded = sorted(m for m in sys.modules if m.startswith("pytest_sprite.rank"))
            print(f"controller-rank-modules={loaded}")
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_x(world):
            assert world.size == 2
        """
    )
    result = run_pytest(pytester, "-s", timeout=300, fresh=True)
    result.stdout.fnmatch_lines(["*controller-rank-modules=[[][]]*", "*1 passed*"])
