"""``--launcher=pals``: Aurora's PALS ``mpiexec`` inside a PBS job.

``mpiexec -n W --ppn P --cpu-bind none --env WORLD_SIZE=W <--launcher-args> env -u <stale> <agent>``:

- PALS exports PALS_RANKID / PALS_LOCAL_RANKID / PMIX_RANK but no world size, so WORLD_SIZE goes with
  ``--env`` (the agents would otherwise need mpi4py, and with it MPI_Init, just to learn a number).
- ``--ppn`` defaults to the allocation: ceil(W / nodes in PBS_NODEFILE), 12 for 24 ranks on 2 nodes.
- ``--cpu-bind none`` unless ``--launcher-args`` gives a binding: a test child sizes its thread pool as
  cores / local ranks over the whole node, which a narrower binding would oversubscribe.
- Every rank sees all tiles and selects ``xpu:<local rank>``; no per-rank ZE_AFFINITY_MASK is set.
- PALS passes the controller's whole environment to the ranks (its default ``--envall``), which is how
  SPRITE_TOKEN reaches them without appearing on a command line.
"""

from __future__ import annotations

import math
import os

from ...env.rank_variables import hosts_in_nodefile
from ...errors import RankEnvError
from ._command import ProgramLauncher, agent_command, has_option
from .base import LaunchRequest

__all__ = ["PalsLauncher", "default_ppn", "pals_command"]

HOW_TO_GET = (
    "On Aurora, run pytest inside a PBS job (`qsub -I -l select=2 ...` or a job script), where PALS's "
    "`mpiexec` is on PATH; elsewhere use --launcher=mpiexec, srun or torchrun."
)


def default_ppn(world_size: int, environ: dict[str, str] | None = None) -> int:
    """Ranks per node from the PBS allocation: ceil(W / nodes in PBS_NODEFILE), W without a node file."""
    env = os.environ if environ is None else environ
    nodefile = env.get("PBS_NODEFILE", "").strip()
    nodes = _nodes_in_nodefile(nodefile) if nodefile else None
    return math.ceil(world_size / nodes) if nodes else world_size


def _nodes_in_nodefile(path: str) -> int | None:
    """Number of distinct hosts in a PBS node file, None when it cannot be read or lists none."""
    try:
        return len(hosts_in_nodefile(path)) or None
    except RankEnvError:
        return None


def pals_command(request: LaunchRequest, *, program: str, ppn: int) -> list[str]:
    """The PALS mpiexec command line for ``request`` with ``ppn`` ranks per node."""
    w = request.world_size
    extra = request.launcher_args
    argv = [program, "-n", str(w)]
    if not has_option(extra, "--ppn", "-ppn"):
        argv += ["--ppn", str(ppn)]
    if not has_option(extra, "--cpu-bind"):
        argv += ["--cpu-bind", "none"]
    argv += ["--env", f"WORLD_SIZE={w}", *extra]
    argv += agent_command(request, ("PALS", "PMIx", "MPICH hydra"), keep=("WORLD_SIZE",))
    return argv


class PalsLauncher(ProgramLauncher):
    """Starts the agents with PALS ``mpiexec`` across the nodes of the PBS job."""

    name = "pals"
    program_name = "mpiexec"
    how_to_get = HOW_TO_GET

    job_variable = "PBS_JOBID"
    """Outside a job, ``mpiexec`` is some other MPI's (MPICH's hydra refuses ``--cpu-bind``), so the
    launch would fail with that launcher's own words once per try."""
    outside_job = (
        "--launcher=pals: this pytest is not inside a PBS job (PBS_JOBID is not set), and PALS's mpiexec "
        "runs only there. Run pytest in a job: `qsub -I -l select=1 -l walltime=1:00:00` then pytest, "
        "or a job script (hpc/aurora); elsewhere use --launcher=mpiexec, srun or torchrun."
    )

    def command(self, request: LaunchRequest, program: str) -> list[str]:
        ppn = request.ppn if request.ppn is not None else default_ppn(request.world_size)
        return pals_command(request, program=program, ppn=ppn)
