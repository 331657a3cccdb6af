"""A ranks test's files and processes: one tmp_path for every rank, nothing left running (issue 9)."""

from __future__ import annotations

import getpass
import os
import re
import sys
from functools import partial
from pathlib import Path

import pytest
from sprite_testing import fnescape, run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 180


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


run = partial(run_pytest, timeout=TIMEOUT, flags=("-rw",))


def test_ranks_share_tmp_path_and_rank_0_writes_what_rank_1_reads(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_checkpoint(world, tmp_path, tmp_path_factory):
            paths = world.gather_object(str(tmp_path))
            assert paths[0] == paths[1], paths
            if world.rank == 0:
                (tmp_path / "ckpt.txt").write_text("step 7")
            world.barrier()
            assert (tmp_path / "ckpt.txt").read_text() == "step 7"
            made = world.gather_object([str(tmp_path_factory.mktemp("data")) for _ in range(2)])
            assert made[0] == made[1] and made[0][0] != made[0][1], made
            mine = world.rank_path("state.pt")
            mine.write_text(str(world.rank))
            assert mine == tmp_path / f"rank{world.rank}" / "state.pt"
            print(f"TMP_PATH={tmp_path} BASETEMP={tmp_path_factory.getbasetemp()}")
            assert False, "keep the directory (failed tests keep theirs)"
        """
    )
    result = run(pytester, "-rA")
    result.assert_outcomes(failed=1)
    base = Path(re.search(r"BASETEMP=(/\S+)", result.stdout.str())[1])  # type: ignore[index]
    assert base.parent == pytester.path, "pytester's --basetemp for the inner session"
    test_dirs = [p for p in base.iterdir() if p.name.startswith("test_checkpoint") and not p.is_symlink()]
    assert sorted(p.name for p in test_dirs) == [
        "test_checkpoint0",
        "test_checkpoint0-data0",
        "test_checkpoint0-data1",
    ]
    shared = base / "test_checkpoint0"
    assert (shared / "ckpt.txt").read_text() == "step 7"
    assert [(shared / f"rank{r}" / "state.pt").read_text() for r in (0, 1)] == ["0", "1"]
    result.stdout.fnmatch_lines([f"*TMP_PATH={fnescape(str(shared))} BASETEMP={fnescape(str(base))}*"])


def test_a_test_that_asks_for_no_tmp_path_gets_one_when_a_rank_first_needs_it(
    pytester: pytest.Pytester,
) -> None:
    """No directory is made for a ranks test that does not ask for one; using one at run time still works,
    the same on every rank, and a passing test's unused directory is not left behind (issue 23)."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_late(world, request):
            mine = world.rank_path("state.pt")
            mine.write_text(str(world.rank))
            shared = request.getfixturevalue("tmp_path")
            assert world.gather_object(str(shared)) == [str(shared)] * 2
            assert mine == shared / f"rank{world.rank}" / "state.pt"
            print(f"TMP_PATH={shared}")
            assert False, "keep the directory (failed tests keep theirs)"

        @pytest.mark.ranks(2)
        def test_none(world):
            pass
        """
    )
    result = run(pytester, "-rA")
    result.assert_outcomes(passed=1, failed=1)
    shared = Path(re.search(r"TMP_PATH=(/\S+)", result.stdout.str())[1])  # type: ignore[index]
    assert re.fullmatch(r"test_late-run\d+", shared.name), shared.name
    assert [(shared / f"rank{r}" / "state.pt").read_text() for r in (0, 1)] == ["0", "1"]
    assert not [p for p in shared.parent.iterdir() if p.name.startswith("test_none")]


@pytest.mark.slow
def test_one_basetemp_per_session_pruned_as_pytest_prunes(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --basetemp: the children make no basetemp of their own; retention is pytest's."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        @pytest.mark.parametrize("i", range(2))
        def test_uses_tmp_path(world, tmp_path, i):
            (tmp_path / f"r{world.rank}").write_text("x")

        @pytest.mark.ranks(2)
        def test_fails(world, tmp_path):
            (tmp_path / f"r{world.rank}").write_text("x")
            assert False
        """
    )
    root = tmp_path / "temproot"
    root.mkdir()
    monkeypatch.setenv("PYTEST_DEBUG_TEMPROOT", str(root))
    pytest_argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    assert pytester.run(*pytest_argv, "-k", "not fails", timeout=TIMEOUT).ret == 0
    failed_policy = pytester.run(*pytest_argv, "-o", "tmp_path_retention_policy=failed", timeout=TIMEOUT)
    failed_policy.assert_outcomes(passed=2, failed=1)
    user_root = root / f"pytest-of-{getpass.getuser()}"
    sessions = sorted(p.name for p in user_root.iterdir() if not p.is_symlink())
    assert sessions == ["pytest-0", "pytest-1"], "one basetemp per session, none per rank"
    assert os.readlink(user_root / "pytest-current") == str(user_root / "pytest-1")

    def test_dirs(session: str) -> list[str]:
        return sorted(p.name for p in (user_root / session).iterdir() if not p.is_symlink())

    # pytest's default policy (all) keeps every test's directory ...
    assert test_dirs("pytest-0") == ["test_uses_tmp_path_0_0", "test_uses_tmp_path_1_0"]
    # ... and policy failed removes those of the tests that passed, once every rank has ended.
    assert test_dirs("pytest-1") == ["test_fails0"]
    assert sorted(p.name for p in (user_root / "pytest-1" / "test_fails0").iterdir()) == ["r0", "r1"]


def test_a_process_left_running_is_ended_and_named(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    pytester.makepyfile(
        f"""
        import subprocess
        import pytest

        @pytest.mark.ranks(2)
        def test_leaks(world):
            proc = subprocess.Popen(["sleep", "600"])
            with open(r"{pids}/rank%d" % world.rank, "w") as f:
                f.write(str(proc.pid))

        @pytest.mark.ranks(2)
        def test_next_one_is_clean(world):
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=2)
    leaked = {r: int((pids / f"rank{r}").read_text()) for r in (0, 1)}
    for rank, pid in leaked.items():
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        result.stdout.fnmatch_lines(
            [
                f"*rank {rank} left 1 process running after the test; pytest-sprite ended it (stop what a test "
                "starts, e.g. proc.terminate(); proc.wait() in a finally or a fixture's teardown):*",
                f"*pid {pid}: sleep 600 (ended by SIGTERM)*",
            ]
        )
    assert "test_next_one_is_clean" not in result.stdout.str().split("warnings summary")[-1]
