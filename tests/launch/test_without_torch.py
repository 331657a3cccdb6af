"""The plugin installs without torch (its only dependency is pytest): ``pytest --help`` and a session of plain tests
work, and a ranks test fails at setup with one line naming the missing package while the rest of the session runs.

torch is installed here, so a conftest stands in for its absence (``sys.modules["torch"] = None`` makes every
import of it fail, as a missing package does, and hides it from ``importlib.util.find_spec``).
"""

from __future__ import annotations

import pytest
from sprite_testing import run_pytest

from pytest_sprite.launch.controller import TORCH_MISSING

pytestmark = pytest.mark.cpu

BLOCK_TORCH = 'import sys\n\nsys.modules["torch"] = None  # as if torch were not installed\n'

TESTS = """
import pytest


def test_plain():
    assert 1 + 1 == 2


@pytest.mark.ranks(2)
def test_on_ranks(world):
    assert world.size == 2


def test_after_the_ranks_test():
    pass
"""


def test_help_without_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(BLOCK_TORCH)
    result = run_pytest(pytester, "--help", timeout=120)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*--ranks=*"])


def test_a_ranks_test_fails_with_one_line_naming_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(BLOCK_TORCH)
    pytester.makepyfile(test_mixed=TESTS)
    result = run_pytest(pytester, timeout=120)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["pytest-sprite *, torch not installed (ranks tests need it)"])
    out = result.stdout.str()
    section = out.split("ERROR at setup of test_on_ranks")[1].split("short test summary")[0]
    assert section.strip("_ \n=").splitlines() == [TORCH_MISSING], out
    assert "rank agent" not in out and "Traceback" not in out, out
