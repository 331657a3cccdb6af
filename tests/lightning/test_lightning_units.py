"""pytest_sprite.lightning without processes: the XPU paths on a faked ``torch.xpu``, precision, PALS, checks.

A CPU build of torch says ``torch.xpu.is_available()`` is False and most ``torch.xpu`` calls raise, but
``torch.autocast("xpu")`` enters; faking availability, device count, current device, ``set_device`` and
memory stats is enough to build an XPU Trainer and exercise every XPU branch without hardware.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import lightning.fabric.utilities.rank_zero as fabric_rank_zero
import lightning_utilities.core.rank_zero as utils_rank_zero
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn

import pytest_sprite.lightning as sprite_lightning
from pytest_sprite.env.rank_variables import LAUNCHER_VARIABLES, derive_port
from pytest_sprite.errors import RankEnvError, SpriteUsageError
from pytest_sprite.lightning import (
    FSDP2Strategy,
    PALSEnvironment,
    XPUAccelerator,
    XPUDDPStrategy,
    XPUMixedPrecision,
    shard_model,
    trainer_kwargs,
)
from pytest_sprite.lightning.strategies import _common
from pytest_sprite.lightning.strategies import ddp as ddp_module

pytestmark = pytest.mark.cpu

_OTHER_LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "PBS_NODEFILE",
    "PBS_JOBID",
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "TORCHELASTIC_RUN_ID",
    "ZE_AFFINITY_MASK",
    "ZE_FLAT_DEVICE_HIERARCHY",
)


@pytest.fixture(autouse=True)
def plain_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process no launcher started, whose Lightning rank-zero state is restored after the test."""
    if dist.is_available() and dist.is_initialized():
        pytest.fail("these tests build Trainers without a process group; run them outside ranks tests")
    for names in LAUNCHER_VARIABLES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    for name in _OTHER_LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # Building a Trainer sets the global rank_zero_only.rank; put it back so later tests still log.
    monkeypatch.setattr(fabric_rank_zero.rank_zero_only, "rank", fabric_rank_zero.rank_zero_only.rank)
    monkeypatch.setattr(
        utils_rank_zero.rank_zero_only, "rank", getattr(utils_rank_zero.rank_zero_only, "rank", 0)
    )
    yield


def launched_as(
    monkeypatch: pytest.MonkeyPatch, *, rank: int, local_rank: int, world: int, local: int
) -> None:
    """The variables torchrun (or the harness) exports in each process it starts."""
    for name, value in {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": local,
        "NODE_RANK": rank // local,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": 29555,
    }.items():
        monkeypatch.setenv(name, str(value))


@dataclass
class FakeXPU:
    """What the tests fake of ``torch.xpu``, and what the code under test did with it."""

    count: int = 12
    current: int = 0
    set_devices: list[int] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: {"allocated_bytes.all.current": 4096})


@pytest.fixture
def fake_xpu(monkeypatch: pytest.MonkeyPatch) -> FakeXPU:
    fake = FakeXPU()

    def set_device(device: Any) -> None:
        fake.set_devices.append(int(device))

    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.xpu, "set_device", set_device)
    monkeypatch.setattr(torch.xpu, "memory_stats", lambda device=None: dict(fake.stats))
    monkeypatch.setattr(torch.xpu, "empty_cache", lambda: None)
    return fake


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# -------------------------------------------------------------------------------------------------------
# package surface


def test_public_surface_is_narrow_and_sorted() -> None:
    assert sprite_lightning.__all__ == sorted(sprite_lightning.__all__)
    assert set(sprite_lightning.__all__) == {
        "FSDP2Strategy",
        "PALSEnvironment",
        "XPUAccelerator",
        "XPUDDPStrategy",
        "XPUMixedPrecision",
        "shard_model",
        "trainer_kwargs",
    }


