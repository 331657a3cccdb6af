"""Cluster events under a real Slurm (``tests/slurm_cluster.py``): each a prompt outcome that names its cause.

The job cancelled (``scancel``), out of time, or its node lost (slurmd killed) mid-test: Slurm sends SIGTERM
(for a lost node, once its slurmd is back), the controller stops as on Ctrl-C
(``pytest_sprite/launch/termination.py``), Slurm's own line names the cause, the JUnit file and the
``--sprite-report`` hold the test that had finished, and no process of the job is left. ``srun`` refused (too few tasks in the allocation, no allocation):
the first ranks test fails with srun's own words.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster
from sprite_testing import clear_rank_variables

pytestmark = pytest.mark.cpu

TIMEOUT = 420

EVENT_TESTS = """
import time
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.mark.ranks(2)
def test_first(world):
    dist.barrier()


@pytest.mark.ranks(2)
def test_waits(world):
    if world.rank == 0:
        Path("started").touch()  # the test's cue for the event
    time.sleep(600)
"""

SESSION = (
    "-m",
    "pytest",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
    "-v",
    "--launcher=srun",
    "--ranks=2",
    "--pack=off",
    # a bound on agents starting on 2 loaded cores (60 s was too short at load 20), not a check
    "--connect-timeout=240",
    "--junitxml=junit.xml",
    "--sprite-report=report.json",
    "test_events.py",
)


def in_slurm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster) -> None:
    clear_rank_variables(monkeypatch)
    for name, value in slurm.env.items():
        if name.startswith("SLURM_"):
            monkeypatch.setenv(name, value)
    pytester.makepyfile(test_events=EVENT_TESTS)


def processes_with(tag: str) -> list[int]:
    """PIDs of the processes whose environment holds ``tag`` (everything the job started inherits it)."""
    found = []
    needle = tag.encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # ended meanwhile, or a kernel thread
    return found


def submit_session(pytester: pytest.Pytester, slurm: SlurmCluster, tag: str, *sbatch: str) -> str:
    script = pytester.path / "job.sh"
    script.write_text(f"#!/bin/bash\nexec {sys.executable} {' '.join(SESSION)}\n")
    return slurm.submit(
        ["--ntasks=2", "--output=job.out", f"--export=ALL,SPRITE_EVENT_TAG={tag}", *sbatch, str(script)],
        cwd=pytester.path,
    )


def check_stopped_with_reports(pytester: pytest.Pytester, slurm: SlurmCluster, job: str, tag: str) -> str:
    """The session named SIGTERM, wrote both reports with test_first in them, and left nothing running.

    Slurm shows the job ended (CANCELLED, TIMEOUT, NODE_FAIL) as soon as it signals it, while the session
    still stops and writes its reports: the output is read once the job's last process has gone.
    """
    slurm.wait_until(lambda: not processes_with(tag), f"no process of job {job} left", timeout=TIMEOUT)
    output = (pytester.path / "job.out").read_text()
    assert "pytest-sprite: the session got SIGTERM" in output, output
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="test_first"' in junit, junit
    report = json.loads((pytester.path / "report.json").read_text())
    assert "test_events.py::test_first" in json.dumps(report), report
    return output


def test_scancel_mid_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    tag = uuid.uuid4().hex
    job = submit_session(pytester, slurm, tag, "--time=5")
    started = pytester.path / "started"

    def started_or_ended() -> bool:
        return started.exists() or slurm.job_fields(job).get("JobState") not in ("PENDING", "RUNNING")

    slurm.wait_until(started_or_ended, "test_waits started", timeout=TIMEOUT)
    assert started.exists(), (pytester.path / "job.out").read_text()
    slurm.run(["scancel", job])
    ended = slurm.wait_job(job, timeout=TIMEOUT)
    assert ended["JobState"] == "CANCELLED", ended
    output = check_stopped_with_reports(pytester, slurm, job, tag)
    assert f"*** JOB {job} ON" in output and "CANCELLED AT" in output, output


@pytest.mark.slow  # 60-90 s: Slurm's shortest time limit is a minute
def test_time_limit_mid_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    tag = uuid.uuid4().hex
    job = submit_session(pytester, slurm, tag, "--time=1")
    ended = slurm.wait_job(job, timeout=300)
    assert ended["JobState"] == "TIMEOUT", ended
    output = check_stopped_with_reports(pytester, slurm, job, tag)
    assert "DUE TO TIME LIMIT" in output, output


@pytest.mark.slow  # 90 s: the node is marked down 10-30 s after its slurmd is lost (SlurmdTimeout=10)
def test_node_lost_mid_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    tag = uuid.uuid4().hex
    # a batch job is requeued on a node's failure by default; a test session must not run twice
    job = submit_session(pytester, slurm, tag, "--time=5", "--no-requeue")
    started = pytester.path / "started"

    def started_or_ended() -> bool:
        return started.exists() or slurm.job_fields(job).get("JobState") not in ("PENDING", "RUNNING")

    slurm.wait_until(started_or_ended, "test_waits started", timeout=TIMEOUT)
    assert started.exists(), (pytester.path / "job.out").read_text()
    slurm.kill_slurmd()
    try:
        ended = slurm.wait_job(job, timeout=TIMEOUT)
        assert ended["JobState"] == "NODE_FAIL", ended
    finally:
        slurm.restart_slurmd()
    # the restarted slurmd ends the failed job's batch step with SIGTERM: the session stops with its reports
    output = check_stopped_with_reports(pytester, slurm, job, tag)
    assert "DUE TO NODE FAILURE" in output, output


def check_refusal_reported(pytester: pytest.Pytester) -> None:
    """Both reports were written, each with the ranks test that the refused launch could not run."""
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="test_four"' in junit, junit
    report = json.loads((pytester.path / "report.json").read_text())
    outcomes = {test["nodeid"]: test["outcome"] for test in report["tests"]}
    assert outcomes == {"test_one.py::test_four": "error"}, report


ONE_TEST = """
import pytest

@pytest.mark.ranks(4)
def test_four(world):
    pass
"""


def test_srun_refuses_more_tasks_than_the_allocation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    pytester.makepyfile(test_one=ONE_TEST)
    result = pytester.run(
        "salloc",
        "-n2",
        "--time=5",
        sys.executable,
        *SESSION[:-1],
        "--ranks=4",
        "test_one.py",
        timeout=TIMEOUT,
    )
    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, output
    result.stdout.fnmatch_lines(
        [
            "*--launcher=srun: the launch ended with status 1 before all 4 agents connected (0 did). Its output:*",
            "*srun: error: Unable to create step for job *: More processors requested than permitted*",
        ]
    )
    check_refusal_reported(pytester)
    assert slurm.jobs() == []


def test_srun_outside_an_allocation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    pytester.makepyfile(test_one=ONE_TEST)
    result = pytester.run(sys.executable, *SESSION[:-1], "--ranks=4", "test_one.py", timeout=TIMEOUT)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["*--launcher=srun: this pytest is not inside a Slurm allocation (SLURM_JOB_ID is not set)*"]
    )
    check_refusal_reported(pytester)
