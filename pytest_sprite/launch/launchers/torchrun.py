"""``--launcher=torchrun``: torch's elastic launcher, on this node.

``python -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=W --no-python <--launcher-args>
env -u <stale> <agent>``:

- ``--standalone`` gives the launch its own rendezvous on a free local port, so two sessions on one node
  (pytest-xdist, two users) never fight over torchrun's default 29500.
- ``--no-python`` because the agent command starts with ``env``, which drops stale rank variables inherited
  from an outer launcher (an sbatch script's SLURM_PROCID=0) before the agent reads its rank.
- One torchrun starts ranks on its own node only; across nodes torchrun itself must be started on every node
  by a job launcher, and that launcher can start the agents directly: use srun, pals or mpiexec there.
- torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset, so test children run single-threaded.
- When one agent dies, torchrun ends the others; the controller starts a fresh launch for the next test.
"""

from __future__ import annotations

import importlib.util
import sys

from ...errors import LaunchError
from ._command import agent_command, has_option, start
from .base import LaunchHandle, LaunchRequest

__all__ = ["TorchrunLauncher", "torchrun_command"]

_MULTI_NODE_OPTIONS = (
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
)


def torchrun_command(request: LaunchRequest, *, python: str = sys.executable) -> list[str]:
    """The torchrun command line for ``request``; raise LaunchError for a layout it cannot start."""
    w = request.world_size
    if request.ppn is not None and request.ppn != w:
        raise LaunchError(
            f"--launcher=torchrun starts every rank on this node, but --ppn={request.ppn} with --ranks={w} asks "
            f"for {-(-w // request.ppn)} nodes. Drop --ppn, or use --launcher=srun, pals or mpiexec across nodes."
        )
    given = [opt for opt in _MULTI_NODE_OPTIONS if has_option(request.launcher_args, opt)]
    if given:
        raise LaunchError(
            f"--launcher-args={' '.join(request.launcher_args)!r} gives torchrun {', '.join(given)}, a multi-node "
            f"rendezvous; one torchrun started here cannot start ranks on other nodes. Use --launcher=srun, pals "
            f"or mpiexec across nodes, or drop those options."
        )
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={w}",
        "--no-python",
        *request.launcher_args,
        *agent_command(request, ("torchrun",)),
    ]


class TorchrunLauncher:
    """Starts the agents as torch elastic workers of one ``torchrun`` on this node."""

    name = "torchrun"
    spans_nodes = False

    def check(self) -> None:
        """torch must be importable by this Python (found without importing it: the controller stays torch-free)."""
        if importlib.util.find_spec("torch") is None:
            raise LaunchError(
                f"--launcher=torchrun needs torch in the Python running pytest ({sys.executable}), and it is not "
                f"installed there: `pip install torch`, or choose --launcher=local or mpiexec."
            )

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        return start(torchrun_command(request), request)