def test_importing_registers_the_xpu_accelerator() -> None:
    assert AcceleratorRegistry["xpu"]["accelerator"] is XPUAccelerator
    assert isinstance(AcceleratorRegistry.get("xpu"), XPUAccelerator)


# -------------------------------------------------------------------------------------------------------
# XPUAccelerator


def test_xpu_is_unavailable_on_a_cpu_build_and_trainer_kwargs_says_what_to_do() -> None:
    if torch.xpu.is_available():
        pytest.skip("this torch build has XPU devices")
    assert not XPUAccelerator.is_available()
    assert XPUAccelerator.auto_device_count() == 0
    with pytest.raises(SpriteUsageError, match=r"torch\.xpu\.is_available\(\) is False.*accelerator='cpu'"):
        trainer_kwargs("ddp", devices=2)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (2, [0, 1]),
        ("3", [0, 1, 2]),
        (-1, list(range(12))),
        ("-1", list(range(12))),
        ("auto", list(range(12))),
        ("0,5", [0, 5]),
        ("7,", [7]),
        ([3], [3]),
        ([11, 4], [11, 4]),
    ],
)
def test_parse_devices_follows_lightnings_gpu_grammar(
    fake_xpu: FakeXPU, devices: Any, expected: list[int]
) -> None:
    assert XPUAccelerator.parse_devices(devices) == expected
    assert XPUAccelerator.get_parallel_devices(expected) == [torch.device("xpu", i) for i in expected]


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (0, r"devices=0 is not valid for XPUAccelerator; use a positive int, -1 \(all tiles\)"),
        ("two", "devices='two' is not valid for XPUAccelerator"),
        (True, "devices=True is not valid"),
        ([1, 1], r"devices=\[1, 1\] names a tile twice"),
        ([-2], r"devices=\[-2\] is not valid"),
        (13, r"devices=13 asks for XPU tile\(s\) \[12\], but this process sees 12 XPU device\(s\)"),
    ],
)
def test_parse_devices_rejects_what_it_cannot_honour(fake_xpu: FakeXPU, devices: Any, message: str) -> None:
    with pytest.raises(SpriteUsageError, match=message):
        XPUAccelerator.parse_devices(devices)


def test_setup_device_selects_the_tile_of_the_local_rank(fake_xpu: FakeXPU) -> None:
    XPUAccelerator().setup_device(torch.device("xpu", 5))
    assert fake_xpu.set_devices == [5]


def test_setup_device_refuses_cpu() -> None:
    with pytest.raises(SpriteUsageError, match="XPUAccelerator was given device 'cpu'"):
        XPUAccelerator().setup_device(torch.device("cpu"))


