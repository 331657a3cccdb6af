"""The resume comparison on synthetic role records: every required check, its message, the reported items."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from pytest_sprite import AssertionFailure, run_subworld
from pytest_sprite.assertions.expect_fault import FaultNotRejected, expect_fault_rejected
from pytest_sprite.assertions.resume import RESUME_CHECKS, ResumeError, ResumeResult, judge_resume
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.fit_kit import gather_shards  # here, so the forked ranks have it (and Lightning)
from pytest_sprite.records import ResumeRun, RoleRecord, StateCapture, StepRecord

pytestmark = pytest.mark.cpu

NAMES = ("a.lora_A", "a.lora_B", "head.weight")
FROZEN = {"embed": "d0", "q.base": "d1"}
LRS = [0.01, 0.0085, 0.007, 0.0055, 0.004, 0.0025]


def _weights(step: int, *, bump: float = 0.0) -> dict[str, torch.Tensor]:
    return {n: torch.full((2, 3), float(i + 1) + step * 0.5 + bump) for i, n in enumerate(NAMES)}


def _capture(step: int, *, rank: int = 0, world: int = 2, **changes: Any) -> StateCapture:
    fields: dict[str, Any] = dict(
        rank=rank,
        world_size=world,
        global_step=step,
        epochs_done=step // 3,
        trainables=_weights(step),
        optimizer={
            n: {
                "exp_avg": torch.full((2, 3), 0.1 * step),
                "exp_avg_sq": torch.full((2, 3), 0.01 * step),
                "step": torch.tensor(float(step)),
            }
            for n in NAMES
        },
        optimizer_devices={n: {"exp_avg": "cpu", "exp_avg_sq": "cpu", "step": "cpu"} for n in NAMES},
        param_devices={n: "cpu" for n in NAMES},
        param_groups=(
            {"lr": LRS[step] if step < 6 else 0.001, "betas": (0.9, 0.999), "params": list(NAMES)},
        ),
        scheduler={
            "last_epoch": step,
            "_step_count": step + 1,
            "_last_lr": [LRS[step] if step < 6 else 0.001],
        },
        frozen=dict(FROZEN),
    )
    fields.update(changes)
    return StateCapture(**fields)


def _step(s: int, rank: int, world: int, *, loss: float | None = None, lr: float | None = None) -> StepRecord:
    rows_per_step = 4
    micro = rows_per_step // world
    rows = tuple(s * rows_per_step + rank + world * j for j in range(micro))
    return StepRecord(
        step=s,
        epoch=s // 3,
        batch=s % 3,
        loss=loss if loss is not None else 1.0 / (s + 1) + 0.01 * rank,
        lr=lr if lr is not None else LRS[s],
        rows=rows,
        pre_clip_norm=2.0 + s,
        rng=f"rng-{s}-{rank}",
    )


def _role(
    role: str, *, world: int = 2, steps: range = range(6), restored_at: int | None = None, **kw: Any
) -> tuple[RoleRecord, ...]:
    out = []
    for r in range(world):
        saves = tuple(_capture(s, rank=r, world=world) for s in (3, 6) if s <= steps.stop and s > steps.start)
        out.append(
            RoleRecord(
                role=role,
                strategy="ddp",
                precision="32-true",
                rank=r,
                world_size=world,
                global_batch=4,
                fault=None,
                steps=tuple(_step(s, r, world) for s in steps),
                saves=saves,
                restored=_capture(restored_at, rank=r, world=world) if restored_at is not None else None,
                killed=role == "killed",
            )
        )
    return tuple(out)


def _run(**roles: tuple[RoleRecord, ...]) -> ResumeRun:
    base = {
        "fit": _role("fit"),
        "twin": _role("twin"),
        "killed": _role("killed", steps=range(4)),
        "resume": _role("resume", steps=range(3, 6), restored_at=3),
        "reload": _role("reload", steps=range(0), restored_at=6),
    }
    base["reload"] = tuple(dataclasses.replace(r, saves=()) for r in base["reload"])
    base.update(roles)
    return ResumeRun(
        strategy="ddp",
        precision="32-true",
        ranks=2,
        global_batch=4,
        steps_per_epoch=3,
        epochs=2,
        fault=None,
        roles=base,
    )


def _with_restored(records: tuple[RoleRecord, ...], rank: int, **changes: Any) -> tuple[RoleRecord, ...]:
    out = list(records)
    assert out[rank].restored is not None
    out[rank] = dataclasses.replace(out[rank], restored=dataclasses.replace(out[rank].restored, **changes))
    return tuple(out)


def _with_step(
    records: tuple[RoleRecord, ...], rank: int, step: int, **changes: Any
) -> tuple[RoleRecord, ...]:
    out = list(records)
    steps = tuple(dataclasses.replace(s, **changes) if s.step == step else s for s in out[rank].steps)
    out[rank] = dataclasses.replace(out[rank], steps=steps)
    return tuple(out)


def _failed(run: ResumeRun) -> dict[tuple[str, str], str]:
    return {(f.arm, f.check): f.detail for f in judge_resume(run).failed}


def test_clean_run_passes_with_the_seed_tables() -> None:
    result = judge_resume(_run())
    assert result.passed
    assert result.kind == "resume"
    text = result.report()
    assert (
        "Run           Ranks  Global batch  Reshard ranks  Required restore, continuation, reshard, export"
        in text
    )
    assert "ddp, 32-true  2      4             -              pass" in text
    assert "Reported loss gap" in text and "Reported Adam second-moment gap" in text
    assert "departs from the uninterrupted fit: never" in text
    assert "twin fit: reproduces the fit bit for bit" in text
    assert "RNG streams: match the uninterrupted fit on every rank" in text
    data = result.to_dict()
    assert data["kind"] == "resume" and data["passed"] is True
    assert [a["label"] for a in data["arms"]] == ["ddp resume", "ddp reload"]
    assert data["gaps"][0] == {
        "arm": "ddp",
        "loss": 0.0,
        "pre_clip_norm": 0.0,
        "update": 0.0,
        "adam_m": 0.0,
        "adam_v": 0.0,
    }


def test_result_is_frozen() -> None:
    result = judge_resume(_run())
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.strategy = "fsdp"  # type: ignore[misc]


def test_missing_optimizer_state_key_is_named() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    opt = {n: dict(v) for n, v in resume[1].restored.optimizer.items()}  # type: ignore[union-attr]
    del opt["a.lora_B"]["exp_avg_sq"]
    failed = _failed(_run(resume=_with_restored(resume, 1, optimizer=opt)))
    assert failed == {("ddp resume", "optimizer_state"): "rank 1: a.lora_B: state exp_avg_sq missing"}


def test_dropped_optimizer_state_names_every_parameter_as_missing() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    for rank in (0, 1):
        resume = _with_restored(resume, rank, optimizer={n: {} for n in NAMES})
    detail = _failed(_run(resume=resume))[("ddp resume", "optimizer_state")]
    assert detail == "ranks 0-1: a.lora_A: state exp_avg, exp_avg_sq, step missing (and 2 more)"


def test_optimizer_state_value_and_device() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    opt = {n: dict(v) for n, v in resume[0].restored.optimizer.items()}  # type: ignore[union-attr]
    opt["head.weight"]["step"] = torch.tensor(0.0)
    devices = {n: dict(v) for n, v in resume[1].restored.optimizer_devices.items()}  # type: ignore[union-attr]
    devices["a.lora_A"]["exp_avg"] = "cuda:0"
    resume = _with_restored(_with_restored(resume, 0, optimizer=opt), 1, optimizer_devices=devices)
    detail = _failed(_run(resume=resume))[("ddp resume", "optimizer_state")]
    assert detail == (
        "rank 0: head.weight: state 'step' 0.0 (torch.float32) != saved 3.0 (torch.float32); "
        "rank 1: a.lora_A: state 'exp_avg' on cuda:0, saved on cpu"
    )


def test_scheduler_last_epoch_is_named() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    for rank in (0, 1):
        sched = dict(resume[rank].restored.scheduler)  # type: ignore[union-attr]
        sched["last_epoch"] = 0
        resume = _with_restored(resume, rank, scheduler=sched)
    assert _failed(_run(resume=resume)) == {
        ("ddp resume", "lr_scheduler"): "ranks 0-1: last_epoch 0 != saved 3"
    }


def test_param_group_hyperparameter_is_named() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    groups = ({**resume[0].restored.param_groups[0], "betas": (0.9, 0.99)},)  # type: ignore[union-attr]
    failed = _failed(_run(resume=_with_restored(resume, 0, param_groups=groups)))
    assert failed == {
        ("ddp resume", "param_groups"): "rank 0: group 0 'betas': (0.9, 0.99) != saved (0.9, 0.999)"
    }


def test_perturbed_trainable_is_named_and_departure_reported() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    weights = dict(resume[0].restored.trainables)  # type: ignore[union-attr]
    weights["a.lora_B"] = weights["a.lora_B"].clone()
    weights["a.lora_B"].view(-1)[0] += 1e-3
    resume = _with_step(_with_restored(resume, 0, trainables=weights), 0, 4, loss=0.123)
    result = judge_resume(_run(resume=resume))
    assert {(f.check, f.detail) for f in result.failed} == {
        ("trainables", "rank 0: 1 of 3 differ from the save, first a.lora_B")
    }
    assert result.departs == "step 4, rank 0: loss 0.123 != fit's 0.2"


def test_one_ulp_counts() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    weights = dict(resume[1].restored.trainables)  # type: ignore[union-attr]
    w = weights["head.weight"].clone()
    w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(math.inf))
    weights["head.weight"] = w
    failed = _failed(_run(resume=_with_restored(resume, 1, trainables=weights)))
    assert failed == {("ddp resume", "trainables"): "rank 1: 1 of 3 differ from the save, first head.weight"}


def test_frozen_and_loop() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    resume = _with_restored(
        resume, 0, frozen={"embed": "changed", "q.base": "d1"}, global_step=0, epochs_done=0
    )
    failed = _failed(_run(resume=resume))
    assert failed == {
        ("ddp resume", "frozen"): "rank 0: 1 of 2 frozen tensors differ from the save (embed)",
        ("ddp resume", "loop"): "rank 0: restored at global step 0, epoch 0; saved at global step 3, epoch 1",
    }


def test_first_loss_names_step_and_rank() -> None:
    resume = _with_step(_role("resume", steps=range(3, 6), restored_at=3), 1, 3, loss=0.5)
    failed = _failed(_run(resume=resume))
    assert failed == {("ddp resume", "first_loss"): "step 3: rank 1: 0.5 != killed fit's 0.26"}


def test_lr_of_every_step() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    for rank in (0, 1):
        resume = _with_step(resume, rank, 4, lr=0.01)
    failed = _failed(_run(resume=resume))
    assert failed == {("ddp resume", "lr"): "step 4: ranks 0-1: 0.01 != fit's 0.004"}


def test_rows_name_the_step() -> None:
    resume = _with_step(_role("resume", steps=range(3, 6), restored_at=3), 1, 5, rows=(0, 2))
    failed = _failed(_run(resume=resume))
    assert failed == {
        ("ddp resume", "rows"): "step 5: rank 1 trained other rows (rank 1: [0, 2] != fit's [21, 23])"
    }


def test_restarted_epoch_is_a_rows_failure() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    for rank in (0, 1):
        resume = _with_step(resume, rank, 3, epoch=1, batch=1)
    failed = _failed(_run(resume=resume))
    assert failed == {
        ("ddp resume", "rows"): "step 3: trained at epoch 1 batch 1, the fit at epoch 1 batch 0"
    }


def test_reload_compares_with_the_resume_final_save() -> None:
    reload = _role("reload", steps=range(0), restored_at=6)
    reload = tuple(dataclasses.replace(r, saves=()) for r in reload)
    reload = _with_restored(reload, 0, scheduler={"last_epoch": 3, "_step_count": 7, "_last_lr": [0.001]})
    failed = _failed(_run(reload=reload))
    assert failed == {("ddp reload", "lr_scheduler"): "rank 0: last_epoch 3 != saved 6"}


def test_reshard_compares_full_values_and_row_unions() -> None:
    reshard = _role("reshard", world=1, steps=range(3, 6), restored_at=3)
    reshard = tuple(
        dataclasses.replace(
            r,
            restored=dataclasses.replace(
                r.restored,  # type: ignore[arg-type]
                optimizer_devices={n: {"exp_avg": "cpu", "exp_avg_sq": "cpu", "step": "cpu"} for n in NAMES},
            ),
        )
        for r in reshard
    )
    result = judge_resume(_run(reshard=reshard))
    assert result.passed
    assert result.reshard_ranks == 1
    assert [a.label for a in result.arms] == ["ddp resume", "ddp reload", "ddp reshard 2->1"]
    broken = _with_step(reshard, 0, 4, rows=(16, 17, 18, 100))
    detail = _failed(_run(reshard=broken))[("ddp reshard 2->1", "rows")]
    assert detail == "step 4: the ranks together trained [16, 17, 18, 100], the fit [16, 17, 18, 19]"


def test_twin_that_differs_is_said() -> None:
    twin = _with_step(_role("twin"), 0, 2, loss=9.0)
    result = judge_resume(_run(twin=twin))
    assert result.passed
    assert result.twin == (
        "differs from the fit at step 2, rank 0: loss 9.0 != fit's 0.3333333333333333: a fault-free fit is not "
        "reproducible here"
    )


def test_rng_streams_reported_per_rank() -> None:
    resume = _with_step(_role("resume", steps=range(3, 6), restored_at=3), 1, 3, rng="other")
    result = judge_resume(_run(resume=resume))
    assert result.passed
    assert result.rng.startswith(
        "differ from the uninterrupted fit on rank 1 from step 3 (Lightning does not"
    )


def test_gaps_are_relative_to_the_fit() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    for rank in (0, 1):
        resume = _with_step(resume, rank, 5, loss=(1 / 6 + 0.01 * rank) * 1.5, pre_clip_norm=7.0 * 1.1)
    gaps = judge_resume(_run(resume=resume)).gaps[0]
    assert gaps.loss == pytest.approx(0.5)
    assert gaps.pre_clip_norm == pytest.approx(0.1)


def test_error_carries_the_result_and_attributes_the_fault() -> None:
    resume = _role("resume", steps=range(3, 6), restored_at=3)
    resume = tuple(dataclasses.replace(r, fault="reset-lr-scheduler") for r in resume)
    for rank in (0, 1):
        resume = _with_restored(
            resume, rank, scheduler={"last_epoch": 0, "_step_count": 1, "_last_lr": [0.01]}
        )
    run = dataclasses.replace(_run(resume=resume), fault="reset-lr-scheduler")
    result = judge_resume(run)
    error = ResumeError(result.report(), failed=result.failed, result=result)
    assert isinstance(error, AssertionFailure) and isinstance(error, AssertionError)
    assert isinstance(error.result, ResumeResult)
    assert "FAIL: lr_scheduler (fault reset-lr-scheduler)" in result.verdict_table()
    with expect_fault_rejected("reset-lr-scheduler", by="lr_scheduler") as rejection:
        raise error
    assert rejection.evidence.checks == ("lr_scheduler",)
    # The registry wants the per-step LR check to see it too (a real reset changes the next step's LR).
    with pytest.raises(FaultNotRejected, match="rejected by lr_scheduler, but by= requires lr among them"):
        with expect_fault_rejected("reset-lr-scheduler"):
            raise error


def test_checks_are_listed_in_order() -> None:
    assert RESUME_CHECKS == (
        "trainables",
        "optimizer_state",
        "param_groups",
        "lr_scheduler",
        "frozen",
        "loop",
        "first_loss",
        "lr",
        "rows",
    )


def test_missing_role_is_refused() -> None:
    run = _run()
    roles = dict(run.roles)
    del roles["killed"]
    with pytest.raises(
        SpriteUsageError, match=r"the resume run has no 'killed' role \(roles: fit, twin, resume, reload\)"
    ):
        judge_resume(dataclasses.replace(run, roles=roles))


def _trainer_like() -> Any:
    from types import SimpleNamespace

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    net[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=6)
    for _ in range(3):
        net(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    return SimpleNamespace(
        optimizers=[optimizer],
        lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)],
        lightning_module=net,
    )


def test_the_registry_planters_break_what_they_say() -> None:
    from pytest_sprite.planted_faults import PlantSite, plant

    site = PlantSite(arm="resume", rank=0, world_size=1, accumulate=1)
    trainer = _trainer_like()
    plant("dropped-optimizer-state", site).after_restore(trainer, site)
    assert len(trainer.optimizers[0].state) == 0

    trainer = _trainer_like()
    plant("reset-lr-scheduler", site).after_restore(trainer, site)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 0 and trainer.optimizers[0].param_groups[0]["lr"] == 0.01
    scheduler.step()
    assert scheduler.last_epoch == 1 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0085)

    trainer = _trainer_like()
    weight = trainer.lightning_module[1].weight
    before = weight.detach().clone()
    frozen = trainer.lightning_module[0].weight.detach().clone()
    plant("perturbed-weight", site).after_restore(trainer, site)
    assert (weight.detach() - before).flatten().tolist() == pytest.approx([1e-3, 0.0], abs=1e-6)
    assert torch.equal(trainer.lightning_module[0].weight, frozen)

    with pytest.raises(SpriteUsageError, match="fault 'perturbed-weight' applies to arms resume, not 'ddp'"):
        plant("perturbed-weight", PlantSite(arm="ddp", rank=0, world_size=2, accumulate=1))


# -------------------------------------------------------------------------------------------------------
# the stored run: round trip, storage beside the checkpoints or under --sprite-artifacts, judged again


def _identical(a: Any, b: Any, where: str = "run") -> None:
    """Fail unless ``a`` and ``b`` are the same value of the same type, tensors and floats bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, float):
        assert a.hex() == b.hex() or (math.isnan(a) and math.isnan(b)), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _identical(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _identical(a[k], b[k], f"{where}[{k!r}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _identical(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _odd_run() -> ResumeRun:
    """A run holding what a round trip could lose: nan, inf, -0.0, a float64 tensor, tuples in param groups."""
    run = _run()
    fit = _with_step(run.roles["fit"], 1, 5, loss=math.nan, pre_clip_norm=math.inf)
    odd = torch.tensor([math.nan, -math.inf, -0.0, 5e-324], dtype=torch.float64)
    resume = _with_restored(
        run.roles["resume"],
        0,
        trainables={**run.roles["resume"][0].restored.trainables, "odd": odd},  # type: ignore[union-attr]
    )
    return dataclasses.replace(
        run, roles={**run.roles, "fit": fit, "resume": resume}, timings={"fit": (1.5, 0.25)}, directory="/ck"
    )


def test_a_run_round_trips_exactly_through_a_weights_only_file(tmp_path: Any) -> None:
    from pytest_sprite.recipes.artifacts import load_resume_run, write_resume_run

    run = _odd_run()
    path = write_resume_run(run, tmp_path, fresh=False)
    assert path == tmp_path / "resume-run.pt"
    back = load_resume_run(path)  # torch.load(weights_only=True) inside
    assert back.source == str(path)
    _identical(dataclasses.replace(back, source=None), run)
    _identical(ResumeRun.from_dict(run.to_dict()), run)
    assert isinstance(back.roles["resume"][0].restored.param_groups[0]["betas"], tuple)  # type: ignore[union-attr]
    assert judge_resume(back).to_dict() == judge_resume(run).to_dict()
    # Beside checkpoints nothing is overwritten: a second run stored there gets the next name.
    assert write_resume_run(run, tmp_path, fresh=False) == tmp_path / "resume-run-02.pt"


def test_a_file_of_another_format_or_kind_is_refused(tmp_path: Any) -> None:
    from pytest_sprite.recipes.artifacts import load_resume_run

    data = _run().to_dict()
    with pytest.raises(
        SpriteUsageError, match=r"this is not a resume run of format 1 \(format 2, kind 'resume'\)"
    ):
        ResumeRun.from_dict({**data, "format": 2})
    torch.save({"format": 1, "arm": "single"}, tmp_path / "resume-run.pt")  # an arm record
    with pytest.raises(
        SpriteUsageError,
        match=rf"{tmp_path / 'resume-run.pt'}: this is not a resume run of format 1 \(format 1, kind None\); "
        "judge it with the pytest-sprite version that wrote it",
    ):
        load_resume_run(tmp_path)
    with pytest.raises(SpriteUsageError, match=r"no resume run at .*nothing\.pt; pass the resume-run.pt"):
        load_resume_run(tmp_path / "nothing.pt")


class _Roles:
    """A recipe whose roles are a prepared run (no processes): what resume_roles stores, the assertion lists."""

    def __init__(self, run: ResumeRun, monkeypatch: pytest.MonkeyPatch, artifacts: Any = None) -> None:
        self.run = run
        self.artifacts = artifacts
        self.calls = 0
        monkeypatch.setattr("pytest_sprite.recipes.resume_roles.run_resume_roles", self._roles)

    def _roles(self, *_: Any, directory: str, **__: Any) -> ResumeRun:
        self.calls += 1
        return dataclasses.replace(self.run, directory=directory)

    def resume_roles(self, **kw: Any) -> ResumeRun:
        from pytest_sprite.recipes.resume_roles import resume_roles

        return resume_roles(self, **kw, world=None, artifacts=self.artifacts)


def test_the_assertion_stores_the_run_beside_its_checkpoints_and_judge_agrees(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import shutil

    from pytest_sprite.assertions.resume import assert_resume_bitexact
    from pytest_sprite.report.rejudge import judge_directory

    checkpoints = tmp_path / "ck"
    result = assert_resume_bitexact(
        _Roles(dataclasses.replace(_run(), strategy="single"), monkeypatch),
        strategy="single",
        directory=checkpoints,
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["resume-01.assertion.json", "resume-run.pt"]
    manifest = json.loads((checkpoints / "resume-01.assertion.json").read_text())
    assert manifest["inputs"] == ["resume-run.pt"] and manifest["result"] == result.to_dict()

    shutil.copytree(checkpoints, tmp_path / "copy")
    [judged] = judge_directory(tmp_path / "copy")
    assert judged.result == result.to_dict() and not judged.failed and judged.changed == []

    # The stored resume's first loss edited: the copy is judged FAIL on that row, and only that row.
    data = torch.load(tmp_path / "copy" / "resume-run.pt", weights_only=True)
    first = data["roles"]["resume"][1]["steps"][0]
    first["loss"] = math.nextafter(first["loss"], math.inf)
    torch.save(data, tmp_path / "copy" / "resume-run.pt")
    [judged] = judge_directory(tmp_path / "copy")
    assert judged.failed and judged.changed == ["single resume: pass -> FAIL"]
    assert [f["check"] for f in judged.result["arms"][0]["failed"]] == ["first_loss"]

    # A second check into the same checkpoint directory stores beside the first, overwriting nothing.
    assert_resume_bitexact(
        _Roles(dataclasses.replace(_run(), strategy="single"), monkeypatch),
        strategy="single",
        directory=checkpoints,
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "resume-01.assertion.json",
        "resume-02.assertion.json",
        "resume-run-02.pt",
        "resume-run.pt",
    ]
    assert json.loads((checkpoints / "resume-02.assertion.json").read_text())["inputs"] == [
        "resume-run-02.pt"
    ]


def test_under_artifacts_an_existing_result_is_refused_before_any_role_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_sprite.assertions.resume import assert_resume_bitexact
    from pytest_sprite.recipes.artifacts import ArtifactDir, ArtifactExistsError

    run = dataclasses.replace(_run(), strategy="single")
    art = ArtifactDir.for_test(tmp_path / "art", "t.py::test")
    assert_resume_bitexact(_Roles(run, monkeypatch, art), strategy="single", directory=tmp_path / "ck")
    stored = tmp_path / "art" / "t.py__test" / "01-resume-single"
    assert sorted(p.name for p in stored.iterdir()) == ["resume-01.assertion.json", "resume-run.pt"]
    assert list((tmp_path / "ck").iterdir()) == []  # stored under --sprite-artifacts only

    again = _Roles(run, monkeypatch, ArtifactDir.for_test(tmp_path / "art", "t.py::test"))
    with pytest.raises(
        ArtifactExistsError, match=r"01-resume-single already exists, and an arm never overwrites"
    ):
        assert_resume_bitexact(again, strategy="single", directory=tmp_path / "ck2")
    assert again.calls == 0


def _gather_both_ways(world: Any) -> bool:
    """``gather_shards`` against ``gather_object``, on shards of uneven length and of four dtypes."""
    torch.manual_seed(world.rank)
    local = [
        torch.randn(world.rank + 1, 3),
        torch.arange(5 - world.rank, dtype=torch.int64),
        torch.randn(world.rank, 2).to(torch.bfloat16),  # rank 0's shard is empty
        torch.tensor([True, False, True])[: world.rank + 1],
    ]
    got = gather_shards(local, world.size)
    expected = world.gather_object(local)
    return all(
        got[k][r].dtype == expected[r][k].dtype and torch.equal(got[k][r], expected[r][k])
        for k in range(len(local))
        for r in range(world.size)
    )


def test_capture_gathers_every_rank_s_shards_bit_for_bit_in_tensor_collectives() -> None:
    assert run_subworld(_gather_both_ways, ranks=3).values() == [True, True, True]
