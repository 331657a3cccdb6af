"""``--launcher=mpiexec`` under Open MPI for real: Debian's ``openmpi-bin`` (4.1), as root, more ranks than cores.

The venv's ``mpiexec`` is MPICH's (``pip install mpich``), so the test puts Open MPI's first on PATH under the
plain name ``mpiexec``, as ``module load openmpi`` does: the launcher must tell it is Open MPI from its
``--version`` answer, not from its name. Root needs ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``, and more ranks than cores need ``--launcher-args=--oversubscribe``: what
``docs/reference/launchers.md`` tells a user (CI runs 2 ranks on 2 cores, where ``--oversubscribe`` is only the
proof that the mpiexec is Open MPI's: MPICH's refuses it; the 4-rank scenarios need it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from engine_scenarios import EXPECTED, EXPECTED_LINES, SCENARIOS, verdicts
from slurm_cluster import require
from sprite_testing import clear_rank_variables, run_pytest

from pytest_sprite.launch.launchers.mpiexec import MpiexecLauncher, detect_flavour

pytestmark = pytest.mark.cpu

OPEN_MPI = "/usr/bin/mpiexec.openmpi"
"""Debian's name for Open MPI's mpiexec; the venv's plain ``mpiexec`` is MPICH's."""


@pytest.fixture
def open_mpi_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH whose ``mpiexec`` is Open MPI's, with root allowed; the link's directory."""
    require(
        None
        if os.access(OPEN_MPI, os.X_OK)
        else f"no Open MPI here ({OPEN_MPI}): apt-get install openmpi-bin"
    )
    bin_dir = tmp_path / "openmpi-bin"
    bin_dir.mkdir()
    (bin_dir / "mpiexec").symlink_to(OPEN_MPI)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    if os.geteuid() == 0:
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return bin_dir


def test_open_mpi_is_told_by_its_version_not_its_name(open_mpi_first: Path) -> None:
    mpiexec = shutil.which("mpiexec")
    assert mpiexec == str(open_mpi_first / "mpiexec")
    answer = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, check=True)
    assert detect_flavour(answer.stdout + answer.stderr) == "openmpi", answer.stdout
    # the launcher itself: the program it finds is the link named mpiexec, its flavour Open MPI's
    launcher = MpiexecLauncher()
    launcher.check()
    assert (launcher.program, launcher.flavour) == (mpiexec, "openmpi")


def under_open_mpi(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ranks: int, *args: str
) -> pytest.RunResult:
    clear_rank_variables(monkeypatch)
    pytester.makepyfile(test_scenarios=SCENARIOS)
    return run_pytest(
        pytester,
        "--launcher=mpiexec",
        # Open MPI's own option (MPICH's hydra refuses it): the launch that passes is Open MPI's
        "--launcher-args=--oversubscribe",
        f"--ranks={ranks}",
        # ranks per node are spelled per flavour: Open MPI's --map-by ppr:P:node, MPICH's -ppn P (Open MPI
        # refuses it), none for an unknown mpiexec (a LaunchError): only a launch told Open MPI passes
        f"--ppn={ranks}",
        "--rank-grace=2",
        # a bound on agents starting on 2 loaded cores (60 s was too short at load 20), not a check
        "--connect-timeout=240",
        "--pack=off",
        *args,
        timeout=420,
        flags=("-v",),
    )


def test_passing_test_under_open_mpi(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, open_mpi_first: Path
) -> None:
    # 2 ranks: half the agents' start of the 4-rank world on CI's 2 cores
    result = under_open_mpi(pytester, monkeypatch, 2, "-k", "test_passes")
    assert verdicts(result.stdout.str()) == {"test_passes": "PASSED"}, (
        result.stdout.str() + result.stderr.str()
    )


@pytest.mark.slow  # 30 s; CI runs the passing test
def test_scenarios_under_open_mpi(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, open_mpi_first: Path
) -> None:
    result = under_open_mpi(pytester, monkeypatch, 4)
    assert verdicts(result.stdout.str()) == EXPECTED, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines_random(EXPECTED_LINES)
