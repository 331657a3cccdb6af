"""The catalogue of misuse: every bad option, setting, marker and body, and what the user sees.

One parametrized test over :data:`CASES`: each case is a pytest session that misuses one thing, and the
one line that must name it. Nothing is lost: a usage error is one line on stderr and no traceback; a
session that runs tests counts every test in pytest's summary and, where it asked for a JSON report that
can be written, leaves one that is complete and valid against the schema. A new option gets its bad
input here (:func:`test_every_option_has_a_misuse_case` checks). ``docs/reference/misuse.md`` is the same
catalogue for users.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sprite_testing import clear_rank_variables, fnescape, needs_mpiexec, run_pytest

from pytest_sprite.glue.options import OPTIONS

pytestmark = pytest.mark.cpu

FAKES = Path(__file__).parents[1] / "fakes"
TIMEOUT = 120

MODULE = """
import pytest

@pytest.mark.ranks(2)
def test_ranks(world):
    assert world.size == 2

def test_plain():
    pass
"""

# Few descriptors, so that a small world is beyond them on any machine (the figures are measured).
FEW_DESCRIPTORS = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
"""

USAGE = int(pytest.ExitCode.USAGE_ERROR)
INTERRUPTED = int(pytest.ExitCode.INTERRUPTED)


@dataclass(frozen=True)
class Misuse:
    """One misuse: the session's arguments, environment and files, and what it must show."""

    id: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=lambda: {"test_misuse_case.py": MODULE})
    lines: tuple[str, ...] = ()
    """fnmatch patterns that must appear in the session's stdout and stderr, in order."""
    ret: int = USAGE
    outcomes: Mapping[str, int] | None = None
    """pytest's summary (``assert_outcomes``); None for a usage error, which runs nothing."""
    report: bool = False
    """Ask for ``--sprite-report`` and check the document is complete and valid."""
    report_collectors: tuple[str, ...] = ()
    """Node ids the report's ``collectors`` must name (a collection error is kept though no test ran)."""
    report_world: int | str | None = "unchecked"
    """The report's ``environment.world_size``: null when no ranks test ran."""
    report_ranks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Test name -> each rank's outcome in the report's per-rank entries."""
    report_text: tuple[str, ...] = ()
    """fnmatch patterns the report's phase texts (each phase's ``longrepr``) must hold, in order."""
    session: bool = False
    """Runs ranks tests: a session of its own in a subprocess (a usage error runs in this process)."""
    marks: tuple[Any, ...] = ()


def _usage(id: str, *args: str, env: Mapping[str, str] | None = None, line: str) -> Misuse:
    # --collect-only: a usage error ends the session at configure either way, and should the refusal ever
    # go, the session runs no ranks test inside this test process.
    lines = (fnescape(f"ERROR: {line}") + "*",)
    return Misuse(id=id, args=(*args, "--collect-only"), env=env or {}, lines=lines)


PALS_FAKE = {"PATH": f"{FAKES / 'pals'}{os.pathsep}{os.environ.get('PATH', '')}"}

CASES = [
    # -- options and environment variables: one line naming the source ------------------------------
    _usage("ranks", "--ranks=0", line="--ranks must be a positive integer (1, 2, 24, ...), got '0'"),
    _usage("launcher", "--launcher=slurmish", line="--launcher='slurmish' is not a known launcher"),
    _usage("rank-timeout", "--rank-timeout=soon", line="--rank-timeout must be a number of seconds > 0"),
    _usage("rank-grace", "--rank-grace=-1", line="--rank-grace must be a number of seconds > 0, got '-1'"),
    _usage("pack", "--pack=maybe", line="--pack='maybe': valid values are on, off"),
    _usage(
        "launch-early", "--launch-early=soon", line="--launch-early='soon': valid values are auto, on, off"
    ),
    _usage("ppn", "--ppn=0", line="--ppn must be a positive integer"),
    _usage(
        "sprite-mutate",
        "--sprite-mutate=bogus",
        line="--sprite-mutate: 'bogus' is not a mutant; valid mutants:",
    ),
    _usage(
        "sprite-mutate-fail-under",
        "--sprite-mutate-fail-under=2",
        line="--sprite-mutate-fail-under='2' is not a score; give a number from 0 to 1",
    ),
    _usage(
        "launcher-args-quote",
        "--launcher-args=--cpu-bind 'list:1-8",
        line='--launcher-args="--cpu-bind \'list:1-8": cannot be split into words (no closing quotation)',
    ),
    _usage(
        "launcher-args-env",
        env={"SPRITE_LAUNCHER_ARGS": '--env "A=1'},
        line="environment variable SPRITE_LAUNCHER_ARGS='--env \"A=1': cannot be split into words",
    ),
    _usage(
        "controller-host",
        env={"SPRITE_CONTROLLER_HOST": "no-such-host.invalid"},
        line="environment variable SPRITE_CONTROLLER_HOST='no-such-host.invalid': this host cannot resolve it",
    ),
    _usage(
        "controller-host-empty",
        "--controller-host= ",
        line="--controller-host=' ': this host cannot resolve it",
    ),
    _usage(
        "connect-timeout", "--connect-timeout=0", line="--connect-timeout must be a number of seconds > 0"
    ),
    _usage(
        "device", "--sprite-device=tpu", line="--sprite-device='tpu': valid values are auto, cpu, cuda, xpu"
    ),
    _usage("summary", "--sprite-summary=loud", line="--sprite-summary='loud': valid values are auto, no"),
    _usage("torch-tests", "--torch-tests=x", line="--torch-tests='x': valid values are native, ranks"),
    _usage("reuse", "--sprite-reuse=x", line="--sprite-reuse='x': valid values are auto, off"),
    _usage(
        "world-check",
        env={"SPRITE_WORLD_CHECK": "maybe"},
        line="environment variable SPRITE_WORLD_CHECK='maybe'",
    ),
    _usage(
        "collective-check",
        env={"SPRITE_COLLECTIVE_CHECK": "maybe"},
        line="environment variable SPRITE_COLLECTIVE_CHECK='maybe' is not a switch",
    ),
    # -- output paths: checked before any test runs --------------------------------------------------
    _usage(
        "report-under-a-file",
        "--sprite-report=afile/report.json",
        line="--sprite-report=afile/report.json: ",
    ),
    _usage(
        "report-in-proc",
        "--sprite-report=/proc/x.json",
        line="--sprite-report=/proc/x.json: cannot create files in /proc",
    ),
    _usage("report-is-a-directory", "--sprite-report=.", line="--sprite-report=.: is a directory"),
    _usage(
        "plots-is-a-file", "--sprite-plots=afile", line="--sprite-plots=afile: is a file, not a directory"
    ),
    _usage(
        "plots-env",
        env={"SPRITE_PLOTS": "afile/plots"},
        line="environment variable SPRITE_PLOTS=afile/plots: ",
    ),
    _usage(
        "artifacts",
        "--sprite-artifacts=/proc/arms",
        line="--sprite-artifacts=/proc/arms: cannot create files in /proc",
    ),
    # -- a world beyond what the machine holds --------------------------------------------------------
    Misuse(  # its own process: the check is skipped under --collect-only, and a world is never forked here
        id="world-beyond-the-machine",
        args=("--ranks=64",),
        files={"conftest.py": FEW_DESCRIPTORS, "test_misuse_case.py": MODULE},
        lines=(
            "ERROR: --ranks=64: a local world of 64 ranks needs about * file descriptors*--world-check=off*",
        ),
        session=True,
    ),
    # -- markers ----------------------------------------------------------------------------------------
    Misuse(
        id="two-ranks-markers",
        args=("--collect-only",),
        files={
            "test_two.py": """
                import pytest

                @pytest.mark.ranks(2)
                @pytest.mark.ranks(4, timeout=5)
                def test_two():
                    pass

                def test_plain():
                    pass
                """
        },
        lines=(
            "*test_two.py::test_two has 2 @pytest.mark.ranks markers: ranks(4, timeout=5) and ranks(2); keep one*",
        ),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
    ),
    Misuse(
        id="collection-error-in-the-report",
        files={"test_fine.py": MODULE, "test_broken.py": "def test_x(:\n    pass\n"},
        lines=("*ERROR collecting test_broken.py*",),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        report_collectors=("test_broken.py",),
    ),
    Misuse(
        # Three small misuses of one passing test, in one session: a class's marker and its method's (the
        # method's wins), a returned value, and a process started in a session of its own and left running.
        id="class-and-function-markers-return-value-own-session",
        files={
            "test_nearest.py": """
                import subprocess
                import pytest

                @pytest.mark.ranks(4)
                class TestNearest:
                    @pytest.mark.ranks(2)
                    def test_function_wins(self, world):
                        assert world.size == 2
                        if world.rank == 0:
                            subprocess.Popen(["sleep", "120"], start_new_session=True)
                        return world.rank
                """
        },
        lines=(
            "*PytestReturnNotNoneWarning: [[]all 2 ranks[]] Test functions should return None*",
            "*LeftoverProcessWarning: rank 0 left 1 process running after the test*",
            "*pid *: sleep 120 (in a session of its own (start_new_session=True or os.setsid), found as a child)*",
        ),
        ret=0,
        outcomes={"passed": 1, "warnings": 2},
        report=True,
        report_world=2,
        session=True,
    ),
    Misuse(
        id="no-ranks-test-ran",
        args=("--ranks=2", "-k", "plain"),
        ret=0,
        outcomes={"passed": 1, "deselected": 1},
        report=True,
        report_world=None,
    ),
    Misuse(
        id="marker-beyond-the-machine",
        files={
            "conftest.py": FEW_DESCRIPTORS,
            "test_huge.py": """
                import pytest

                @pytest.mark.ranks(64)
                def test_huge():
                    pass
                """,
        },
        lines=("*a local world of 64 ranks needs about * file descriptors*RLIMIT_NOFILE*--world-check=off*",),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        session=True,
    ),
    # -- a report that cannot be written at the end: a warning line, the summary and the status stay ---
    Misuse(
        # The report's folder and the plots' are each replaced by a file while the session runs.
        id="report-and-plots-folders-gone",
        args=("--sprite-report=out/report.json", "--sprite-plots=plots"),
        files={
            "test_gone.py": MODULE
            + """
