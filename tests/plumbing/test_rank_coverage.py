"""Coverage from every rank: lines that run only inside ranks count in the session's coverage, with no option.

Each session measures ``mylib``, whose lines run only on ranks: one branch only on rank 1, one function only in
a sub-world's ranks, one line only before a sub-world rank is killed at a planned kill point, one line only in
the teardown of the ranks (after pytest-cov's last context switch, which writes what was measured). Without the
ranks' data those lines are reported missed (40% of such a module, as a new user found), so each test fails
when the ranks' data is lost.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from sprite_testing import clear_rank_variables, needs_mpiexec, run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 180

MYLIB = """
from pytest_sprite import kill_point


def work(rank):
    if rank == 1:
        return "one"
    return "other"


def in_subworld(world):
    if world.rank == 1:
        return "sub one"
    return "sub other"


def release(rank):
    return f"released {rank}"


def until_killed(world):
    kill_point("step")
    kill_point("step")  # killed here
    return "never"  # pragma: no cover
"""

TESTS = """
import pytest
from pytest_sprite import KillAt, run_subworld

import mylib


@pytest.fixture
def held(world):
    yield
    mylib.release(world.rank)  # in teardown: after the last context switch, saved only at the rank's end


@pytest.mark.ranks(2)
def test_work(world, held):
    assert mylib.work(world.rank) == ("one" if world.rank == 1 else "other")


@pytest.mark.ranks(2)
def test_subworld(world):
    assert run_subworld(mylib.in_subworld).values() == ["sub other", "sub one"]


def test_killed_subworld():
    result = run_subworld(mylib.until_killed, ranks=1, kill=KillAt(event="step", at=2))
    assert result.killed() == [0]
"""

MISSED = """
def work(rank):
    if rank == 1:
        return "one"
    return "other"


def never_called():
    return "missed"
"""

MISSED_TESTS = """
import pytest

import mylib


@pytest.mark.ranks(2)
def test_work(world):
    assert mylib.work(world.rank) == ("one" if world.rank == 1 else "other")
"""

FAKES = Path(__file__).parents[1] / "fakes"


def _line(source: str, text: str) -> int:
    """The line number of the one line of ``source`` that ends with ``text``."""
    (number,) = [i for i, line in enumerate(source.splitlines(), 1) if line.endswith(text)]
    return number


def _contexts_by_line(data_file: Path, source: str) -> dict[int, list[str]]:
    """Each line of ``source`` that ran, and the dynamic contexts it ran under (read from coverage's database)."""
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    (measured,) = [f for f in data.measured_files() if f.endswith(source)]
    return {line: sorted(contexts) for line, contexts in data.contexts_by_lineno(measured).items()}


def test_pytest_cov_counts_every_ranks_lines_with_branches_and_contexts(pytester: pytest.Pytester) -> None:
    """``--cov`` alone: rank 1's branch, a sub-world's ranks and a killed sub-world rank are covered (100%),
    ``--cov-fail-under=100`` passes, ``--cov-branch`` counts the rank-only branch as taken, and under
    ``--cov-context=test`` each line names the test, the phase and the rank that ran it."""
    pytest.importorskip("pytest_cov")
    pytester.makepyfile(mylib=MYLIB, test_mylib=TESTS)
    result = run_pytest(
        pytester,
        "--cov=mylib",
        "--cov-report=term-missing",
        "--cov-branch",
        "--cov-context=test",
        "--cov-fail-under=100",
        timeout=TIMEOUT,
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "mylib.py * 14 * 0 * 4 * 0 * 100%*",
            "*Required test coverage of 100% reached. Total coverage: 100.00%*",
        ]
    )
    assert result.ret == 0
    lines = _contexts_by_line(pytester.path / ".coverage", "mylib.py")
    source = (pytester.path / "mylib.py").read_text()
    assert lines[_line(source, 'return "one"')] == ["test_mylib.py::test_work|run|rank1"]
    assert lines[_line(source, 'return "other"')] == ["test_mylib.py::test_work|run|rank0"]
    assert lines[_line(source, 'return "sub one"')] == [
        "test_mylib.py::test_subworld|run|rank1|subworld-rank1"
    ]
    assert lines[_line(source, 'return "sub other"')] == [
        "test_mylib.py::test_subworld|run|rank0|subworld-rank0"
    ]
    assert lines[_line(source, 'return f"released {rank}"')] == [
        "test_mylib.py::test_work|teardown|rank0",
        "test_mylib.py::test_work|teardown|rank1",
    ]
    # The plain test forked the sub-world's rank from its own process: it inherits the test's context.
    assert lines[_line(source, "# killed here")] == ["test_mylib.py::test_killed_subworld|run"]
    assert not [p.name for p in pytester.path.iterdir() if p.name.startswith(".coverage.")]