def test_a_rank_that_cannot_see_its_tile_raises_naming_the_affinity_mask(
    fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A per-rank ZE_AFFINITY_MASK leaves each rank one visible device, so local rank 5 has no xpu:5.
    fake_xpu.count = 1
    monkeypatch.setenv("ZE_AFFINITY_MASK", "5")
    with pytest.raises(RuntimeError) as info:
        XPUAccelerator().setup_device(torch.device("xpu", 5))
    assert str(info.value) == (
        "this process should compute on xpu:5 (its local rank selects the tile), but it sees only 1 XPU "
        "device(s) (ZE_AFFINITY_MASK='5'). Each rank must see every tile of its node: do not give ranks their "
        "own ZE_AFFINITY_MASK, export ZE_FLAT_DEVICE_HIERARCHY=FLAT (12 devices per Aurora node) and launch "
        "one rank per tile (mpiexec --ppn 12)."
    )
    assert fake_xpu.set_devices == []


def test_a_trainer_under_a_per_rank_mask_fails_when_it_is_built(
    fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_xpu.count = 1
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    launched_as(monkeypatch, rank=1, local_rank=1, world=2, local=2)
    with pytest.raises(
        SpriteUsageError, match=r"devices=2 asks for XPU tile\(s\) \[1\].*ZE_AFFINITY_MASK='1'"
    ):
        quiet_trainer(**trainer_kwargs("ddp", devices=2))


def test_memory_stats_come_from_torch_xpu(fake_xpu: FakeXPU) -> None:
    assert XPUAccelerator().get_device_stats(torch.device("xpu", 0)) == {"allocated_bytes.all.current": 4096}


# -------------------------------------------------------------------------------------------------------
# trainer_kwargs on a faked XPU


def test_single_pins_the_given_tile(fake_xpu: FakeXPU) -> None:
    kwargs = trainer_kwargs("single", devices=[3])
    assert (kwargs["accelerator"], kwargs["devices"], kwargs["num_nodes"]) == ("xpu", [3], 1)
    trainer = quiet_trainer(**kwargs)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.strategy.root_device == torch.device("xpu", 3)
    assert isinstance(trainer.accelerator, XPUAccelerator)


def test_single_auto_pins_the_current_tile_not_the_cpu(fake_xpu: FakeXPU) -> None:
    fake_xpu.current = 7
    trainer = quiet_trainer(**trainer_kwargs("single"))
    assert trainer.strategy.root_device == torch.device("xpu", 7)
    # Lightning alone gives a custom accelerator with devices=1 a CPU SingleDeviceStrategy.
    alone = quiet_trainer(accelerator="xpu", devices=1)
    assert alone.strategy.root_device == torch.device("cpu")


def test_bf16_mixed_autocasts_on_xpu_not_cuda(fake_xpu: FakeXPU) -> None:
    trainer = quiet_trainer(**trainer_kwargs("single", devices=[0]))
    plugin = trainer.precision_plugin
    assert isinstance(plugin, XPUMixedPrecision)
    with plugin.forward_context():
        assert torch.is_autocast_enabled("xpu")
        assert torch.get_autocast_dtype("xpu") == torch.bfloat16
    # Lightning alone autocasts a custom accelerator for "cuda", which a CPU/XPU build ignores: fp32.
    alone = quiet_trainer(
        accelerator="xpu", devices=[0], strategy=SingleDeviceStrategy("xpu:0"), precision="bf16-mixed"
    )
    assert isinstance(alone.precision_plugin, MixedPrecision)
    assert alone.precision_plugin.device == "cuda"


def test_ddp_on_xpu_uses_the_local_rank_tile_and_xccl(
    fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched_as(monkeypatch, rank=3, local_rank=1, world=4, local=2)
    trainer = quiet_trainer(**trainer_kwargs("ddp", num_nodes=2))
    strategy = trainer.strategy
    assert isinstance(strategy, XPUDDPStrategy)
    assert trainer.num_devices == 2  # "auto" is the launcher's processes per node, not all 12 tiles
    assert (strategy.root_device, strategy.global_rank, strategy.world_size) == (torch.device("xpu", 1), 3, 4)
    strategy.accelerator.setup_device(strategy.root_device)
    assert fake_xpu.set_devices == [1]
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True)
    assert strategy._get_process_group_backend() == "xccl"


def test_xccl_missing_from_the_build_is_reported(fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch) -> None:
    launched_as(monkeypatch, rank=0, local_rank=0, world=2, local=2)
    trainer = quiet_trainer(**trainer_kwargs("fsdp", devices=2))
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    with pytest.raises(
        RuntimeError, match=r"the root device is xpu:0 but this torch build .* has no xccl backend"
    ):
        trainer.strategy._get_process_group_backend()


def test_ddp_wraps_an_xpu_model_without_any_cuda_call(
    fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched_as(monkeypatch, rank=1, local_rank=1, world=2, local=2)
    strategy = quiet_trainer(**trainer_kwargs("ddp", devices=2)).strategy
    wrapped: list[dict[str, Any]] = []

    def fake_ddp(module: nn.Module, device_ids: list[int] | None = None, **kwargs: Any) -> nn.Module:
        wrapped.append({"device_ids": device_ids, **kwargs})
        return module

    def no_cuda(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda was called")

    monkeypatch.setattr(ddp_module, "DistributedDataParallel", fake_ddp)
    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "stream", no_cuda)
    strategy._setup_model(nn.Linear(2, 2))
    assert wrapped == [{"device_ids": [1]}]
    # Lightning's DDPStrategy builds the same wrapper inside torch.cuda.stream(torch.cuda.Stream()).
    with pytest.raises(AssertionError, match=r"torch\.cuda was called"):
        DDPStrategy._setup_model(strategy, nn.Linear(2, 2))


def test_fsdp_on_one_node_is_data_parallel_over_every_process(
    fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched_as(monkeypatch, rank=0, local_rank=0, world=12, local=12)
    strategy = quiet_trainer(**trainer_kwargs("fsdp", devices=12)).strategy
    assert isinstance(strategy, FSDP2Strategy)
    strategy._resolve_mesh_sizes()
    # Lightning's ModelParallelStrategy "auto" would be data_parallel=1 (nodes) x tensor_parallel=12.
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (12, 1)


def test_fsdp_tensor_parallel_size_must_divide_the_world(
    fake_xpu: FakeXPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched_as(monkeypatch, rank=0, local_rank=0, world=12, local=12)
    kwargs = trainer_kwargs("fsdp", devices=12)
    kwargs["strategy"] = FSDP2Strategy(tensor_parallel_size=5)
    strategy = quiet_trainer(**kwargs).strategy
    with pytest.raises(
        SpriteUsageError, match=r"tensor_parallel_size=5\) does not divide the world of 12 processes"
    ):
        strategy._resolve_mesh_sizes()


# -------------------------------------------------------------------------------------------------------
# trainer_kwargs: CPU and argument checks


def test_cpu_kwargs_give_the_same_strategies_with_cpu_autocast() -> None:
    for name, strategy_type in (("ddp", XPUDDPStrategy), ("fsdp", FSDP2Strategy)):
        kwargs = trainer_kwargs(name, devices=2, accelerator="cpu")
        assert kwargs["accelerator"] == "cpu" and kwargs["devices"] == 2
        assert isinstance(kwargs["strategy"], strategy_type)
        (plugin,) = kwargs["plugins"]
        assert isinstance(plugin, XPUMixedPrecision) and plugin.device == "cpu"
    single = trainer_kwargs("single", accelerator="cpu")
    assert isinstance(single["strategy"], SingleDeviceStrategy) and single["devices"] == 1


def test_cpu_auto_devices_follow_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trainer_kwargs("ddp", accelerator="cpu")["devices"] == 1
    launched_as(monkeypatch, rank=2, local_rank=2, world=4, local=4)
    assert trainer_kwargs("ddp", accelerator="cpu")["devices"] == 4


def test_cuda_kwargs_give_the_same_strategies_with_cuda_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    single = trainer_kwargs("single", accelerator="cuda")
    assert single["strategy"].root_device == torch.device("cuda", 2) and single["devices"] == [2]
    assert trainer_kwargs("single", devices=[3], accelerator="cuda")["devices"] == [3]
    with pytest.raises(SpriteUsageError, match=r"this process sees 4 GPU\(s\), indices 0\.\.3"):
        trainer_kwargs("single", devices=[4], accelerator="cuda")
    ddp = trainer_kwargs("ddp", accelerator="cuda")
    assert isinstance(ddp["strategy"], XPUDDPStrategy) and ddp["devices"] == 4
    (plugin,) = ddp["plugins"]
    assert isinstance(plugin, XPUMixedPrecision) and plugin.device == "cuda"


def test_cuda_unavailable_is_reported() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SpriteUsageError, match=r"no CUDA GPU is visible .* use accelerator='cpu'"):
        trainer_kwargs("ddp", accelerator="cuda")


@pytest.mark.parametrize(
    ("precision", "plugin_type", "name"),
    [
        ("bf16-mixed", XPUMixedPrecision, "bf16-mixed"),
        ("bf16", XPUMixedPrecision, "bf16-mixed"),
        ("16-mixed", XPUMixedPrecision, "16-mixed"),
        ("16", XPUMixedPrecision, "16-mixed"),
        (16, XPUMixedPrecision, "16-mixed"),
        ("32-true", Precision, None),
        (32, Precision, None),
        ("bf16-true", HalfPrecision, "bf16-true"),
    ],
)
def test_precision_and_legacy_aliases(precision: Any, plugin_type: type, name: str | None) -> None:
    (plugin,) = trainer_kwargs("ddp", devices=2, precision=precision, accelerator="cpu")["plugins"]
    assert type(plugin) is plugin_type
    if name is not None:
        assert plugin.precision == name


def test_precision_plugin_goes_in_plugins_so_lightning_does_not_see_both() -> None:
    kwargs = trainer_kwargs("single", accelerator="cpu")
    assert "precision" not in kwargs
    trainer = quiet_trainer(**kwargs)
    assert trainer.precision_plugin is kwargs["plugins"][0]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("zero",), {}, r"trainer_kwargs\(strategy='zero'\): use one of single, ddp, fsdp\."),
        (("ddp",), {"accelerator": "tpu"}, r"trainer_kwargs\(accelerator='tpu'\): use one of xpu, cpu, cuda"),
        (("ddp",), {"accelerator": "cpu", "num_nodes": 0}, r"num_nodes=0\): use a positive int"),
        (
            ("ddp",),
            {"accelerator": "cpu", "precision": "fp8"},
            r"precision='fp8' is not supported; use one of",
        ),
        (
            ("single",),
            {"accelerator": "cpu", "devices": 2},
            r"trainer_kwargs\('single', devices=2, accelerator='cpu'\)",
        ),
        (("single",), {"accelerator": "cpu", "num_nodes": 2}, r"one device runs on one node"),
        (("fsdp",), {"accelerator": "cpu", "precision": "16-mixed"}, r"use precision='bf16-mixed'"),
    ],
)
def test_trainer_kwargs_rejects_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpriteUsageError, match=message):
        trainer_kwargs(*args, **kwargs)


