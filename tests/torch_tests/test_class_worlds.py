"""torch's ``MultiProcContinuousTest`` on ranks: one world per class, bodies unchanged (issue 26).

The classes below are written in torch's idiom (``MultiProcContinuousTest``, ``_init_pg``, ``TEST_SKIPS``
exit codes); the expected outcomes are torch's (``_worker_loop`` and ``_worker_run_main_wait``): the first
rank in rank order that did not pass decides, a ``SkipTest`` raised in a worker fails the test, and after a
failure the rest of the class is skipped. The slow test runs the same file natively and compares.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from sprite_testing import fnescape

pytestmark = pytest.mark.cpu

pytest.importorskip("expecttest", reason="torch's test classes need expecttest: pip install expecttest")

TIMEOUT = 240
NATIVE_TIMEOUT = 900
"""Natively torch spawns each class's workers: 142 s at load 2-5 here, more than 240 s at load 23."""
FILE = "test_class_worlds_suite.py"
SKIP = fnescape(f"SKIPPED [1] {FILE}:")

SUITE = """
import os
import sys
import unittest
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcContinuousTest

LOG = Path({log!r})


def note(*words):
    with LOG.open("a") as f:
        f.write(" ".join(str(word) for word in words) + "\\n")


class Gloo(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        note("init", cls.__name__, rank, os.getpid())
        super()._init_pg(rank, world_size, rdvz_file)

    def setUp(self):
        super().setUp()
        note("setUp", type(self).__name__, self._testMethodName, os.getpid())

    def run_here(self):
        note("test", type(self).__name__, self._testMethodName, self.rank, os.getpid())


class OneWorld(Gloo):
    def test_a_allreduce(self):
        self.run_here()
        t = torch.ones(2) * (self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 3.0))

    def test_b_same_group(self):
        self.run_here()
        self.assertTrue(dist.is_initialized())
        self.assertEqual(dist.get_world_size(), 2)

    def test_c_rank1_skip_code(self):  # the first rank that did not pass decides: skipped
        self.run_here()
        if self.rank == 1:
            sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)

    def test_d_fails_on_rank1(self):
        self.run_here()
        dist.barrier()
        self.assertEqual(self.rank, 0, "only rank 0 may pass")

    def test_e_after_the_failure(self):  # torch skips the rest of the class
        self.run_here()


class SkipTestInWorker(Gloo):
    def test_a_skiptest(self):  # torch's worker turns it into a failure
        self.run_here()
        self.skipTest("a worker's SkipTest")

    def test_b_next(self):
        self.run_here()


class CrashMidClass(Gloo):
    def test_a_passes(self):
        self.run_here()

    def test_b_rank1_dies(self):  # the class's world ends: this test fails, the rest is skipped
        self.run_here()
        if self.rank == 1:
            os._exit(1)

    def test_c_after_the_crash(self):
        self.run_here()


class OtherWorld(Gloo):
    def test_own_group(self):
        self.run_here()
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)

    @unittest.skip("decorated")
    def test_decorated(self):
        pass
"""

EXPECTED = {
    "OneWorld::test_a_allreduce": "passed",
    "OneWorld::test_b_same_group": "passed",
    "OneWorld::test_c_rank1_skip_code": "skipped",
    "OneWorld::test_d_fails_on_rank1": "failed",
    "OneWorld::test_e_after_the_failure": "skipped",
    "SkipTestInWorker::test_a_skiptest": "failed",
    "SkipTestInWorker::test_b_next": "skipped",
    "CrashMidClass::test_a_passes": "passed",
    "CrashMidClass::test_b_rank1_dies": "failed",
    "CrashMidClass::test_c_after_the_crash": "skipped",
    "OtherWorld::test_decorated": "skipped",
    "OtherWorld::test_own_group": "passed",
}


