"""Real fits on CPU ranks with gloo: single, ddp and fsdp train, agree, shard, clip, refuse and checkpoint.

Every distributed fit here runs inside a ranks test, whose processes already have the default process group
and the torchrun variables; ``trainer_kwargs(..., accelerator="cpu")`` must use them as they are. Training
data order is controlled as the seed's Pitfalls say: ``use_distributed_sampler=False`` and our own
``DistributedSampler(shuffle=False)``, so rank r's step k sees rows that, over all ranks, are exactly the
one-device run's step-k batch, and the distributed arms can be compared with the one-device reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pytest_sprite.errors import RankEnvError, SpriteUsageError
from pytest_sprite.lightning import FSDP2Strategy, XPUDDPStrategy, shard_model, trainer_kwargs

ROWS = 32
PER_RANK_BATCH = 4
WIDTH = 8


@pytest.fixture(autouse=True)
def cpu_fits_need_a_cpu_world(request: pytest.FixtureRequest) -> None:
    """The cpu tests fit with accelerator="cpu" and need the harness's gloo world, not an XPU/CUDA one."""
    if request.node.get_closest_marker("cpu") is None or "world" not in request.fixturenames:
        return
    device = request.getfixturevalue("world").device
    if device.type != "cpu":
        pytest.skip(
            f"CPU fits need the harness's CPU world (gloo), this one computes on {device}; "
            f"run them with --sprite-device=cpu"
        )


# -------------------------------------------------------------------------------------------------------
# model and data


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Backbone(nn.Module):
    _no_split_modules = ["Block"]  # as a Hugging Face PreTrainedModel declares its decoder layer

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Net(Backbone):
    """Backbone plus a 2-class head: the whole trainable model, sharded as one unit under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


class Classifier(L.LightningModule):
    def __init__(
        self, *, seed: int = 0, lr: float = 0.5, adamw: bool = False, freeze_first: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = Net()
        self.lr, self.adamw = lr, adamw
        self.configured = 0
        self.steps = 0
        if freeze_first:  # LoRA-like: the optimizer holds only the trainable parameters
            self.net.blocks[0].requires_grad_(False)

    def configure_model(self) -> None:
        self.configured += 1
        if self._device_mesh is not None:
            shard_model(self.net, self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.adamw:
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        return torch.optim.SGD(params, lr=self.lr)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, WIDTH, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def loader(kind: str, world_size: int, rank: int) -> DataLoader:
    """One-device batches of world x 4 rows, or each rank's 4 rows of the same global batch."""
    data = dataset()
    if kind == "single":
        return DataLoader(data, batch_size=PER_RANK_BATCH * world_size, shuffle=False)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=PER_RANK_BATCH, sampler=sampler)


def make_trainer(
    kind: str,
    world_size: int,
    root: Path,
    *,
    accelerator: str = "cpu",
    local_size: int | None = None,
    strategy: Any = None,
    precision: str = "32-true",
    **trainer_args: Any,
) -> L.Trainer:
    devices = 1 if kind == "single" else (local_size or world_size)
    kwargs = trainer_kwargs(
        kind,  # type: ignore[arg-type]
        devices=devices,
        num_nodes=1 if kind == "single" else world_size // devices,
        precision=precision,
        accelerator=accelerator,  # type: ignore[arg-type]
    )
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer_args.setdefault("max_epochs", 1)
    return L.Trainer(
        **kwargs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **trainer_args,
    )


def fit(kind: str, module: Classifier, world: Any, root: Path, **kwargs: Any) -> L.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    if kwargs.get("accelerator", "cpu") != "cpu":
        kwargs["local_size"] = world.local_size
    trainer = make_trainer(kind, world.size, root, **kwargs)
    trainer.fit(module, loader(kind, world.size, world.rank), ckpt_path=ckpt_path)
    return trainer


# -------------------------------------------------------------------------------------------------------
# what the tests read back


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (all-gathered if sharded: every rank must call this in the same order)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().cpu().clone()


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in module.named_parameters()}


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter with its optimizer state, whole, by name."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in module.named_parameters():
        entry = {"param": full(p)}
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                entry[key] = full(value)
        out[name] = entry
    return out


