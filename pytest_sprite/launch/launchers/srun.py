"""``--launcher=srun``: Slurm's ``srun``, inside an allocation (``salloc`` shell or ``sbatch`` script).

``srun --ntasks=W --nodes=N --ntasks-per-node=P --kill-on-bad-exit=1 --export=ALL <--launcher-args> env -u
<stale> <agent>``:

- ``--ppn`` defaults to the allocation: ceil(W / SLURM_JOB_NUM_NODES), so 8 ranks in a 2-node job are 4 a node.
- ``--export=ALL``: sites that submit with ``--export=NONE`` leave SLURM_EXPORT_ENV=NONE behind, which srun
  would inherit and which would keep SPRITE_TOKEN from the agents.
- ``--kill-on-bad-exit=1``: an agent that dies takes the step down, so the controller sees the launch end
  and starts a fresh one for the next test instead of waiting on a half-dead world.
- Every rank sees all GPUs of its node and selects ``cuda:<local rank>``; no per-task GPU binding is asked.
- Inside an interactive ``srun --pty`` step, add ``--launcher-args=--overlap`` (Slurm 20.11+).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from ...errors import LaunchError
from ._command import ProgramLauncher, agent_command, has_option
from .base import LaunchRequest

__all__ = ["SrunLauncher", "srun_command"]

HOW_TO_GET = (
    "srun comes with Slurm: run pytest on a Slurm cluster, or use --launcher=mpiexec or torchrun elsewhere."
)


def _allocation_nodes(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        raw = environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return None


def srun_command(request: LaunchRequest, *, program: str, environ: Mapping[str, str]) -> list[str]:
    """The srun command line for ``request`` inside the allocation described by ``environ``."""
    w = request.world_size
    extra = request.launcher_args
    ppn = request.ppn
    if ppn is None:
        nodes = _allocation_nodes(environ)
        ppn = math.ceil(w / min(nodes, w)) if nodes else None
    argv = [program, f"--ntasks={w}"]
    if ppn is not None:
        if not has_option(extra, "--nodes", "-N"):
            argv.append(f"--nodes={math.ceil(w / ppn)}")
        if not has_option(extra, "--ntasks-per-node"):
            argv.append(f"--ntasks-per-node={ppn}")
    if not has_option(extra, "--kill-on-bad-exit", "-K"):
        argv.append("--kill-on-bad-exit=1")
    if not has_option(extra, "--export"):
        argv.append("--export=ALL")
    return [*argv, *extra, *agent_command(request, ("Slurm", "PMIx", "MPICH hydra"))]


class SrunLauncher(ProgramLauncher):
    """Starts the agents as one Slurm job step across the allocation's nodes."""

    name = "srun"
    how_to_get = HOW_TO_GET

    def check(self) -> None:
        """Require ``srun`` on PATH and an allocation (SLURM_JOB_ID), each with a LaunchError saying how."""
        super().check()
        if not os.environ.get("SLURM_JOB_ID", "").strip():
            raise LaunchError(
                "--launcher=srun: this pytest is not inside a Slurm allocation (SLURM_JOB_ID is not set), and srun "
                "would queue a new job for every session. Run pytest in an allocation: `salloc -N 1 --ntasks=4` "
                "then pytest, or an sbatch script (hpc/slurm/sprite.sbatch); outside Slurm use "
                "--launcher=mpiexec or --launcher=torchrun."
            )

    def command(self, request: LaunchRequest, program: str) -> list[str]:
        return srun_command(request, program=program, environ=os.environ)