def _session(root: Path, *args: str, timeout: float = TIMEOUT) -> tuple[pytest.RunResult, Path]:
    """One pytest session over the suite in ``root`` (a fresh log); its result and log."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / "notes.log"
    (root / FILE).write_text(SUITE.format(log=str(log)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfs", "-v", *args, FILE],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return pytest.RunResult(done.returncode, done.stdout.splitlines(), done.stderr.splitlines(), 0.0), log


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    """``Class::test`` -> its outcome, from the ``-v`` lines."""
    found = {}
    for line in result.outlines:
        if line.startswith(f"{FILE}::") and " " in line:
            nodeid, word = line.split(" ", 1)
            found[nodeid.split("::", 1)[1]] = word.split()[0].lower()
    return found


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[pytest.RunResult, Path]:
    """The suite with ``--torch-tests=ranks`` (packing on, the default)."""
    return _session(tmp_path_factory.mktemp("ranks"), "--torch-tests=ranks", "--junitxml=junit.xml")


def test_each_outcome_is_torchs(ranks: tuple[pytest.RunResult, Path]) -> None:
    result, _ = ranks
    assert _outcomes(result) == EXPECTED, result.stdout.str()
    result.assert_outcomes(passed=4, failed=3, skipped=5)
    result.stdout.fnmatch_lines_random(
        [
            SKIP + "*: Need at least 2 CUDA devices",
            SKIP
            + "*: Previous test failed, skipping test_class_worlds_suite.OneWorld.test_e_after_the_failure",
            SKIP + "*: Previous test failed, skipping test_class_worlds_suite.SkipTestInWorker.test_b_next",
            SKIP
            + "*: Previous test failed, skipping test_class_worlds_suite.CrashMidClass.test_c_after_the_crash",
            SKIP + "*: decorated",
        ]
    )
    out = result.stdout.str()
    assert "only rank 0 may pass" in out
    assert "Exception in worker process" in out and "a worker's SkipTest" in out
    assert "rank 1 exited with code 1 during call before reporting its result" in out  # the crash, named


def test_one_group_per_class_and_the_tests_in_its_processes(ranks: tuple[pytest.RunResult, Path]) -> None:
    _, log = ranks
    lines = [line.split() for line in log.read_text().splitlines()]
    inits = {(words[1], int(words[2])): words[3] for words in lines if words[0] == "init"}
    assert sorted(inits) == [
        (cls, rank)
        for cls in ("CrashMidClass", "OneWorld", "OtherWorld", "SkipTestInWorker")
        for rank in (0, 1)
    ]
    ran: dict[tuple[str, int], set[str]] = defaultdict(set)
    names: dict[str, set[str]] = defaultdict(set)
    for words in lines:
        if words[0] == "test":
            ran[(words[1], int(words[3]))].add(words[4])
            names[words[1]].add(words[2])
    assert {key: {inits[key]} for key in inits} == dict(ran)  # each rank's tests ran where its group was made
    assert names["OneWorld"] == {
        "test_a_allreduce",
        "test_b_same_group",
        "test_c_rank1_skip_code",
        "test_d_fails_on_rank1",
    }
    assert not any(words[0] == "setUp" for words in lines)  # torch's dispatcher side runs nowhere here


def test_each_test_is_its_own_junit_case(ranks: tuple[pytest.RunResult, Path]) -> None:
    _, log = ranks
    junit = (log.parent / "junit.xml").read_text()
    assert junit.count("<testcase ") == len(EXPECTED)
    assert 'name="test_e_after_the_failure"' in junit


def test_the_world_is_the_selected_tests_and_unpacked_alike(tmp_path: Path) -> None:
    """``-k`` before the grouping: the failure is not selected, so nothing after it is skipped."""
    result, log = _session(
        tmp_path, "--torch-tests=ranks", "--pack=off", "-k", "OneWorld and (test_b or test_e)"
    )
    assert _outcomes(result) == {
        "OneWorld::test_b_same_group": "passed",
        "OneWorld::test_e_after_the_failure": "passed",
    }
    assert sum(line.startswith("init OneWorld") for line in log.read_text().splitlines()) == 2


@pytest.mark.slow
def test_the_outcomes_are_the_native_runners(tmp_path: Path, ranks: tuple[pytest.RunResult, Path]) -> None:
    """The same file natively (torch spawns the workers): the same outcome for every test."""
    native, _ = _session(tmp_path, timeout=NATIVE_TIMEOUT)
    assert _outcomes(native) == _outcomes(ranks[0]) == EXPECTED, native.stdout.str()


def _report(item: pytest.Item, when: str, outcome: str = "passed") -> pytest.TestReport:
    return pytest.TestReport(item.nodeid, item.location, {}, outcome, None, when)  # type: ignore[arg-type]


def test_the_reports_are_sorted_out_by_test_and_the_rest_skipped_after_a_failure(
    pytester: pytest.Pytester,
) -> None:
    """The controller's side without processes: the ranks ran ``a`` (whose teardown report comes last) and ``b``,
    which failed on rank 0; both were then ended. ``c`` is torch's skip on every rank."""
    from pytest_sprite.torch_tests.cases import TorchTest, torch_test_key
    from pytest_sprite.torch_tests.classworld import ClassGroup, ClassWorld

    items = pytester.getitems(
        """
        import unittest

        class Three(unittest.TestCase):
            def test_a(self): pass
            def test_b(self): pass
            def test_c(self): pass
        """
    )
    for item in items:
        item.stash[torch_test_key] = TorchTest(
            cls=item.cls,
            name=item.name,
            world_size=2,
            timeout=None,
            kind="continuous",  # type: ignore[arg-type]
        )
    a, b, c = items
    world = ClassWorld(ClassGroup(items=items))
    reports = {
        rank: [
            _report(a, "setup"),
            _report(a, "call"),
            _report(b, "setup"),
            _report(b, "call", outcome),
            _report(b, "teardown"),
        ]
        for rank, outcome in ((0, "failed"), (1, "passed"))
    }
    world.after(reports, {})
    assert {rank: [(rep.nodeid, rep.when) for rep in reps] for rank, reps in reports.items()} == {
        rank: [(a.nodeid, "setup"), (a.nodeid, "call"), (a.nodeid, "teardown")] for rank in (0, 1)
    }
    carried = world.carried()
    assert [test.item for test in carried] == [b, c]
    assert [rep.outcome for rep in carried[0].reports[0]] == ["passed", "failed", "passed"]
    for rank in (0, 1):
        setup, teardown = carried[1].reports[rank]
        assert (setup.when, setup.outcome, teardown.when, teardown.outcome) == (
            "setup",
            "skipped",
            "teardown",
            "passed",
        )
        assert isinstance(setup.longrepr, tuple)
        assert (
            setup.longrepr[2]
            == "Skipped: Previous test failed, skipping test_the_reports_are_sorted_out_by_test_and_the_rest_skipped_after_a_failure.Three.test_c"
        )