def loss_on_all_rows(params: dict[str, torch.Tensor]) -> float:
    net = Net()
    net.load_state_dict({name.removeprefix("net."): value for name, value in params.items()})
    x, y = dataset().tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(net(x), y))


def assert_bitwise_equal(got: Any, expected: Any, what: str) -> None:
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), f"{what}: keys differ"
        for key in expected:
            assert_bitwise_equal(got[key], expected[key], f"{what}[{key}]")
    else:
        assert torch.equal(got, expected), f"{what}: not bit-for-bit equal"


class OnTrainStart(L.Callback):
    """Run a function when training starts: after any checkpoint restore, before the first step."""

    def __init__(self, fn: Callable[[L.Trainer, L.LightningModule], None]) -> None:
        self.fn = fn

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fn(trainer, pl_module)


# -------------------------------------------------------------------------------------------------------
# fits


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_a_trainer_takes_torchrun_s_environment_without_initializing_mpi(world: Any, tmp_path: Path) -> None:
    """The harness sets torchrun's variables, TORCHELASTIC_RUN_ID included, in every rank it starts.

    Lightning then takes TorchElasticEnvironment at once. Without the run id its detection fell through to
    MPIEnvironment, whose ``import mpi4py.MPI`` initialized MPI in every Trainer (0.3-0.8 s each here).
    """
    had_mpi = "mpi4py.MPI" in sys.modules  # an mpiexec-launched agent may have loaded it for its own rank
    trainer = L.Trainer(
        **trainer_kwargs("ddp", devices=world.size, precision="32-true", accelerator="cpu"),
        logger=False,
        default_root_dir=tmp_path,
    )
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, TorchElasticEnvironment)
    assert (environment.world_size(), environment.global_rank()) == (world.size, world.rank)
    assert had_mpi or "mpi4py.MPI" not in sys.modules


@pytest.mark.cpu
@pytest.mark.ranks([2, 4])
def test_ddp_trains_keeps_replicas_bitwise_equal_and_matches_one_device(world: Any, tmp_path: Path) -> None:
    before = loss_on_all_rows(full_params(Classifier()))
    reference = Classifier()
    fit("single", reference, world, tmp_path / "single")
    module = Classifier()
    trainer = fit("ddp", module, world, tmp_path / "ddp")

    assert isinstance(trainer.strategy, XPUDDPStrategy)
    assert (trainer.world_size, trainer.global_rank) == (world.size, world.rank)
    # The harness's process group and exports are used as they are and survive the fit (Lightning's
    # LightningEnvironment.teardown would drop WORLD_SIZE).
    assert dist.is_initialized() and dist.get_world_size() == world.size
    assert os.environ["WORLD_SIZE"] == str(world.size) and os.environ["LOCAL_RANK"] == str(world.local_rank)
    assert module.steps == ROWS // (PER_RANK_BATCH * world.size)
    params = full_params(module)
    for rank, replica in enumerate(world.gather_object(params)):
        assert_bitwise_equal(replica, params, f"rank {rank} vs rank {world.rank}")
    torch.testing.assert_close(params, full_params(reference), rtol=1e-5, atol=1e-6)
    assert loss_on_all_rows(params) < before


