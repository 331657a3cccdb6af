"""``pytest_sprite_before_fork``: loaded once where the ranks are forked from, inherited by every test child.

The hook runs in the controller before the local launcher forks its agents, so what it loads is already in
each test child (a fork) without being built there; ``lora_qwen`` builds its model there only when a
collected test uses the fixture (issue 22).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sprite_testing import clear_rank_variables, run_pytest

pytestmark = pytest.mark.cpu

CONFTEST = """
import os

CALLS = []


def pytest_sprite_before_fork(config, items):
    CALLS.append((os.getpid(), sorted(item.name for item in items)))
"""

TEST = """
import os

import pytest

import conftest


@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(2))
def test_inherits_what_the_hook_loaded(world, i):
    assert len(conftest.CALLS) == 1, conftest.CALLS  # once for the session, not once per test or rank
    pid, names = conftest.CALLS[0]
    assert pid != os.getpid() and pid != os.getppid()  # the controller, forked twice over (agent, child)
    assert names == [f"test_inherits_what_the_hook_loaded[{j}]" for j in range(2)] + ["test_plain"]


def test_plain():
    assert len(conftest.CALLS) == 1 and conftest.CALLS[0][0] == os.getpid()  # the controller ran it
"""


def test_the_hook_runs_once_in_the_controller_before_the_forks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_hook=TEST)
    result = run_pytest(pytester, "--sprite-device=cpu", timeout=180)
    result.assert_outcomes(passed=3)


LAUNCHED_TEST = """
import os

import pytest

import conftest


@pytest.mark.ranks(2)
def test_its_agent_ran_the_hook(world):
    assert len(conftest.CALLS) == 1, conftest.CALLS  # once in this rank's agent
    assert conftest.CALLS[0][0] == os.getppid()  # the agent, which forked this child
    assert conftest.CALLS[0][1] == ["test_its_agent_ran_the_hook", "test_the_controller_did_not"]


def test_the_controller_did_not():
    assert conftest.CALLS == []  # it forks no rank: the launcher started the agents
"""


@pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="MPICH's mpiexec is not on PATH (pip install mpich)"
)
def test_a_launched_agent_runs_the_hook_itself(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_hook=LAUNCHED_TEST)
    result = run_pytest(pytester, "--sprite-device=cpu", "--launcher=mpiexec", "--ranks=2", timeout=240)
    result.assert_outcomes(passed=2)


LORA_TEST = """
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
from pytest_sprite.recipes import _model


@pytest.mark.ranks(2)
def test_model_already_built(world{fixture}):
    assert _model._PRISTINE.keys() == {expected}
"""


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [(", lora_qwen", "{(0, None)}"), ("", "set()")],
    ids=["uses-lora_qwen", "does-not"],
)
def test_lora_qwen_model_is_built_before_the_fork_only_when_used(
    pytester: pytest.Pytester, fixture: str, expected: str
) -> None:
    pytester.makepyfile(test_lora=LORA_TEST.format(fixture=fixture, expected=expected))
    result = run_pytest(pytester, "--sprite-device=cpu", timeout=240)
    result.assert_outcomes(passed=1)


BAD_PATH_TEST = """
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.mark.ranks(2)
def test_uses_the_model(world, lora_qwen):
    lora_qwen.run("ddp")


@pytest.mark.ranks(2)
def test_does_not(world):
    assert world.size == 2
"""


def test_a_model_that_cannot_be_built_is_reported_by_the_tests_that_use_it(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(test_bad=BAD_PATH_TEST)
    missing = tmp_path / "no-model-here"
    result = run_pytest(pytester, "--sprite-device=cpu", f"--qwen-path={missing}", timeout=240)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*is not a model directory (no config.json)*"])


def test_agents_forked_after_a_test_computed_here_can_still_use_threads(pytester: pytest.Pytester) -> None:
    """A plain test before the first ranks test runs matmuls on two threads in the controller; the ranks
    test's child then does too. GNU OpenMP's pool does not survive a fork, so agents forked after that
    plain test would hang their children: they are forked when collection ends instead."""
    pytester.makepyfile(
        """
        import pytest
        import torch

        def matmuls():
            torch.set_num_threads(2)
            a = torch.randn(512, 512)
            for _ in range(20):
                a = (a @ a).tanh()

        def test_a_plain_test_computes_here():
            matmuls()

        @pytest.mark.ranks(1)
        def test_then_a_rank_computes_on_two_threads(world):
            matmuls()
        """
    )
    result = run_pytest(pytester, "--ranks=1", "--rank-timeout=60", timeout=240)
    result.assert_outcomes(passed=2)
