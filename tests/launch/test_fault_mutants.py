"""``--sprite-mutate``'s training and checkpoint mutants end to end: the fault registry's faults planted in a
user's own Lightning fits (not the plugin's arms), each killed by a test that checks the training or the
resume against a reference and survived by one that does not; a project's own fault through the fault hook."""

from __future__ import annotations

import shutil
from functools import partial

import pytest
from sprite_testing import run_pytest
from test_mutation import table

pytestmark = pytest.mark.cpu

TIMEOUT = 600
run = partial(run_pytest, timeout=TIMEOUT)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("SPRITE_MUTATE", "SPRITE_MUTATE_FAIL_UNDER", "SPRITE_RANKS"):
        monkeypatch.delenv(name, raising=False)


FITS = """
    from pathlib import Path

    import lightning.pytorch as pl
    import pytest
    import torch
    import torch.distributed as dist

    from pytest_sprite import run_subworld

    LR = 0.1
    BF16_ATOL = 1e-2  # bf16 autocast's rounding over two steps of this model: 4e-4 here


    class Net(pl.LightningModule):
        def __init__(self, optimizer="sgd"):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 1)
            self.optimizer = optimizer

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.lin(x).pow(2).mean()

        def configure_optimizers(self):
            if self.optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=LR)
            opt = torch.optim.AdamW(self.parameters(), lr=LR)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


    def rows():
        torch.manual_seed(1)
        return torch.randn(32, 4)


    def loader(world, batch=4):
        # this rank's contiguous share of the rows, in order
        per_rank = len(rows()) // world.size
        mine = rows()[world.rank * per_rank : (world.rank + 1) * per_rank]
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(mine), batch_size=batch)


    def trainer(world, tmp_path, steps, **kwargs):
        return pl.Trainer(
            accelerator="cpu", devices=world.size, strategy="ddp", max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, default_root_dir=tmp_path, **kwargs,
        )


    def one_device(world, steps, accumulate, batch=4):
        # the same SGD steps on one device: a step's gradient is the mean over every rank's micro-batches
        net = Net().lin
        per_rank, per_step = len(rows()) // world.size, accumulate * batch
        for step in range(steps):
            net.zero_grad()
            starts = [r * per_rank + step * per_step for r in range(world.size)]
            x = torch.cat([rows()[start : start + per_step] for start in starts])
            net(x).pow(2).mean().backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= LR * p.grad
        return net


    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("accumulate", [1, 2])
    def test_fit_matches_one_device(world, tmp_path, accumulate):
        net = Net()
        trainer(world, tmp_path, 2, accumulate_grad_batches=accumulate).fit(net, loader(world))
        ref = one_device(world, 2, accumulate)
        torch.testing.assert_close(net.lin.weight, ref.weight)
        torch.testing.assert_close(net.lin.bias, ref.bias)


    @pytest.mark.ranks(2)
    def test_bf16_fit_is_close_to_one_device(world, tmp_path):
        net = Net()
        trainer(world, tmp_path, 2, precision="bf16-mixed").fit(net, loader(world))
        ref = one_device(world, 2, 1)
        torch.testing.assert_close(net.lin.weight, ref.weight, rtol=0, atol=BF16_ATOL)


    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
    def test_fit_loss_is_finite(world, tmp_path, precision):
        net = Net()
        trainer(world, tmp_path, 2, accumulate_grad_batches=2, precision=precision).fit(net, loader(world))
        assert torch.isfinite(net.lin.weight).all()


    def resumed_and_uninterrupted(world, tmp_path):
        # a fit of 2 steps saved and resumed to 4, and the same 4 steps uninterrupted (a step an epoch)
        first, data = Net("adamw"), loader(world, batch=len(rows()) // world.size)
        half = trainer(world, tmp_path, 2)
        half.fit(first, data)
        half.save_checkpoint(tmp_path / "half.ckpt")
        resumed, whole = Net("adamw"), Net("adamw")
        trainer(world, tmp_path, 4).fit(resumed, data, ckpt_path=tmp_path / "half.ckpt")
        trainer(world, tmp_path, 4).fit(whole, data)
        return resumed, whole


    @pytest.mark.ranks(2)
    def test_resume_matches_the_uninterrupted_fit(world, tmp_path):
        resumed, whole = resumed_and_uninterrupted(world, tmp_path)
        torch.testing.assert_close(resumed.lin.weight, whole.lin.weight, rtol=0, atol=0)


    @pytest.mark.ranks(2)
    def test_resume_runs_to_the_end(world, tmp_path):
        resumed, whole = resumed_and_uninterrupted(world, tmp_path)
        assert resumed.trainer.global_step == whole.trainer.global_step == 4


    class Noisy(Net):
        # dropout in its step; it saves torch's RNG state with its checkpoint and restores it (Lightning does not)
        def training_step(self, batch, batch_idx):
            (x,) = batch
            return torch.nn.functional.dropout(self.lin(x), p=0.5).pow(2).mean()

        def on_save_checkpoint(self, checkpoint):
            checkpoint["rng"] = torch.get_rng_state()

        def on_load_checkpoint(self, checkpoint):
            torch.set_rng_state(checkpoint["rng"])


    @pytest.mark.ranks(2)
    def test_dropout_resume_matches_the_uninterrupted_fit(world, tmp_path):
        data = loader(world, batch=len(rows()) // world.size)
        first, resumed, whole = Noisy("adamw"), Noisy("adamw"), Noisy("adamw")
        torch.manual_seed(5)
        half = trainer(world, tmp_path, 2)
        half.fit(first, data)
        half.save_checkpoint(tmp_path / "half.ckpt")
        trainer(world, tmp_path, 4).fit(resumed, data, ckpt_path=tmp_path / "half.ckpt")
        torch.manual_seed(5)
        trainer(world, tmp_path, 4).fit(whole, data)
        torch.testing.assert_close(resumed.lin.weight, whole.lin.weight, rtol=0, atol=0)


    def sum_and_resume(world, tmp_path):
        total = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(total)
        resumed, whole = resumed_and_uninterrupted(world, Path(tmp_path))
        return total.item(), torch.equal(resumed.lin.weight, whole.lin.weight)


    @pytest.mark.ranks(2)
    def test_a_subworld_sums_and_resumes(world, tmp_path):
        assert run_subworld(sum_and_resume, args=(str(tmp_path),)).values() == [(3.0, True)] * 2
"""