@pytest.mark.cpu
@pytest.mark.ranks([2, 4])
def test_fsdp_shards_every_parameter_and_matches_one_device(world: Any, tmp_path: Path) -> None:
    before = loss_on_all_rows(full_params(Classifier()))
    reference = Classifier()
    fit("single", reference, world, tmp_path / "single")
    module = Classifier()
    trainer = fit("fsdp", module, world, tmp_path / "fsdp")

    assert isinstance(trainer.strategy, FSDP2Strategy)
    assert trainer.strategy.device_mesh["data_parallel"].size() == world.size  # one node shards too
    for name, p in module.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.placements == (Shard(0),) and p.device_mesh.size() == world.size, name
    weight = module.net.blocks[0].lin.weight
    assert weight.to_local().shape[0] == WIDTH // world.size
    params = full_params(module)
    torch.testing.assert_close(params, full_params(reference), rtol=1e-5, atol=1e-6)
    assert loss_on_all_rows(params) < before

    # Lightning calls configure_model again for validate: shard_model must leave the sharded model alone
    # (fully_shard twice raises "can only be applied to a module once").
    (metrics,) = trainer.validate(module, loader("single", world.size, world.rank), verbose=False)
    assert module.configured == 2
    assert_bitwise_equal(full_params(module), params, "parameters after validate")
    assert metrics["val_loss"] == pytest.approx(loss_on_all_rows(params), rel=1e-5)


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_fsdp_clips_by_the_global_norm_of_the_sharded_gradients(world: Any, tmp_path: Path) -> None:
    clip = 0.01
    norms: list[float] = []

    class PreClipNorm(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            grads = [full(p.grad) for p in pl_module.parameters()]
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))

    def one_clipped_step(kind: str, module: Classifier) -> dict[str, torch.Tensor]:
        before = full_params(module)
        fit(
            kind,
            module,
            world,
            tmp_path / kind,
            limit_train_batches=1,
            gradient_clip_val=clip,
            callbacks=[PreClipNorm()],
        )
        after = full_params(module)
        return {name: after[name] - before[name] for name in before}

    reference = one_clipped_step("single", Classifier(lr=1.0))
    update = one_clipped_step("fsdp", Classifier(lr=1.0))

    assert norms[1] == pytest.approx(norms[0], rel=1e-5) and norms[1] > 10 * clip
    total = float(torch.linalg.vector_norm(torch.cat([u.flatten() for u in update.values()])))
    # SGD with lr=1: the update is the clipped gradient, whose *global* norm is the clip value
    # (clipping each shard by its own norm would give sqrt(2) x clip here).
    assert total == pytest.approx(clip, rel=1e-4)
    torch.testing.assert_close(update, reference, rtol=1e-4, atol=1e-7)


