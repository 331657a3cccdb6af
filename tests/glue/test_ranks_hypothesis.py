"""@given on a ranks test: same examples on every rank under every launcher, failures reported once (issue 9)."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
from sprite_testing import clear_rank_variables, run_pytest

pytest.importorskip("hypothesis")

pytestmark = [pytest.mark.cpu, pytest.mark.hypothesis_plugin]

TIMEOUT = 240

LAUNCHERS = [
    pytest.param("local", id="local"),
    pytest.param(
        "mpiexec",
        marks=[
            pytest.mark.skipif(shutil.which("mpiexec") is None, reason="MPICH's mpiexec is not on PATH"),
            pytest.mark.slow,
        ],
        id="mpiexec",
    ),
]


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    clear_rank_variables(monkeypatch)


run = partial(run_pytest, timeout=TIMEOUT, flags=("--connect-timeout=60",))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_rank_draws_the_same_examples(pytester: pytest.Pytester, tmp_path: Path, launcher: str) -> None:
    pytester.makepyfile(
        f"""
        import pytest
        import torch
        import torch.distributed as dist
        from hypothesis import given, settings, strategies as st

        @pytest.mark.ranks(2)
        @settings(max_examples=25)
        @given(x=st.integers(-1000, 1000), shape=st.lists(st.integers(1, 3), min_size=1, max_size=3))
        def test_sum(world, x, shape):
            seen = world.gather_object((x, shape))
            assert seen[0] == seen[1], seen
            t = torch.full(shape, float(x))
            dist.all_reduce(t)  # the shapes agree, so this cannot deadlock
            assert torch.equal(t, torch.full(shape, 2.0 * x))
            with open(r"{tmp_path}/rank%d" % world.rank, "a") as f:
                f.write(f"{{x}} {{shape}}\\n")
        """
    )
    result = run(pytester, f"--launcher={launcher}", "--ranks=2")
    result.assert_outcomes(passed=1)
    examples = [(tmp_path / f"rank{r}").read_text().splitlines() for r in (0, 1)]
    assert examples[0] == examples[1]
    assert len(examples[0]) >= 10
    assert "FailedHealthCheck" not in result.stdout.str()


@pytest.mark.slow
def test_hypothesis_seed_pins_the_examples_of_every_rank(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(
        f"""
        import pytest
        from hypothesis import given, settings, strategies as st

        @pytest.mark.ranks(2)
        @settings(max_examples=5, database=None)
        @given(st.integers())
        def test_record(world, x):
            with open(r"{tmp_path}/run-rank%d" % world.rank, "a") as f:
                f.write(f"{{x}}\\n")
        """
    )
    runs = []
    for _ in range(2):
        run(pytester, "--hypothesis-seed=1234").assert_outcomes(passed=1)
        runs.append([(tmp_path / f"run-rank{r}").read_text() for r in (0, 1)])
        for r in (0, 1):
            (tmp_path / f"run-rank{r}").unlink()
    assert runs[0] == runs[1] and runs[0][0] == runs[0][1]


def test_an_example_failing_on_one_rank_is_reported_once_with_its_rank(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(
        """
        import pytest
        from hypothesis import given, settings, strategies as st

        @pytest.mark.ranks(2)
        @settings(max_examples=200)
        @given(st.integers(0, 10_000))
        def test_small(world, x):
            world.barrier()
            if world.rank == 1:
                assert x < 500, f"rank 1 got {x}"
        """
    )
    result = run(pytester, "--launcher=local", "-rf")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*- rank 1 -*",
            # "Falsifying example:" before hypothesis 6.15x, "Failing test case:" since
            "*Fa[il]*: test_small(*",
            "*x=500,*",
            "*AssertionError: rank 1 got 500*",
            "FAILED test_an_example_failing_on_one_rank_is_reported_once_with_its_rank.py::test_small - "
            "[[]rank 1[]] AssertionError: rank 1 got 500",
        ]
    )
    assert "- rank 0 -" not in out and "ranks 0-1" not in out
    # Only rank 0 wrote the example database: the failing example is saved once, and replayed first.
    again = run(pytester, "--launcher=local", "-rf")
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines(["*AssertionError: rank 1 got 500*"])