PROJECT_FAULT = """
    from pytest_sprite.planted_faults import Fault, Planter


    class FirstGradientLost(Planter):
        def gradients(self, named_parameters, site):
            named_parameters[0][1].grad.zero_()


    def pytest_sprite_add_faults(faults):
        faults.add(
            Fault(
                name="first-gradient-lost",
                description="the first trainable's synchronized gradient is zeroed",
                arms=("ddp",),
                by=("pre_norm",),
                planter=FirstGradientLost(),
            )
        )
"""

TRAINING = ["missing-rank", "wrong-scale", "accumulate-sum", "scale-grad"]
CHECKPOINT = ["dropped-optimizer-state", "reset-lr-scheduler", "perturbed-weight"]
RNG = "unrestored-rng"  # killed only by a test whose fit draws random numbers after the restore


FAST_EXPECTED = {
    "test_fit_matches_one_device[1]": {"killed": ["missing-rank"], "not applicable": ["perturbed-weight"]},
    # the resumed fit and the uninterrupted one lose the same rank's loss: they agree, the bug survives
    "test_a_subworld_sums_and_resumes": {"killed": ["perturbed-weight"], "survived": ["missing-rank"]},
}


def fast_table(pytester: pytest.Pytester, *args: str) -> dict[str, dict[str, list[str]]]:
    pytester.makepyfile(test_fits=FITS)
    result = run(
        pytester,
        "--sprite-mutate=missing-rank,perturbed-weight",
        *args,
        "test_fits.py::test_fit_matches_one_device[1]",
        "test_fits.py::test_a_subworld_sums_and_resumes",
    )
    result.assert_outcomes(passed=2)
    return table(result.stdout.str())


def test_a_fault_mutant_is_killed_by_a_checking_test_and_survived_by_a_weak_one(
    pytester: pytest.Pytester,
) -> None:
    """The representative fast path: a training mutant in a test's own fit and a checkpoint mutant in a
    sub-world's resumed fit (the sub-world plants the test's mutant and sends back what it recorded)."""
    assert fast_table(pytester) == FAST_EXPECTED


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--ranks=4", "--pack=on"), id="packed"),
        pytest.param(("--ranks=4", "--pack=off"), id="unpacked"),
        pytest.param(("--launcher=mpiexec", "--ranks=2"), id="mpiexec"),
    ],
)
def test_the_same_scores_packed_unpacked_and_under_mpiexec(
    pytester: pytest.Pytester, args: tuple[str, ...]
) -> None:
    if "--launcher=mpiexec" in args and shutil.which("mpiexec") is None:
        pytest.skip("MPICH's mpiexec is not on PATH (pip install mpich)")
    assert fast_table(pytester, *args) == FAST_EXPECTED


@pytest.mark.slow
def test_each_fault_mutant_and_a_projects_own_are_killed_by_one_test_and_survived_by_another(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_fits=FITS)
    pytester.makeconftest(PROJECT_FAULT)
    result = run(pytester, "--sprite-mutate=skip_allreduce,training,checkpoint")
    result.assert_outcomes(passed=9)
    got = table(result.stdout.str())
    # a sub-world's fits take the test's mutants, collectives included
    assert got["test_a_subworld_sums_and_resumes"]["killed"] == ["skip_allreduce", *CHECKPOINT]
    assert got["test_a_subworld_sums_and_resumes"]["survived"] == [
        "missing-rank",
        "wrong-scale",
        "first-gradient-lost",
        RNG,
    ]
    for entry in got.values():  # the rest is about the fault mutants
        for names in entry.values():
            names[:] = [n for n in names if n != "skip_allreduce"]
    own = "first-gradient-lost"  # the project's: a training mutant like the built-ins
    assert got["test_fit_matches_one_device[1]"]["killed"] == ["missing-rank", "wrong-scale", own]
    assert got["test_fit_matches_one_device[2]"]["killed"] == [
        "missing-rank",
        "wrong-scale",
        "accumulate-sum",
        own,
    ]
    assert got["test_bf16_fit_is_close_to_one_device"]["killed"] == [
        "missing-rank",
        "wrong-scale",
        "scale-grad",
        own,
    ]
    assert got["test_fit_loss_is_finite[bf16-mixed]"]["survived"] == [*TRAINING, own]
    assert got["test_resume_matches_the_uninterrupted_fit"]["killed"] == CHECKPOINT
    # the same comparison with dropout and the RNG state saved and restored by the module: the RNG mutant dies
    assert got["test_resume_matches_the_uninterrupted_fit"]["survived"][-1] == RNG
    assert got["test_dropout_resume_matches_the_uninterrupted_fit"]["killed"][-4:] == [*CHECKPOINT, RNG]
    assert got["test_resume_runs_to_the_end"]["survived"] == [
        "missing-rank",
        "wrong-scale",
        own,
        *CHECKPOINT,
        RNG,
    ]
    # a fit that restored nothing takes no checkpoint mutant; an FP32 fit no BF16 control
    assert got["test_fit_loss_is_finite[32-true]"]["not applicable"] == ["scale-grad", *CHECKPOINT, RNG]
