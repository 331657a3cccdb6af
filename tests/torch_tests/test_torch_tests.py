"""torch's own multiprocess test classes on ranks, bodies unchanged (``--torch-tests=ranks``, issue 26).

The classes below are written in torch's idiom (``MultiProcessTestCase``, ``setUp`` that spawns, ``self.rank``,
``self.file_name``, ``TEST_SKIPS`` exit codes, ``special_return_code_checks``); one session runs them all and
each outcome is the one torch's own runner gives (checked natively, 390 s for the first class on this
machine, in docs/how-to/existing-suites.md's measurements; too slow for CI). The exit-code rule itself is
proved without processes.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import Any

import pytest
from sprite_testing import fnescape

from pytest_sprite.glue.pytest_internals import function_scoped_arguments
from pytest_sprite.torch_tests.exit_codes import torch_verdict

pytestmark = pytest.mark.cpu

pytest.importorskip("expecttest", reason="torch's test classes need expecttest: pip install expecttest")

TIMEOUT = 240
SKIP = fnescape("SKIPPED [1] test_torch_suite.py:")

SUITE = """
import os
import sys
import time
import unittest
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcessTestCase, skip_if_lt_x_gpu

LOG = Path({log!r})


class AllReduceTest(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        os.environ["SPRITE_FROM_SETUP"] = "set by setUp"
        if self._testMethodName == "test_rank0_expected_death":  # torch's form: the method join_or_run wrapped
            self.special_return_code_checks = {{self.test_rank0_expected_death.__wrapped__: 3}}
        self._spawn_processes()

    def tearDown(self):
        with LOG.open("a") as f:  # once per test, after every rank ended
            f.write(f"tearDown {{self._testMethodName}} {{Path(self.file_name).name}}\\n")
        super().tearDown()

    @property
    def world_size(self):
        return 2

    def _init_pg(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    def test_allreduce(self):
        assert not dist.is_initialized()  # a native child starts without a default group
        assert os.environ["SPRITE_FROM_SETUP"] == "set by setUp"
        self._init_pg()
        t = torch.ones(2) * (self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 3.0))

    def test_fails_on_rank1(self):
        self._init_pg()
        dist.barrier()
        self.assertEqual(self.rank, 0, "only rank 0 may pass")

    def test_skip_in_child(self):
        raise unittest.SkipTest("skipped in the child")

    @skip_if_lt_x_gpu(2)
    def test_needs_gpus(self):
        pass

    def test_rank1_exits_with_skip_code(self):  # rank 0's code decides: passed
        if self.rank == 1:
            sys.exit(TEST_SKIPS["odd_worldsize"].exit_code)

    def test_rank0_exits_with_skip_code(self):  # rank 0's code decides: skipped
        if self.rank == 0:
            sys.exit(TEST_SKIPS["odd_worldsize"].exit_code)

    def test_rank0_exits_3(self):
        if self.rank == 0:
            sys.exit(3)

    def test_rank0_expected_death(self):  # special_return_code_checks: exit 3 is this test's pass
        if self.rank == 0:
            sys.exit(3)

    @unittest.skip("decorated")
    def test_decorated_skip(self):
        pass


class SkipInSetUp(MultiProcessTestCase):
    world_size = 2

    def setUp(self):
        super().setUp()
        raise unittest.SkipTest("not in this setUp")

    def test_never_runs(self):
        raise AssertionError("ran")


class HangsPastItsTimeout(MultiProcessTestCase):
    world_size = 2
    timeout = 3  # seconds: the class's timeout is each test's on ranks

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_sleeps(self):
        time.sleep(60)


@pytest.mark.ranks(2, init=False)
def test_own_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # env://: MASTER_PORT is free for the test's own store
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0
    dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[pytest.RunResult, Path]:
    """One session (pack on, the default) over every class above; the tests below read it."""
    pytester_dir = tmp_path_factory.mktemp("suite")
    log = pytester_dir / "teardowns.log"
    (pytester_dir / "test_torch_suite.py").write_text(SUITE.format(log=str(log)))
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rfs",
            "--torch-tests=ranks",
            "--junitxml=junit.xml",
            "test_torch_suite.py",
        ],
        cwd=pytester_dir,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    result = pytest.RunResult(done.returncode, done.stdout.splitlines(), done.stderr.splitlines(), 0.0)
    return result, log


