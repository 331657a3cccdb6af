"""The recipe on real ranks: xpu_mesh spans the test's ranks; records are identical on every rank and only
rank 0 writes them under --sprite-artifacts.

Only ranks tests live here: a module mixing in-process and ranks tests would leave its in-process setup to
the harness's teardown of a ranks item.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
# Loaded at collection so forked test children inherit them (see test_parity_ranks.py).
import lightning.pytorch  # noqa: F401
import peft  # noqa: F401
import torch
import torch.distributed as dist
import transformers  # noqa: F401

from pytest_sprite import LoraQwen, load_arm_record, tensor_digest
from pytest_sprite.recipes.artifacts import ArtifactDir

pytestmark = pytest.mark.cpu


@pytest.mark.ranks(2)
def test_xpu_mesh_spans_the_ranks_of_the_test(world: Any, xpu_mesh: Any) -> None:
    assert xpu_mesh.device_type == world.device.type == "cpu"
    assert xpu_mesh.mesh_dim_names == ("data_parallel",) and xpu_mesh.size() == world.size
    x = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(x, group=xpu_mesh.get_group())
    assert x.item() == sum(range(1, world.size + 1))


@pytest.mark.ranks(2)
def test_records_are_identical_on_every_rank_and_written_once(world: Any, tmp_path: Path) -> None:
    root = Path(world.broadcast_object(str(tmp_path)))
    recipe = LoraQwen(world=world, artifacts=ArtifactDir.for_test(root, "t"))
    records = [recipe.run("single", steps=2), recipe.run("ddp", steps=2)]
    for rec in records:
        summary = json.dumps(rec.summary(), sort_keys=True)
        tensors = [tensor_digest(rec.final_trainable[n]) for n in rec.trainable_names]
        assert len(set(world.gather_object((summary, tuple(tensors))))) == 1
    assert records[1].rows_seen[0] == ((0, 2), (1, 3))
    world.barrier()
    if world.rank == 0:
        assert sorted(p.name for p in (root / "t").iterdir()) == ["01-single", "02-ddp"]
        assert load_arm_record(root / "t" / "02-ddp").summary() == records[1].summary()
