"""Progress lines keep pytest's own output intact (issue 20).

``[sprite] <test>: arm single, 32-true`` lines used to break pytest's line of progress dots after every
arm; they now show only with ``-v``, where each test has a line of its own.
"""

from __future__ import annotations

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

BODY = """
import pytest
from pytest_sprite import progress

@pytest.mark.ranks(2)
@pytest.mark.parametrize("arm", ["single", "ddp", "fsdp"])
def test_arm(world, arm):
    progress(f"arm {arm}, 32-true")

def test_plain():
    progress("a plain test reports too")
"""


def test_the_default_output_is_pytests_own_line_of_dots(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_arms=BODY)
    result = run_pytest(pytester, "--ranks=2", "--pack=off", timeout=300)
    result.assert_outcomes(passed=4)
    assert "[sprite] test_arms.py" not in result.stdout.str()
    result.stdout.fnmatch_lines(["test_arms.py .... *[[]100%[]]"])


def test_verbose_output_shows_each_progress_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_arms=BODY)
    result = run_pytest(pytester, "--ranks=2", "--pack=off", "-v", timeout=300)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines_random(
        [
            "[[]sprite[]] test_arms.py::test_arm[[]single[]]: arm single, 32-true",
            "[[]sprite[]] test_arms.py::test_arm[[]fsdp[]]: arm fsdp, 32-true",
            "[[]sprite[]] test_arms.py::test_plain: a plain test reports too",
        ]
    )