# -------------------------------------------------------------------------------------------------------
# XPUMixedPrecision


@pytest.mark.parametrize(("given", "name"), [("bf16", "bf16-mixed"), ("16", "16-mixed"), (16, "16-mixed")])
def test_mixed_precision_accepts_lightnings_legacy_aliases(given: Any, name: str) -> None:
    plugin = XPUMixedPrecision(given, device="xpu:1")
    assert (plugin.precision, plugin.device) == (name, "xpu")
    dtype = torch.bfloat16 if name == "bf16-mixed" else torch.float16
    with plugin.forward_context():
        assert torch.is_autocast_enabled("xpu") and torch.get_autocast_dtype("xpu") == dtype
    assert (plugin.scaler is not None) == (name == "16-mixed")


def test_mixed_precision_refuses_true_precisions() -> None:
    with pytest.raises(
        SpriteUsageError, match=r"XPUMixedPrecision\(precision='32-true'\) resolves to '32-true'"
    ):
        XPUMixedPrecision("32-true")


def test_mixed_precision_on_cpu_really_computes_linear_layers_in_bf16() -> None:
    plugin = XPUMixedPrecision(device="cpu")
    with plugin.forward_context():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


class _AutocastProbe(torch.autograd.Function):
    """Identity that records whether autocast was on in its forward and in its backward."""

    seen: list[tuple[str, bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _AutocastProbe.seen.append(("forward", torch.is_autocast_enabled("cpu")))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _AutocastProbe.seen.append(("backward", torch.is_autocast_enabled("cpu")))
        return grad


class _ManualModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = _AutocastProbe.apply(self.lin(batch[0]).float()).pow(2).mean()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_backward_runs_outside_autocast_like_automatic_optimization(tmp_path: Path) -> None:
    _AutocastProbe.seen.clear()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    trainer = quiet_trainer(
        **trainer_kwargs("single", accelerator="cpu"), max_steps=2, default_root_dir=tmp_path
    )
    trainer.fit(_ManualModule(), data)
    assert _AutocastProbe.seen == [("forward", True), ("backward", False)] * 2


# -------------------------------------------------------------------------------------------------------
# PALSEnvironment


def pals_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, rank: int, local_rank: int) -> None:
    """What Aurora's mpiexec exports (no world size: the job script passes --env WORLD_SIZE)."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x4000c0s0b0n0.hostmgmt\nx4000c0s1b0n0.hostmgmt\n")
    for name, value in {
        "PALS_RANKID": rank,
        "PALS_LOCAL_RANKID": local_rank,
        "PALS_LOCAL_SIZE": 2,
        "PALS_NODEID": rank // 2,
        "WORLD_SIZE": 4,
        "PBS_NODEFILE": nodefile,
        "PBS_JOBID": "8675309.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov",
    }.items():
        monkeypatch.setenv(name, str(value))


def test_pals_environment_reads_the_launch_and_rendezvous(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert not PALSEnvironment.detect()
    pals_launch(monkeypatch, tmp_path, rank=3, local_rank=1)
    assert PALSEnvironment.detect()
    env = PALSEnvironment()
    assert env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.world_size(), env.node_rank()) == (3, 1, 4, 1)
    assert env.main_address == "x4000c0s0b0n0.hostmgmt"
    assert env.main_port == derive_port(os.environ["PBS_JOBID"])
    env.set_global_rank(0)
    env.set_world_size(1)
    assert (env.global_rank(), env.world_size()) == (3, 4)


def test_pals_environment_refuses_a_port_each_rank_would_choose_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pals_launch(monkeypatch, tmp_path, rank=3, local_rank=1)
    monkeypatch.delenv("PBS_JOBID")
    env = PALSEnvironment()
    with pytest.raises(RankEnvError, match=r"no rendezvous port for 4 ranks: none of MASTER_PORT, PBS_JOBID"):
        env.main_port  # noqa: B018
    monkeypatch.setenv("MASTER_PORT", "29123")
    assert env.main_port == 29123


def test_pals_environment_refuses_a_stale_rank_from_an_outer_launcher(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pals_launch(monkeypatch, tmp_path, rank=3, local_rank=1)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RankEnvError, match=r"rank: RANK=0 \(torchrun\), PALS_RANKID=3 \(PALS\)"):
        PALSEnvironment()


def test_pals_environment_checks_the_trainers_process_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pals_launch(monkeypatch, tmp_path, rank=3, local_rank=1)
    env = PALSEnvironment()
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(SpriteUsageError, match=r"expects 12 x 1 = 12 processes, but the launcher started 4"):
        env.validate_settings(num_devices=12, num_nodes=1)


def test_strategies_pick_pals_automatically_and_do_not_self_spawn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pals_launch(monkeypatch, tmp_path, rank=3, local_rank=1)
    for name in ("ddp", "fsdp"):
        trainer = quiet_trainer(**trainer_kwargs(name, accelerator="cpu", num_nodes=2))
        environment = trainer.strategy.cluster_environment
        assert isinstance(environment, PALSEnvironment)
        assert environment.creates_processes_externally  # Lightning's popen launcher starts nothing
        assert (trainer.num_devices, trainer.global_rank, trainer.world_size) == (2, 3, 4)


# -------------------------------------------------------------------------------------------------------
# launch checks (the process count under an external launcher)


def test_external_launch_with_a_different_process_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    launched_as(monkeypatch, rank=1, local_rank=1, world=4, local=4)
    for name in ("ddp", "fsdp"):
        with pytest.raises(SpriteUsageError) as info:
            quiet_trainer(**trainer_kwargs(name, devices=2, accelerator="cpu"))
        strategy = "XPUDDPStrategy" if name == "ddp" else "FSDP2Strategy"
        assert str(info.value) == (
            f"{strategy}: Trainer(devices=2, num_nodes=1) expects 2 x 1 = 2 processes, but 4 were launched "
            f"(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE). Set devices to the processes per node and "
            f"num_nodes to the node count, or launch 2 processes."
        )


def test_a_local_rank_beyond_the_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    env = LightningEnvironment()
    with pytest.raises(
        SpriteUsageError, match=r"local rank 3 \(LightningEnvironment\), but Trainer\(devices=2\)"
    ):
        _common.check_launch("XPUDDPStrategy", env, num_processes=2, num_nodes=1, global_rank=3)


def test_a_self_launched_trainer_is_not_checked() -> None:
    env = LightningEnvironment()
    assert not env.creates_processes_externally
    _common.check_launch("XPUDDPStrategy", env, num_processes=2, num_nodes=1, global_rank=0)


# -------------------------------------------------------------------------------------------------------
# shard_model arguments (before any process group is needed)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


def test_shard_model_names_the_classes_when_layer_classes_match_nothing() -> None:
    model = nn.Sequential(_Block(), nn.Linear(2, 2))
    with pytest.raises(SpriteUsageError) as info:
        shard_model(model, mesh=None, layer_classes=["DecoderLayer"])  # type: ignore[arg-type]
    assert str(info.value) == (
        "shard_model(layer_classes=[DecoderLayer]) matched no submodule of Sequential; its module classes are: "
        "Linear, Sequential, _Block. Pass the class of the repeated block (e.g. the decoder layer), or "
        "layer_classes=None to use Hugging Face's _no_split_modules."
    )


def test_shard_model_rejects_non_module_layer_classes() -> None:
    with pytest.raises(SpriteUsageError, match=r"got \[<class 'int'>\]; pass torch\.nn\.Module subclasses"):
        shard_model(nn.Linear(2, 2), mesh=None, layer_classes=[_Block, int])  # type: ignore[arg-type, list-item]


# -------------------------------------------------------------------------------------------------------
# full-state optimizer keys (the "Missing optimizer state" fix, without processes)


def _partly_frozen() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)  # frozen parameters come first in the module, as a LoRA backbone's do
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def test_integer_optimizer_keys_map_to_the_optimizers_parameters_not_the_modules() -> None:
    from pytest_sprite.lightning.strategies.fsdp2 import _keyed_by_name

    model, optimizer = _partly_frozen()
    saved = {
        "state": {0: {"exp_avg": torch.ones(1, 2)}, 1: {"exp_avg": torch.ones(1)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
    }
    by_name = _keyed_by_name(saved, model, optimizer, Path("ddp.ckpt"))
    # Lightning maps 0 and 1 to the module's first parameters, the frozen 0.weight and 0.bias.
    assert list(by_name["state"]) == ["1.weight", "1.bias"]
    assert by_name["param_groups"] == [{"lr": 0.1, "params": ["1.weight", "1.bias"]}]


def test_optimizer_state_for_other_trainable_parameters_is_refused() -> None:
    from pytest_sprite.lightning.strategies.fsdp2 import _keyed_by_name

    model, optimizer = _partly_frozen()
    saved = {"state": {0: {}, 1: {}, 2: {}}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}
    with pytest.raises(SpriteUsageError) as info:
        _keyed_by_name(saved, model, optimizer, Path("ddp.ckpt"))
    assert str(info.value) == (
        "checkpoint 'ddp.ckpt' has optimizer param groups of [3] parameters, but this optimizer's groups hold "
        "[2]: the trainable parameters changed between save and resume (frozen or unfrozen layers, a different "
        "adapter). Resume with the same trainable parameters."
    )
