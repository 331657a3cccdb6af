"""``--launcher=mpiexec``: MPICH (hydra, also Intel MPI) or Open MPI ``mpiexec -n W``.

The flavour is read once from ``mpiexec --version``, because the two spell ranks per node and environment
export differently: MPICH's hydra passes the whole environment and takes ``-ppn P``; Open MPI passes only
what ``-x NAME`` names to other nodes and takes ``--map-by ppr:P:node``. An ``mpiexec`` of another kind
(PALS on Aurora, say) gets the plain ``-n W`` that every mpiexec accepts; use ``--launcher=pals`` there.
"""

from __future__ import annotations

import subprocess
from typing import Literal

from ...errors import LaunchError
from ._command import ProgramLauncher, agent_command, has_option
from .base import LaunchRequest

__all__ = ["MpiexecLauncher", "detect_flavour", "mpiexec_command"]

Flavour = Literal["mpich", "openmpi", "unknown"]

HOW_TO_GET = (
    "Install MPICH's (it comes beside mpi4py): `pip install mpich`, or load your site's MPI module "
    "(`module load mpich` or `module load openmpi`), then check `mpiexec --version`."
)

# Rank-variable families each flavour sets (see pytest_sprite.env.rank_variables.LAUNCHER_VARIABLES).
_OWNED: dict[Flavour, tuple[str, ...]] = {
    "mpich": ("MPICH hydra",),
    "openmpi": ("Open MPI", "PMIx"),
    "unknown": ("MPICH hydra", "Open MPI", "PMIx", "PALS"),
}


def detect_flavour(version_output: str) -> Flavour:
    """Flavour from ``mpiexec --version`` output (hydra and Intel MPI are MPICH; ORTE/PRRTE are Open MPI)."""
    text = version_output.lower()
    if "open mpi" in text or "openrte" in text or "prrte" in text or "open-mpi" in text:
        return "openmpi"
    if "hydra" in text or "intel(r) mpi" in text or "mpich" in text or "mvapich" in text:
        return "mpich"
    return "unknown"


def mpiexec_command(request: LaunchRequest, *, program: str, flavour: Flavour) -> list[str]:
    """``mpiexec -n W [ranks per node] [env exports] <--launcher-args> env -u <stale> <agent>``."""
    argv = [program, "-n", str(request.world_size)]
    extra = request.launcher_args
    if flavour == "mpich":
        if request.ppn is not None and not has_option(extra, "-ppn", "--ppn", "-perhost"):
            argv += ["-ppn", str(request.ppn)]
    elif flavour == "openmpi":
        if request.ppn is not None and not has_option(extra, "--map-by", "-N", "--npernode"):
            argv += ["--map-by", f"ppr:{request.ppn}:node"]
        for name in request.env:
            argv += ["-x", name]  # value comes from mpiexec's own environment, not the command line
    elif request.ppn is not None:
        raise LaunchError(
            f"--launcher=mpiexec: --ppn={request.ppn} was given, but `{program}` is neither MPICH nor Open MPI "
            f"(its --version names neither), so the ranks-per-node option is unknown. Pass the option "
            f"yourself with --launcher-args (and drop --ppn), or use --launcher=pals on Aurora."
        )
    argv += extra
    argv += agent_command(request, _OWNED[flavour])
    return argv


class MpiexecLauncher(ProgramLauncher):
    """Starts the agents with ``mpiexec``: one launch for the session, on the nodes of the job."""

    name = "mpiexec"
    how_to_get = HOW_TO_GET

    def __init__(self) -> None:
        super().__init__()
        self.flavour: Flavour = "unknown"

    def check(self) -> None:
        """Find ``mpiexec`` and read its flavour; a missing one is a LaunchError saying how to get it."""
        super().check()
        assert self.program is not None
        try:
            probe = subprocess.run(
                [self.program, "--version"],
                capture_output=True,
                text=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(
                f"--launcher=mpiexec: `{self.program} --version` failed ({exc}); check the MPI installation. "
                f"{HOW_TO_GET}"
            ) from exc
        self.flavour = detect_flavour(probe.stdout + probe.stderr)

    def command(self, request: LaunchRequest, program: str) -> list[str]:
        return mpiexec_command(request, program=program, flavour=self.flavour)
