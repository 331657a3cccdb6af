"""``--launcher=srun``: Slurm's ``srun``, inside an allocation (``salloc`` shell or ``sbatch`` script).

``srun --ntasks=W --nodes=N --ntasks-per-node=P --kill-on-bad-exit=1 --export=ALL <--launcher-args> env -u
<stale> <agent>``:

- ``--ppn`` defaults to the allocation: ceil(W / SLURM_JOB_NUM_NODES), so 8 ranks in a 2-node job are 4 a node.
- srun lays a step out within the allocation's tasks on each node (SLURM_TASKS_PER_NODE) and silently
  ignores a ``--ntasks-per-node`` they cannot hold: ``salloc -N2 -n4`` on shared nodes (``select/cons_tres``)
  may allocate 3 + 1 tasks, and a step of 4 at 2 a node then runs 3 + 1 all the same. So the default asks
  for no per-node layout where the allocation cannot hold it (the ranks follow the allocation, and the
  controller places them by their real nodes), and a ``--ppn`` it cannot hold is a LaunchError naming the
  allocation to ask for.
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
import re
from collections.abc import Mapping, Sequence

from ...errors import LaunchError
from ._command import ProgramLauncher, agent_command, has_option
from .base import LaunchRequest

__all__ = ["SrunLauncher", "allocation_tasks", "srun_command"]

HOW_TO_GET = (
    "srun comes with Slurm: run pytest on a Slurm cluster, or use --launcher=mpiexec or torchrun elsewhere."
)


def _allocation_nodes(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        raw = environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return None


def allocation_tasks(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """The allocation's tasks on each of its nodes, from SLURM_TASKS_PER_NODE in Slurm's compressed form
    (``3,1``, ``2(x2)``, ``4(x2),2``); None when it is unset or not in that form."""
    raw = environ.get("SLURM_TASKS_PER_NODE", "").strip()
    counts: list[int] = []
    for part in raw.split(",") if raw else ():
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    return tuple(counts) or None


def _holds(tasks: Sequence[int], world: int, ppn: int) -> bool:
    """True when nodes with ``tasks`` each can run ``world`` ranks at ``ppn`` a node (the last node the rest)."""
    nodes = math.ceil(world / ppn)
    wanted = [ppn] * (nodes - 1) + [world - ppn * (nodes - 1)]
    have = sorted(tasks, reverse=True)[:nodes]
    return len(have) == nodes and all(h >= w for h, w in zip(have, wanted, strict=True))


def _check_ppn_fits(world: int, ppn: int, tasks: Sequence[int], environ: Mapping[str, str]) -> None:
    """A LaunchError when the allocation cannot hold ``ppn`` ranks a node: srun would lay them out otherwise."""
    if sum(tasks) < world or _holds(tasks, world, ppn):
        return  # too few tasks in all: srun refuses the step itself, in its own words
    nodes = math.ceil(world / ppn)
    raise LaunchError(
        f"--launcher=srun: --ppn={ppn} asks for {world} ranks at {ppn} a node on {nodes} nodes, but this "
        f"allocation has {'+'.join(map(str, tasks))} tasks on its nodes "
        f"(SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']}), and srun lays a step out within them, "
        f"not at {ppn} a node. Allocate {ppn} tasks a node (salloc -N{nodes} --ntasks-per-node={ppn}, or "
        f"#SBATCH --ntasks-per-node={ppn}), or drop --ppn to follow the allocation's layout."
    )


def srun_command(request: LaunchRequest, *, program: str, environ: Mapping[str, str]) -> list[str]:
    """The srun command line for ``request`` inside the allocation described by ``environ``."""
    w = request.world_size
    extra = request.launcher_args
    ppn = request.ppn
    tasks = allocation_tasks(environ)
    laid_out_by_user = has_option(extra, "--ntasks-per-node", "--nodes", "-N", "--distribution", "-m")
    if ppn is None:
        nodes = _allocation_nodes(environ)
        ppn = math.ceil(w / min(nodes, w)) if nodes else None
        if ppn is not None and tasks is not None and sum(tasks) >= w and not _holds(tasks, w, ppn):
            ppn = None  # the allocation is uneven (3+1): ask srun for no layout it would not give
    elif tasks is not None and not laid_out_by_user:
        _check_ppn_fits(w, ppn, tasks, environ)
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

    job_variable = "SLURM_JOB_ID"
    """Outside an allocation, srun would queue a new job for every session."""
    outside_job = (
        "--launcher=srun: this pytest is not inside a Slurm allocation (SLURM_JOB_ID is not set), and srun "
        "would queue a new job for every session. Run pytest in an allocation: `salloc -N 1 --ntasks=4` "
        "then pytest, or an sbatch script (hpc/slurm/sprite.sbatch); outside Slurm use "
        "--launcher=mpiexec or --launcher=torchrun."
    )

    def command(self, request: LaunchRequest, program: str) -> list[str]:
        return srun_command(request, program=program, environ=os.environ)
