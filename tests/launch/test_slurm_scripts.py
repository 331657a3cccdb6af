"""The shipped ``hpc/slurm/sprite.sbatch``, unchanged, as a job of a real Slurm (``tests/slurm_cluster.py``).

The script is written for A100 nodes; CI runs the same file on CPU with the settings a user would change from
the command line (``--gpus-per-node=0 --cpus-per-task=1``, ``SPRITE_DEVICE=cpu``; the test node carries the
script's ``gpu`` feature), so the script the docs hand to users cannot rot. Its job runs the passing test of
``tests/engine_scenarios.py`` through the script's ``SPRITE_K``; every scenario inside an sbatch job is
``test_slurm_real.py::test_scenarios_inside_sbatch`` (``--run-slow``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from engine_scenarios import SCENARIOS
from slurm_cluster import SlurmCluster
from sprite_testing import clear_rank_variables

pytestmark = pytest.mark.cpu

SCRIPT = Path(__file__).parents[2] / "hpc" / "slurm" / "sprite.sbatch"


def test_shipped_sbatch_script_on_cpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, slurm: SlurmCluster
) -> None:
    clear_rank_variables(monkeypatch)
    pytester.makepyfile(test_scenarios=SCENARIOS)
    exports = {
        "SPRITE_DEVICE": "cpu",
        "SPRITE_RANKS_PER_NODE": "2",
        "SPRITE_PYTHON": sys.executable,  # the login shell (#!/bin/bash -l) resets PATH
        "SPRITE_TESTS": "test_scenarios.py",
        "SPRITE_K": "test_passes",
        "PYTEST_ADDOPTS": "-p no:cacheprovider -p no:hypothesispytest --rank-grace=2 --pack=off --connect-timeout=240",
    }
    job = slurm.submit(
        [
            "--gpus-per-node=0",
            "--ntasks-per-node=2",  # 2 ranks: half the agents' start of 4 on CI's 2 cores
            "--cpus-per-task=1",
            "--time=5",
            "--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items()),
            str(SCRIPT),
        ],
        cwd=pytester.path,
    )
    ended = slurm.wait_job(job, timeout=420)
    results = pytester.path / "sprite-results" / job
    output = (results / "pytest.txt").read_text() if (results / "pytest.txt").exists() else ""
    log = (pytester.path / f"sprite-{job}.out").read_text()
    assert ended["ExitCode"] == "0:0", log + output  # pytest's status, through the script's pipefail
    verdicts = {
        name: verdict
        for verdict, name in re.findall(r"^(PASSED|FAILED|ERROR) test_scenarios\.py::(\w+)", output, re.M)
    }
    assert verdicts == {"test_passes": "PASSED"}, output
    assert (results / "junit.xml").exists() and (results / "environment.txt").exists()
    assert f"job {job}: 1 nodes x 2 ranks = 2 ranks" in (results / "environment.txt").read_text()
    assert slurm.jobs() == []