class HeadOutside(Classifier):
    """A task head beside the backbone that configure_model shards: its gradients would stay per-rank."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Backbone()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_fsdp_refuses_a_trainable_head_outside_fully_shard_before_the_first_step(
    world: Any, tmp_path: Path
) -> None:
    module = HeadOutside()
    with pytest.raises(SpriteUsageError) as info:
        fit("fsdp", module, world, tmp_path / "loose")
    assert str(info.value) == (
        "FSDP2Strategy: 2 trainable parameter(s) are not managed by any fully_shard module, so their "
        "gradients would never be averaged across the 2 ranks: head.weight, head.bias. Put every trainable "
        "module, including any task head, inside the module you pass to shard_model() in configure_model "
        "(or fully_shard it yourself), or freeze it with requires_grad_(False). Being a DTensor is not "
        "enough: tensor parallelism alone also produces DTensors."
    )
    assert module.steps == 0

    frozen = HeadOutside()
    frozen.head.requires_grad_(False)
    fit("fsdp", frozen, world, tmp_path / "frozen", limit_train_batches=1)
    assert frozen.steps == 1


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_bf16_mixed_runs_linear_layers_in_bf16_under_ddp_and_fsdp(world: Any, tmp_path: Path) -> None:
    for kind in ("ddp", "fsdp"):
        module = Classifier()
        dtypes: set[torch.dtype] = set()

        def record(mod: nn.Module, args: Any, out: torch.Tensor, seen: set[torch.dtype] = dtypes) -> None:
            seen.add(out.dtype)

        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                sub.register_forward_hook(record)
        fit(kind, module, world, tmp_path / kind, precision="bf16-mixed", limit_train_batches=2)
        assert dtypes == {torch.bfloat16}, kind
        assert all(p.dtype == torch.float32 for p in module.parameters()), kind


@pytest.mark.cpu
@pytest.mark.ranks(4)
def test_a_trainer_that_disagrees_with_the_launch_is_refused_before_fitting(
    world: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for kind, name in (("ddp", "XPUDDPStrategy"), ("fsdp", "FSDP2Strategy")):
        with pytest.raises(SpriteUsageError) as info:
            make_trainer(kind, 2, tmp_path)
        assert str(info.value) == (
            f"{name}: Trainer(devices=2, num_nodes=1) expects 2 x 1 = 2 processes, but 4 were launched (size "
            f"of the already initialized default process group). Set devices to the processes per node and "
            f"num_nodes to the node count, or launch 2 processes."
        )
    # Right count, wrong node: LightningEnvironment (a launch without torchrun's TORCHELASTIC_RUN_ID) would
    # compute rank 4 + local rank from NODE_RANK and train a mislabelled world.
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(
        RankEnvError, match=rf"the initialized process group has this process as rank {world.rank}"
    ):
        make_trainer("ddp", 4, tmp_path, strategy=XPUDDPStrategy(cluster_environment=LightningEnvironment()))


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_shard_model_shards_each_decoder_layer_of_a_peft_model_then_the_root(world: Any) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=64,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(transformers.Qwen2Model(config), lora)
    mesh = init_device_mesh("cpu", (world.size,), mesh_dim_names=("data_parallel",))

    assert shard_model(model, mesh) is model
    layers = [m for m in model.modules() if "Qwen2DecoderLayer" in type(m).__name__]
    assert len(layers) == 2 and all(isinstance(layer, FSDPModule) for layer in layers)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    assert shard_model(model, mesh) is model  # configure_model again: left alone

    out = model(input_ids=torch.arange(8).reshape(1, 8)).last_hidden_state
    out.float().pow(2).mean().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(isinstance(p.grad, DTensor) for p in trainable)


@pytest.mark.xpu
@pytest.mark.ranks(2)
def test_the_same_fits_on_xpu_tiles(world: Any, tmp_path: Path) -> None:
    """On real tiles (not run in CI): one device, DDP and FSDP2 agree, and bf16-mixed is bf16 on XPU."""
    if world.device.type != "xpu":
        pytest.skip(f"needs the harness on XPU tiles (xccl); this world computes on {world.device}")
    reference = Classifier()
    fit("single", reference, world, tmp_path / "single", accelerator="xpu")
    expected = full_params(reference)
    for kind in ("ddp", "fsdp"):
        module = Classifier()
        trainer = fit(kind, module, world, tmp_path / kind, accelerator="xpu")
        assert trainer.strategy.root_device == world.device, kind
        params = full_params(module)
        if kind == "ddp":
            for rank, replica in enumerate(world.gather_object(params)):
                assert_bitwise_equal(replica, params, f"rank {rank} vs rank {world.rank}")
        else:
            assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in module.parameters())
        torch.testing.assert_close(params, expected, rtol=1e-4, atol=1e-5)

    module = Classifier()
    dtypes: set[torch.dtype] = set()
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.register_forward_hook(lambda mod, args, out, seen=dtypes: seen.add(out.dtype))
    fit(
        "ddp",
        module,
        world,
        tmp_path / "bf16",
        accelerator="xpu",
        precision="bf16-mixed",
        limit_train_batches=2,
    )
    assert dtypes == {torch.bfloat16}


# -------------------------------------------------------------------------------------------------------
# checkpoints


def shared_dir(world: Any, tmp_path: Path) -> Path:
    return Path(world.broadcast_object(str(tmp_path)))


def resumed_snapshot(
    kind: str, world: Any, root: Path, ckpt: Path, *, strategy: Any = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Resume a differently initialized, LoRA-like module from ``ckpt``; its state when training restarts."""
    seen: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def capture(trainer: L.Trainer, module: L.LightningModule) -> None:
        seen["state"] = snapshot(module, trainer.optimizers[0])

    module = Classifier(seed=1, adamw=True, freeze_first=True)
    fit(
        kind,
        module,
        world,
        root,
        strategy=strategy,
        max_epochs=2,
        ckpt_path=ckpt,
        callbacks=[OnTrainStart(capture)],
    )
    return seen["state"]


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_fsdp_sharded_and_full_state_checkpoints_restore_bit_for_bit(world: Any, tmp_path: Path) -> None:
    shared = shared_dir(world, tmp_path)
    for sharded in (True, False):
        saved = Classifier(adamw=True, freeze_first=True)
        trainer = fit(
            "fsdp", saved, world, tmp_path, strategy=FSDP2Strategy(save_distributed_checkpoint=sharded)
        )
        ckpt = shared / f"fsdp-sharded-{sharded}.ckpt"
        trainer.save_checkpoint(ckpt)
        assert ckpt.is_dir() == sharded
        expected = snapshot(saved, trainer.optimizers[0])
        assert expected["net.blocks.1.lin.weight"].keys() == {"param", "step", "exp_avg", "exp_avg_sq"}

        restored = resumed_snapshot(
            "fsdp", world, tmp_path, ckpt, strategy=FSDP2Strategy(save_distributed_checkpoint=sharded)
        )
        assert_bitwise_equal(restored, expected, f"FSDP2 resume from sharded={sharded}")
        if not sharded:
            # A full-state file is an ordinary Lightning checkpoint: it resumes on one device too.
            assert_bitwise_equal(
                resumed_snapshot("single", world, tmp_path, ckpt), expected, "1-device resume"
            )