from pytest_sprite import record_assertion
from pytest_sprite.assertions.parity import ArmParity, ParityResult

def test_records_a_plot():
    arm = ArmParity(label="ddp", arm="ddp", ranks=2, global_batch=4, accumulate=1, fault=None,
                    strategy="XPUDDPStrategy", pre_norm_rel=7.5e-8, post_norm_rel=7.3e-8, update_rel_l2=1.3e-6,
                    frozen_changed=0, frozen_total=26, failed=(),
                    pre_norm_rel_steps=(1e-8, 7.5e-8), post_norm_rel_steps=(0.0, 7.3e-8))
    record_assertion(ParityResult(rtol=1e-4, reference="ref", arms=(arm,)))

def test_replaces_the_folders():
    import shutil
    for folder in ("out", "plots"):
        shutil.rmtree(folder, ignore_errors=True)
        open(folder, "w").close()
"""
        },
        lines=(
            "sprite: warning: the JSON report was not written to out/report.json: *",
            "sprite: warning: a plot (and those after it) was not written to plots: *",
        ),
        ret=0,
        outcomes={"passed": 4},
        session=True,
    ),
    # -- bodies -----------------------------------------------------------------------------------------
    Misuse(
        # Rank 0 would wait for ever: it ends only because it is told to stop (not after --rank-grace).
        id="pytest-exit-on-a-rank",
        args=("--rank-grace=3600",),
        files={
            "test_exit.py": """
                import time
                import pytest

                @pytest.mark.ranks(2)
                def test_exits(world):
                    if world.rank == 1:
                        pytest.exit("enough", returncode=7)
                    time.sleep(3600)

                @pytest.mark.ranks(2)
                def test_after():
                    pass
                """
        },
        lines=("*Exit: enough (pytest.exit on rank 1)*",),
        ret=7,
        outcomes={"failed": 1},
        report=True,
        report_ranks={"test_exits": ("ended", "interrupted")},
        report_text=("[[]rank 1[]] rank 1 called pytest.exit('enough', returncode=7) during call*",),
        session=True,
    ),
    Misuse(
        # No fixture: the call starts right after setup, before an agent that relayed at leisure had sent
        # setup's report on, and the loss was placed in setup.
        id="rank-kills-its-own-agent",
        files={
            "test_kill.py": """
                import os
                import signal
                import pytest

                @pytest.mark.ranks(2)
                def test_kills_its_agent():
                    if os.environ["RANK"] == "1":
                        os.kill(os.getppid(), signal.SIGKILL)

                @pytest.mark.ranks(2)
                def test_after():
                    pass

                def test_plain():
                    pass
                """
        },
        lines=(
            "*rank 1: its rank agent was lost during call (*the agent was killed by signal 9 (SIGKILL)*",
            "FAILED test_kill.py::test_kills_its_agent - [[]rank 1[]] *",
        ),
        ret=1,
        outcomes={"failed": 1, "passed": 2},
        report=True,
        report_ranks={"test_after": ("passed", "passed")},  # rank 0 of the first: passed, or ended waiting
        report_text=("[[]rank 1[]] rank 1: its rank agent was lost during call*",),
        session=True,
    ),
    # -- launch settings --------------------------------------------------------------------------------
    Misuse(
        id="pals-outside-pbs",
        args=("--launcher=pals",),
        env=PALS_FAKE,
        lines=("*--launcher=pals: this pytest is not inside a PBS job (PBS_JOBID is not set)*",),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        session=True,
        marks=(pytest.mark.slow,),  # CI: the check's unit test, and the failed launch's session below
    ),
    Misuse(
        id="failing-launch-shows-its-command-once",
        args=("--launcher=pals", "--launcher-args=--bogus"),
        env={**PALS_FAKE, "PBS_JOBID": "1.fake-pbs"},
        lines=("*the launch ended with status*", "+ *mpiexec* --bogus *", "*rank 0 shows why*"),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        session=True,
    ),
    # -- errors only one rank sees -----------------------------------------------------------------------
    Misuse(
        # Ranks 1 and 2 fail together (each waits for the other's file first), each with its own error.
        id="mpiexec-conftest-fails-on-ranks-1-and-2",
        args=("--launcher=mpiexec", "--ranks=3", "--connect-timeout=300"),
        files={
            "conftest.py": """
                import os
                import time
                rank = os.environ.get("PMI_RANK")
                if rank in ("1", "2"):
                    open(f"failing-{rank}", "w").close()
                    deadline = time.monotonic() + 60
                    while not all(os.path.exists(f"failing-{r}") for r in "12") and time.monotonic() < deadline:
                        time.sleep(0.01)
                    exec("x = (" if rank == "1" else "y = ]")
                """,
            "test_m.py": MODULE.replace("ranks(2)", "ranks(3)").replace("== 2", "== 3"),
        },
        lines=(
            "*rank agents 1-2 failed before they could join the world, with 2 different errors:",
            "--- rank agent 1 ---",
            "*SyntaxError: '(' was never closed",
            "--- rank agent 2 ---",
            "*SyntaxError: unmatched ']'",
        ),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        session=True,
        marks=(needs_mpiexec,),
    ),
    Misuse(
        id="mpiexec-import-error-on-ranks-1-and-2",
        args=("--launcher=mpiexec", "--ranks=3"),
        files={
            "test_t.py": """
                import os
                import pytest
                if os.environ.get("PMI_RANK") in ("1", "2"):
                    import no_such_module_here

                @pytest.mark.ranks(3)
                def test_one():
                    pass

                def test_plain():
                    pass
                """
        },
        lines=(
            "*rank agents 1-2 could not collect what this process collected",
            "error collecting test_t.py on rank agents 1-2:",
            "*ModuleNotFoundError: No module named 'no_such_module_here'*",
        ),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        session=True,
        marks=(needs_mpiexec,),
    ),
    Misuse(
        id="torchrun-import-error-on-ranks-1-and-2",
        args=("--launcher=torchrun", "--ranks=3"),
        files={
            "test_t.py": """
                import os
                import pytest
                if os.environ.get("RANK") in ("1", "2"):
                    import no_such_module_here

                @pytest.mark.ranks(3)
                def test_one():
                    pass
                """
        },
        lines=(
            "*rank agents 1-2 could not collect what this process collected",
            "error collecting test_t.py on rank agents 1-2:",
            "*ModuleNotFoundError: No module named 'no_such_module_here'*",
        ),
        ret=INTERRUPTED,
        outcomes={"errors": 1},
        report=True,
        session=True,
        marks=(pytest.mark.slow,),
    ),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_misuse(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, case: Misuse) -> None:
    clear_rank_variables(monkeypatch)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    (pytester.path / "afile").write_text("a regular file where a folder is expected\n")
    (pytester.path / "out").mkdir()
    for name, source in case.files.items():
        pytester.makepyfile(**{name.removesuffix(".py"): source})
    report = pytester.path / "report.json"
    args = (*case.args, f"--sprite-report={report}") if case.report else case.args
    if case.session:
        result = run_pytest(pytester, *args, timeout=TIMEOUT)
    else:
        result = pytester.runpytest(*args)
    output = result.stdout.lines + result.stderr.lines
    assert result.ret == case.ret, "\n".join(output)
    pytest.LineMatcher(output).fnmatch_lines(list(case.lines))
    assert not any(
        line.startswith(("Traceback (most recent call last)", "INTERNALERROR")) for line in output
    ), "\n".join(output)
    if case.outcomes is None:  # a usage error: one line, nothing run
        errors = [line for line in result.stderr.lines if line.strip()]
        assert len(errors) == 1, "\n".join(output)
        return
    result.assert_outcomes(**case.outcomes)
    if case.report:
        document = _check_report(report, case.outcomes, case.ret)
        assert [c["nodeid"] for c in document.get("collectors", [])] == list(case.report_collectors)
        if case.report_world != "unchecked":
            assert document["environment"]["world_size"] == case.report_world
        tests = {test["nodeid"].rpartition("::")[2]: test for test in document["tests"]}
        for name, ranks in case.report_ranks.items():
            assert tuple(rank["outcome"] for rank in tests[name]["ranks"]) == ranks, tests[name]
        texts = [
            line
            for test in document["tests"]
            for phase in ("setup", "call", "teardown")
            for line in str(test.get(phase, {}).get("longrepr", "")).splitlines()
        ]
        pytest.LineMatcher(texts).fnmatch_lines(list(case.report_text))


def _check_report(path: Path, outcomes: Mapping[str, int], ret: int) -> dict[str, Any]:
    """The report is valid against the schema and holds every test the summary counted."""
    import jsonschema

    from pytest_sprite.report.json_report import load_schema

    document = json.loads(path.read_text())
    jsonschema.validate(document, load_schema())
    assert document["exitcode"] == ret
    counted = {"passed": "passed", "failed": "failed", "errors": "error", "skipped": "skipped"}
    for key, number in outcomes.items():
        if key in counted:
            found = document["summary"].get(counted[key], 0)
            if (
                key == "errors"
            ):  # pytest counts a collection error among the errors; the report keeps it apart
                found += len(document.get("collectors", []))
            assert found == number, document["summary"]
    assert document["summary"]["total"] == len(document["tests"])
    return document


# Options whose value is free text that only its use can judge, and where that use names the option.
_NO_BAD_VALUE = {
    "--qwen-path": "a model directory, checked where lora_qwen loads it (one line naming --qwen-path)",
}


def test_every_option_has_a_misuse_case() -> None:
    """A new option comes with its bad input in :data:`CASES` (or a reason it has none)."""
    named = " ".join(" ".join(case.args) + " " + " ".join(case.env) for case in CASES)
    missing = [
        opt.flag
        for opt in OPTIONS
        if opt.flag not in _NO_BAD_VALUE and opt.flag not in named and opt.env not in named
    ]
    assert not missing, f"options without a misuse case in tests/glue/test_misuse.py: {missing}"


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries ``mark``: the session's and everything it forked."""
    found = []
    needle = f"SPRITE_TEST_MARK={mark}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle in fh.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_sigterm_during_a_large_local_start_leaves_no_agent(pytester: pytest.Pytester) -> None:
    """A SIGTERM to the controller while it forks a 32-rank world ends every agent forked so far.

    The agents die with the controller (PR_SET_PDEATHSIG); without it, those forked before the signal
    live on. The session is signalled once its first agents exist, while the rest are still being forked.
    """
    pytester.makepyfile(MODULE)
    mark = uuid.uuid4().hex
    env = {**os.environ, "SPRITE_TEST_MARK": mark, "OMP_NUM_THREADS": "1"}
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ranks=32"],
        cwd=pytester.path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        # Three besides the session: at least two agents (a capacity probe fork is one at a time).
        while len([pid for pid in _marked(mark) if pid != session.pid]) < 3:
            assert session.poll() is None and time.monotonic() < deadline, "no agent was forked"
            time.sleep(0.005)
        session.send_signal(signal.SIGTERM)
        session.wait(TIMEOUT)
        deadline = time.monotonic() + 30.0
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _marked(mark) == []
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
        if session.poll() is None:
            session.kill()
            session.wait()
