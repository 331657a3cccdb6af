"""A real MPI launch treated as PALS: two processes, one 2-process job, no self-spawned workers.

Without mpi4py Lightning's MPIEnvironment is off, LightningEnvironment sees no LOCAL_RANK and DDP starts
its own workers: ``mpiexec -n 2`` with ``devices=2`` becomes two independent 2-process jobs (the seed's
Why table). MPICH's hydra stands in for Aurora's PALS here: a shell exports the PALS variables from hydra's
own, and the script hides mpi4py, as on a system without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sprite.env.rank_variables import free_port

pytestmark = pytest.mark.cpu

SCRIPT = """
import os, sys
sys.modules["mpi4py"] = None  # as on a system without mpi4py: Lightning's MPIEnvironment is off
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pytest_sprite.lightning import trainer_kwargs

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(**trainer_kwargs("ddp", devices=2, accelerator="cpu"), max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=sys.argv[1])
trainer.fit(Module(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
env = trainer.strategy.cluster_environment
print(f"RESULT {type(env).__name__} rank={trainer.global_rank} world={trainer.world_size} "
      f"local={env.local_rank()} port={env.main_port}", flush=True)
"""

PALS_FROM_HYDRA = (
    'PALS_RANKID=$PMI_RANK PALS_LOCAL_RANKID=$MPI_LOCALRANKID PALS_LOCAL_SIZE=$MPI_LOCALNRANKS exec "$0" "$@"'
)


def test_mpiexec_with_pals_variables_runs_one_two_process_job(tmp_path: Path) -> None:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec is not on PATH (pip install mpich)")
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PALS_", "MASTER_", "SLURM_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(name, None)
    # A port free now rather than one derived from a fixed PBS_JOBID: concurrent sessions must not collide.
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("PBS_JOBID", None)
    command = [mpiexec, "-n", "2", "sh", "-c", PALS_FROM_HYDRA, sys.executable, str(script), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    # Two ranks share mpiexec's stdout and may interleave their lines: find the records, not lines.
    results = sorted(re.findall(r"RESULT \w+ rank=\d+ world=\d+ local=\d+ port=\d+", done.stdout))
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-3000:]
    port = env["MASTER_PORT"]
    assert results == [
        f"RESULT PALSEnvironment rank=0 world=2 local=0 port={port}",
        f"RESULT PALSEnvironment rank=1 world=2 local=1 port={port}",
    ]