@pytest.mark.cpu
@pytest.mark.ranks(2)
def test_a_ddp_checkpoint_of_a_partly_frozen_model_resumes_under_fsdp2(world: Any, tmp_path: Path) -> None:
    # Lightning re-keys this optimizer state by position among all module parameters, frozen ones
    # included, and fails with "Missing optimizer state"; FSDP2Strategy maps it by the optimizer's order.
    saved = Classifier(adamw=True, freeze_first=True)
    trainer = fit("ddp", saved, world, tmp_path)
    ckpt = shared_dir(world, tmp_path) / "ddp.ckpt"
    trainer.save_checkpoint(ckpt)
    expected = snapshot(saved, trainer.optimizers[0])
    assert_bitwise_equal(resumed_snapshot("fsdp", world, tmp_path, ckpt), expected, "DDP -> FSDP2 resume")


# -------------------------------------------------------------------------------------------------------
# the process after a fit


def run_fresh(fn_name: str, *args: str) -> str:
    """This module's ``fn_name(*args)`` in a new interpreter with no launcher's or MPI's variables; its output.

    Not a fork of this process: with nothing launching it, Lightning's MPIEnvironment detection imports
    ``mpi4py.MPI``, and MPI initialized in a fork of a pytest process whose earlier tests had started threads
    hung in a futex (seen once the tests ran in package order).
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH and not k.startswith(_MPI_PREFIXES)}
    here = Path(__file__)
    code = f"import sys; sys.path.insert(0, {str(here.parent)!r}); import {here.stem} as m; m.{fn_name}(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (
        f"{fn_name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


_LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")
_MPI_PREFIXES = (
    "PMI_",
    "PMIX_",
    "HYDRA_",
    "HYDI_",
    "MPI_",
    "MPICH_",
    "OMPI_",
    "PALS_",
    "SLURM_",
    "TORCHELASTIC_",
)


@pytest.fixture
def unlaunched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (*_LAUNCH, "LOCAL_WORLD_SIZE", "PALS_RANKID", "PMI_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.mark.cpu
def test_an_in_process_fit_leaves_the_environment_and_process_group_as_found(
    unlaunched: None, tmp_path: Path
) -> None:
    """Lightning leaves LOCAL_RANK & co. and its process group behind; a second Trainer would then misread."""

    run_fresh("two_fits_in_one_process", str(tmp_path))


def two_fits_in_one_process(root: str) -> None:
    """A ddp and then an fsdp fit in one process that nothing launched (run by ``run_fresh``)."""
    for kind in ("ddp", "fsdp"):
        module = Classifier()
        trainer = make_trainer(kind, 1, Path(root) / kind, limit_train_batches=1)
        trainer.fit(module, loader(kind, 1, 0))
        assert module.steps == 1
        left = {name: os.environ[name] for name in _LAUNCH if name in os.environ}
        assert left == {}, f"{kind} left {left}"
        assert not dist.is_initialized(), f"{kind} left its process group initialized"
