"""``--launcher=srun`` under a real Slurm (``tests/slurm_cluster.py``): inside ``salloc`` and inside an ``sbatch`` job.

The harness core's launcher scenarios (``tests/engine_scenarios.py``) as a user meets them on a cluster.
``test_launchers.py`` keeps the srun stand-in for what this one-node Slurm cannot show (two nodes' layout with
a recorded command line).
"""

from __future__ import annotations

import sys

import pytest
from engine_scenarios import EXPECTED, EXPECTED_LINES, SCENARIOS, verdicts
from slurm_cluster import SlurmCluster
from sprite_testing import clear_rank_variables

pytestmark = pytest.mark.cpu

TIMEOUT = 420

SESSION = (
    "-m",
    "pytest",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
    "-v",
    "--launcher=srun",
    "--rank-grace=2",
    # a bound on agents starting on 2 loaded cores (60 s was too short at load 20), not a check
    "--connect-timeout=240",
    "--pack=off",
    "test_scenarios.py",
)


def in_slurm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster) -> None:
    """This test's sessions talk to ``slurm`` and start as a process no launcher started."""
    clear_rank_variables(monkeypatch)
    for name, value in slurm.env.items():
        if name.startswith("SLURM_"):
            monkeypatch.setenv(name, value)
    pytester.makepyfile(test_scenarios=SCENARIOS)


def inside_salloc(pytester: pytest.Pytester, ranks: int, *args: str) -> pytest.RunResult:
    """``salloc -n<ranks> python -m pytest --ranks=<ranks> <SESSION> <args>``, as a user types it."""
    script = pytester.path / "session.sh"
    # the job id is known only inside the allocation: the shell hands it to the ranks' check
    script.write_text(f'SPRITE_EXPECTED_JOB=$SLURM_JOB_ID exec {sys.executable} "$@"\n')
    return pytester.run(
        "salloc",
        f"-n{ranks}",
        "--time=5",
        "bash",
        str(script),
        *SESSION,
        f"--ranks={ranks}",
        *args,
        timeout=TIMEOUT,
    )


def test_passing_test_inside_salloc(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    # 2 ranks: half the agents' start of the 4-rank world on CI's 2 cores
    result = inside_salloc(pytester, 2, "-k", "test_passes")
    assert verdicts(result.stdout.str()) == {"test_passes": "PASSED"}, (
        result.stdout.str() + result.stderr.str()
    )
    assert slurm.jobs() == []


@pytest.mark.slow  # 25 s; CI runs the passing test inside salloc, and inside the shipped script's job
def test_scenarios_inside_salloc(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    result = inside_salloc(pytester, 4)
    assert verdicts(result.stdout.str()) == EXPECTED, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines_random(EXPECTED_LINES)
    assert slurm.jobs() == []


@pytest.mark.slow  # 25 s; CI runs the passing test in a job of the shipped sbatch script (test_slurm_scripts.py)
def test_scenarios_inside_sbatch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    in_slurm(pytester, monkeypatch, slurm)
    script = pytester.path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=4\n#SBATCH --time=5\n"
        f"SPRITE_EXPECTED_JOB=$SLURM_JOB_ID exec {sys.executable} {' '.join(SESSION)} --ranks=4\n"
    )
    job = slurm.submit(["--output=job.out", str(script)], cwd=pytester.path)
    ended = slurm.wait_job(job, timeout=TIMEOUT)
    output = (pytester.path / "job.out").read_text()
    assert ended["ExitCode"] == "1:0", output  # pytest's "some tests failed", as the job's exit code
    assert verdicts(output) == EXPECTED, output
    pytest.LineMatcher(output.splitlines()).fnmatch_lines_random(EXPECTED_LINES)
    assert slurm.jobs() == []