LAUNCHED = [
    pytest.param("mpiexec", marks=needs_mpiexec, id="mpiexec"),
    pytest.param("torchrun", marks=pytest.mark.slow, id="torchrun"),  # 10 s more than mpiexec here
    pytest.param("srun", marks=pytest.mark.slow, id="srun-stand-in"),
]


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_pytest_cov_counts_launched_ranks_and_fails_under_a_missed_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, launcher: str
) -> None:
    """Launched agents are new interpreters: their test children's lines count, and a line no rank ran is
    still reported missed, so ``--cov-fail-under=100`` fails the session."""
    pytest.importorskip("pytest_cov")
    clear_rank_variables(monkeypatch)
    if launcher == "srun":
        monkeypatch.setenv("PATH", f"{FAKES / 'slurm'}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    pytester.makepyfile(mylib=MISSED, test_mylib=MISSED_TESTS)
    result = run_pytest(
        pytester,
        f"--launcher={launcher}",
        "--ranks=2",
        "--cov=mylib",
        "--cov-report=term-missing",
        "--cov-fail-under=100",
        timeout=TIMEOUT,
    )
    result.assert_outcomes(passed=1)
    missed = _line((pytester.path / "mylib.py").read_text(), 'return "missed"')
    result.stdout.fnmatch_lines(
        [
            f"mylib.py * 6 * 1 * 83% * {missed}",
            "*FAIL Required test coverage of 100% not reached. Total coverage: 83.33%*",
        ]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_coverage_run_counts_every_ranks_lines_in_its_one_data_file(pytester: pytest.Pytester) -> None:
    """Plain ``coverage run -m pytest`` (one data file, no ``parallel``): each rank writes a file of its own
    beside it, which the session combines into the one file before coverage saves it."""
    pytester.makepyfile(mylib=MYLIB, test_mylib=TESTS)
    result = pytester.run(
        sys.executable,
        "-m",
        "coverage",
        "run",
        "--branch",
        "--source=mylib",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        timeout=TIMEOUT,
    )
    result.assert_outcomes(passed=3)
    report = pytester.run(sys.executable, "-m", "coverage", "report", "--show-missing", "--fail-under=100")
    report.stdout.fnmatch_lines(["mylib.py * 14 * 0 * 4 * 0 * 100%*"])
    assert report.ret == 0
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(".")) == [".coverage"]


def test_nothing_is_imported_without_coverage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where coverage does not measure, every call the controller and the ranks make loads no coverage module."""
    from types import SimpleNamespace

    from pytest_sprite.plumbing import coverage as rank_coverage

    for name in [m for m in sys.modules if m == "coverage" or m.startswith("coverage.")]:
        monkeypatch.delitem(sys.modules, name)
    rank_coverage.session_started()
    assert rank_coverage.agent_launch(SimpleNamespace()) == ((), {})
    rank_coverage.rank_started("rank0")
    rank_coverage.save_rank_data()
    rank_coverage.combine_rank_data()
    assert rank_coverage.current_context() is None
    assert not [m for m in sys.modules if m == "coverage" or m.startswith("coverage.")]


def test_agents_launched_under_pytest_cov_append_and_under_coverage_get_its_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What a launched agent is given: ``--cov-append`` under pytest-cov (a late agent must not erase what
    ranks saved); under ``coverage run``, the controller's configuration, one file per process."""
    coverage = pytest.importorskip("coverage")
    from types import SimpleNamespace

    from pytest_sprite.plumbing import coverage as rank_coverage

    assert rank_coverage.agent_launch(SimpleNamespace(cov_source=["mylib"], no_cov=False)) == (
        ("--cov-append",),
        {},
    )
    assert rank_coverage.agent_launch(SimpleNamespace(cov_source=[], no_cov=False)) == ((), {})
    monkeypatch.setattr(rank_coverage, "_rank_dir", str(tmp_path / "ranks"))
    cov = coverage.Coverage(data_file=str(tmp_path / ".coverage"), branch=True, source=["mylib"])
    monkeypatch.setattr(coverage.Coverage, "current", classmethod(lambda cls: cov))
    args, env = rank_coverage.agent_launch(SimpleNamespace())
    assert args == ()
    agent = coverage.Coverage(config_file=":data:" + env["COVERAGE_PROCESS_CONFIG"])
    assert agent.config.parallel is True
    assert agent.config.branch is True
    assert agent.config.data_file == str(tmp_path / "ranks" / ".coverage")


def test_rank_contexts_name_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every context switched to in a rank names it; a sub-world started there is told the labelled one."""
    from pytest_sprite.plumbing import coverage as rank_coverage

    switched: list[str] = []

    class Measuring:
        config = type("Config", (), {"parallel": True})()

        def switch_context(self, context: str) -> None:
            switched.append(context)

    cov = Measuring()
    fake = type(sys)("coverage")
    fake.Coverage = type("Coverage", (), {"current": staticmethod(lambda: cov)})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "coverage", fake)
    monkeypatch.setattr(rank_coverage, "_context", None)
    monkeypatch.setattr(rank_coverage, "_rank_coverage", None)
    rank_coverage.rank_started("rank1")
    assert rank_coverage.current_context() is None
    cov.switch_context("tests/x.py::test_a|run")
    assert switched == ["tests/x.py::test_a|run|rank1"]
    assert rank_coverage.current_context() == "tests/x.py::test_a|run|rank1"


def _hosts_unavailable() -> str | None:
    from pytest_sprite.hosts import cannot_make_hosts

    return cannot_make_hosts()


@pytest.mark.slow  # two hosts made and removed: 25 s a session here
@pytest.mark.parametrize("tool", ["pytest-cov", "coverage run"])
def test_rank_one_on_the_second_host_is_counted(pytester: pytest.Pytester, tool: str) -> None:
    """``python -m pytest_sprite hosts 2 -- <command>``: rank 1 runs on host2 and saves its data on the shared
    file system, where the controller on host1 combines it (pytest-cov's ``--cov``, or ``coverage run``)."""
    why_not = _hosts_unavailable()
    if why_not is not None:
        pytest.skip(f"no hosts here: {why_not}")
    pytester.makepyfile(mylib=MISSED, test_mylib=MISSED_TESTS)
    pytest_words = ["-m", "pytest", "-p", "no:cacheprovider", "--ranks=2"]
    if tool == "pytest-cov":
        command = [sys.executable, *pytest_words, "--cov=mylib", "--cov-report=term-missing"]
    else:
        command = [sys.executable, "-m", "coverage", "run", "--source=mylib", *pytest_words]
    result = pytester.run(
        sys.executable, "-m", "pytest_sprite", "hosts", "2", "--", *command, timeout=TIMEOUT
    )
    result.assert_outcomes(passed=1)
    result.stderr.fnmatch_lines(["*--launcher=mpiexec*", "*host2 hydra proxy -> host1 mpiexec*"])
    if tool == "coverage run":
        result = pytester.run(sys.executable, "-m", "coverage", "report", "--show-missing")
    missed = _line((pytester.path / "mylib.py").read_text(), 'return "missed"')
    result.stdout.fnmatch_lines([f"mylib.py * 6 * 1 * 83% * {missed}"])


def test_the_hosts_command_knows_pytest_under_coverage_run() -> None:
    """``coverage run -m pytest`` across hosts gets the hosts' launcher as ``python -m pytest`` does."""
    from pytest_sprite.hosts.cli import check_command

    assert check_command([sys.executable, "-m", "coverage", "run", "-p", "-m", "pytest", "--ranks=4"], 2) == 2
    assert check_command(["coverage", "run", "--branch", "-m", "pytest", "--ranks=4"], 2) == 2
    assert check_command(["coverage", "run", "-m", "mymodule", "--ranks=4"], 2) is None
    assert check_command(["coverage", "report", "--ranks=4"], 2) is None


def test_an_agent_writes_what_it_holds_once_so_ranks_write_only_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank agent saves before it forks ranks (each would write the agent's lines again); not in a one-file
    session, whose ranks measure afresh and whose one file the agent must not write."""
    from pytest_sprite.plumbing import coverage as rank_coverage

    saved: list[bool] = []

    class Measuring:
        def __init__(self, parallel: bool) -> None:
            self.config = type("Config", (), {"parallel": parallel})()

        def save(self) -> None:
            saved.append(self.config.parallel)

    fake = type(sys)("coverage")
    monkeypatch.setitem(sys.modules, "coverage", fake)
    for parallel in (True, False):
        cov = Measuring(parallel)
        fake.Coverage = type("Coverage", (), {"current": staticmethod(lambda cov=cov: cov)})  # type: ignore[attr-defined]
        rank_coverage.agent_started()
    assert saved == [True]