def test_each_outcome_is_torchs(suite: tuple[pytest.RunResult, Path]) -> None:
    result, _ = suite
    result.assert_outcomes(passed=4, failed=3, skipped=5)
    out = result.stdout.str()
    result.stdout.fnmatch_lines_random(
        [
            "FAILED test_torch_suite.py::AllReduceTest::test_fails_on_rank1*",
            "FAILED test_torch_suite.py::AllReduceTest::test_rank0_exits_3*",
            "FAILED test_torch_suite.py::HangsPastItsTimeout::test_sleeps*",
            SKIP + "*: decorated",
            SKIP + "*: Need at least 2 CUDA devices",
            SKIP + "*: Skipped due to odd world size.",
            SKIP + "*: Test skipped at subprocess level, look at subprocess log for skip reason",
            SKIP + "*: not in this setUp",
        ]
    )
    assert "only rank 0 may pass" in out and "exited with error code 10 and exception" in out
    assert fnescape("Expected exit code 0 but got 3 on rank 0") in fnescape(out)
    assert "ValueError: invalid method signature" not in out  # the hypothesis preparation's old bug
    # the timeout names where it came from, not a ranks marker the user never wrote
    assert (
        "after the 3s timeout (from HangsPastItsTimeout.timeout, the torch test class's timeout attribute)"
        in out
    )
    assert "@pytest.mark.ranks(timeout=...)" not in out


def test_teardown_runs_once_per_test_after_the_ranks(suite: tuple[pytest.RunResult, Path]) -> None:
    _, log = suite
    lines = log.read_text().splitlines()
    assert sorted(lines) == sorted(
        f"tearDown {name} filestore"  # the test's store file, in its shared directory
        for name in (
            "test_allreduce",
            "test_fails_on_rank1",
            "test_skip_in_child",
            "test_needs_gpus",
            "test_rank1_exits_with_skip_code",
            "test_rank0_exits_with_skip_code",
            "test_rank0_exits_3",
            "test_rank0_expected_death",
        )
    )


@pytest.mark.parametrize(
    ("codes", "skips", "skip_checks", "expected", "verdict"),
    [
        ({0: 0, 1: 0}, {}, False, 0, "pass"),
        ({0: 0, 1: 10}, {}, False, 0, "as-is"),  # an exception on any rank fails the test
        ({0: 0, 1: None}, {}, False, 0, "as-is"),  # a rank that did not finish: the harness's failure
        ({0: 0, 1: 87}, {1: True}, False, 0, "pass"),  # a peer's skip code does not count
        ({0: 87, 1: 0}, {0: True}, False, 0, "skip"),  # rank 0's does
        ({0: 3, 1: 0}, {}, False, 0, "wrong-code"),
        ({0: 3, 1: 0}, {}, False, 3, "pass"),  # special_return_code_checks
        ({0: 5, 1: 87}, {1: True}, True, 0, "pass"),  # skip_return_code_checks
        ({0: 5, 1: 10}, {}, True, 0, "as-is"),  # ... but never past an error exit
    ],
)
def test_torchs_exit_code_rule(
    codes: dict[int, int | None], skips: dict[int, bool], skip_checks: bool, expected: int, verdict: str
) -> None:
    assert torch_verdict(codes, skips, world_size=2, skip_checks=skip_checks, expected=expected) == verdict


def test_an_unreadable_signature_falls_back_to_pytests_own_names() -> None:
    """torch's ``join_or_run`` wraps a bound method; ``inspect.signature`` cannot read the result."""

    class Case:
        def test(self) -> None:
            pass

    bound = Case().test

    @functools.wraps(bound)
    def wrapper(self: Any) -> None:
        bound()

    fixturedef = types.SimpleNamespace(scope="function")
    item: Any = types.SimpleNamespace(
        function=types.MethodType(wrapper, Case()),
        _fixtureinfo=types.SimpleNamespace(argnames=("world",), name2fixturedefs={"world": [fixturedef]}),
    )
    assert function_scoped_arguments(item) == {"world"}


def test_a_bad_torch_tests_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--torch-tests=spawn")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--torch-tests='spawn': valid values are native, ranks*"])
