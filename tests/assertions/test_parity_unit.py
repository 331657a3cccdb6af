"""assert_parity on synthetic arm records: every check, every refusal, the table, without processes."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pytest_sprite import (  # noqa: E402
    ArmRecord,
    ParityError,
    ParityRefused,
    ParityResult,
    RecipeIdentity,
    assert_parity,
    tensor_digest,
)
from pytest_sprite.assertions.tables import format_figure, format_limit, render_table  # noqa: E402

pytestmark = pytest.mark.cpu

RECIPE = RecipeIdentity(
    model="tiny-qwen2:0123456789abcdef",
    seed=0,
    rows=8,
    rows_digest="d" * 64,
    seq_len=8,
    steps=2,
    global_batch=4,
    lr=1.0,
    clip=0.01,
)
# float64, so that planted relative errors are not hidden by float32 rounding of final = initial + update
INITIAL = {
    "a": torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64),
    "b": torch.tensor([0.5, -0.5, 0.25], dtype=torch.float64),
}
UPDATE = {
    "a": torch.tensor([[0.01, -0.02], [0.0, 0.005]], dtype=torch.float64),
    "b": torch.tensor([0.003, 0.0, -0.001], dtype=torch.float64),
}
FROZEN = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.ones(4)}
PRE = (3.0, 2.0)
POST = (0.01, 0.01)


def make_record(
    arm: str = "single",
    *,
    world_size: int = 1,
    pre: tuple[float, ...] = PRE,
    post: tuple[float, ...] = POST,
    pre_by_rank: dict[tuple[int, int], float] | None = None,
    update_scale: float = 1.0,
    rows: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
    fault: str | None = None,
    accumulate: int = 1,
    precision: str = "32-true",
    recipe: RecipeIdentity = RECIPE,
    digests: tuple[str, ...] | None = None,
    frozen_changed_on: dict[int, str] | None = None,
    initial_shift: float = 0.0,
) -> ArmRecord:
    """A record as an arm of RECIPE would produce it; keyword arguments plant one discrepancy each."""
    steps, batch = recipe.steps, recipe.global_batch
    if rows is None:
        rows = tuple(
            tuple(tuple(range(s * batch + r, (s + 1) * batch, world_size)) for r in range(world_size))
            for s in range(steps)
        )
    pre_by_rank = pre_by_rank or {}
    initial = {n: t + initial_shift for n, t in INITIAL.items()}
    final = {n: INITIAL[n] + update_scale * UPDATE[n] for n in INITIAL}
    frozen = {n: tensor_digest(t) for n, t in FROZEN.items()}
    frozen_final = [dict(frozen) for _ in range(world_size)]
    for rank, name in (frozen_changed_on or {}).items():
        frozen_final[rank][name] = tensor_digest(FROZEN[name] + 1)
    return ArmRecord(
        arm=arm,
        recipe=recipe,
        world_size=world_size,
        device_type="cpu",
        precision=precision,
        accumulate=accumulate,
        fault=fault,
        strategy={"single": "SingleDeviceStrategy", "ddp": "XPUDDPStrategy", "fsdp": "FSDP2Strategy"}[arm],
        trainable_names=tuple(INITIAL),
        frozen_names=tuple(FROZEN),
        pre_clip_norms=tuple(
            tuple(pre_by_rank.get((s, r), pre[s]) for r in range(world_size)) for s in range(steps)
        ),
        post_clip_norms=tuple(tuple(post[s] for _ in range(world_size)) for s in range(steps)),
        rows_seen=rows,
        initial_trainable=initial,
        final_trainable=final,
        final_trainable_digests=digests or tuple("x" for _ in range(world_size)),
        frozen_initial=frozen,
        frozen_final=tuple(frozen_final),
    )


REF = make_record()


def failed_checks(exc: pytest.ExceptionInfo[ParityError]) -> list[tuple[str, str]]:
    return [(f.arm, f.check) for f in exc.value.failed]


def test_identical_arms_pass_with_zero_figures() -> None:
    result = assert_parity(REF, make_record("ddp", world_size=2), make_record("fsdp", world_size=4))
    assert isinstance(result, ParityResult)
    assert result.passed
    assert [(a.label, a.ranks, a.global_batch) for a in result.arms] == [("ddp", 2, 4), ("fsdp", 4, 4)]
    assert all(
        (a.pre_norm_rel, a.post_norm_rel, a.update_rel_l2, a.frozen_changed, a.frozen_total)
        == (0, 0, 0, 0, 2)
        for a in result.arms
    )


def test_table_is_the_seeds_fp32_table() -> None:
    arm = make_record("ddp", world_size=4, pre_by_rank={(1, 3): 2.0 * (1 + 2.4e-6)}, update_scale=1 + 4.17e-6)
    result = assert_parity(REF, arm)
    assert result.table().splitlines() == [
        "Arm  Ranks  Global batch  Result  Pre-clip norm rel  Post-clip norm rel  Update rel L2  Frozen changed",
        "---  -----  ------------  ------  -----------------  ------------------  -------------  --------------",
        "ddp  4      4             pass    2.40e-6            0                   4.17e-6        0 of 2",
    ]
    assert result.report().splitlines()[0] == (
        "FP32 parity passed (rtol 1e-4; reference: single on 1 cpu device, global batch 4, 2 steps, seed 0, "
        "clip 0.01, lr 1)"
    )


@pytest.mark.parametrize(
    ("arm_kwargs", "check"),
    [
        ({"pre_by_rank": {(1, 1): 2.0 * (1 + 2e-4)}}, "pre_norm"),
        ({"post": (0.01, 0.01 * (1 - 3e-4))}, "post_norm"),
        ({"update_scale": 1.001}, "update"),
        ({"frozen_changed_on": {1: "n"}}, "frozen"),
        ({"digests": ("x", "y")}, "synchronized"),
        ({"initial_shift": 1e-7}, "initial"),
        ({"rows": (((0, 1), (0, 1)), ((4, 5), (4, 5)))}, "rows"),
        ({"pre_by_rank": {(0, 0): math.nan}}, "pre_norm"),
    ],
    ids=["pre_norm", "post_norm", "update", "frozen", "synchronized", "initial", "rows", "nan"],
)
def test_each_check_fails_alone(arm_kwargs: dict[str, Any], check: str) -> None:
    arm = make_record("ddp", world_size=2, **arm_kwargs)
    with pytest.raises(ParityError) as exc:
        assert_parity(REF, make_record("fsdp", world_size=2), arm)
    assert isinstance(exc.value, AssertionError)
    assert failed_checks(exc) == [("ddp", check)]
    result = exc.value.result
    assert [a.passed for a in result.arms] == [True, False]
    assert f"  ddp: {check}: " in str(exc.value)


def test_tolerance_is_relative_and_inclusive_of_small_errors() -> None:
    assert_parity(REF, make_record("ddp", world_size=2, pre_by_rank={(0, 1): 3.0 * (1 + 0.9e-4)}))
    with pytest.raises(ParityError):
        assert_parity(REF, make_record("ddp", world_size=2, pre_by_rank={(0, 1): 3.0 * (1 + 1.1e-4)}))
    # A looser rtol is the caller's explicit choice, not a default.
    assert_parity(REF, make_record("ddp", world_size=2, pre_by_rank={(0, 1): 3.0 * (1 + 1.1e-4)}), rtol=2e-4)


def test_failure_message_names_step_rank_values_and_limit() -> None:
    arm = make_record("ddp", world_size=2, fault="missing-rank", pre_by_rank={(1, 1): 1.5})
    with pytest.raises(ParityError) as exc:
        assert_parity(REF, arm)
    text = str(exc.value)
    assert text.splitlines()[0].startswith(
        "FP32 parity failed: 1 of 1 arms (rtol 1e-4; reference: single on 1 cpu"
    )
    assert "ddp (fault missing-rank)  2      4             FAIL    0.25 " in text
    assert (
        "  ddp (fault missing-rank): pre_norm: step 1, rank 1: 1.5 against reference 2, rel 0.25 > rtol 1e-4"
        in text.splitlines()
    )
    assert exc.value.failed[0].fault == "missing-rank"


def test_rows_failure_explains_the_duplicate_rows() -> None:
    arm = make_record("ddp", world_size=2, rows=(((0, 1), (0, 1)), ((4, 5), (4, 5))))
    with pytest.raises(ParityError) as exc:
        assert_parity(REF, arm)
    (detail,) = [f.detail for f in exc.value.failed]
    assert detail == (
        "step 0: trained 4 rows, the reference 4 (0, 1, 2, 3); rows read by more than one rank: 0, 1; "
        "rows no rank read: 2, 3; every rank read the same rows: the sampler ignores the rank"
    )


def test_frozen_column_counts_tensors_changed_on_any_rank() -> None:
    arm = make_record("ddp", world_size=2, frozen_changed_on={0: "w", 1: "n"})
    with pytest.raises(ParityError) as exc:
        assert_parity(REF, arm)
    assert exc.value.result.arms[0].row()[-1] == "2 of 2"


def test_unsynchronized_replicas_name_the_rank_groups() -> None:
    arm = make_record("ddp", world_size=4, digests=("x", "y", "y", "y"))
    with pytest.raises(ParityError) as exc:
        assert_parity(REF, arm)
    assert "rank 0 | ranks 1-3 hold different values" in exc.value.failed[0].detail


def test_result_serializes_to_json() -> None:
    arm = make_record("ddp", world_size=2, pre_by_rank={(0, 0): math.inf})
    with pytest.raises(ParityError) as exc:
        assert_parity(REF, arm)
    data = json.loads(json.dumps(exc.value.result.to_dict()))
    assert data["kind"] == "parity" and data["passed"] is False
    assert data["arms"][0]["pre_norm_rel"] == "inf"
    assert data["arms"][0]["failed"][0]["check"] == "pre_norm"


def test_accumulated_arm_is_labelled() -> None:
    result = assert_parity(REF, make_record("fsdp", world_size=2, accumulate=2))
    assert result.arms[0].label == "fsdp (accumulate 2)"


@pytest.mark.parametrize(
    ("ref", "arms", "message"),
    [
        (
            None,
            (make_record("ddp", world_size=2),),
            "assert_parity needs the single-device reference first, got None",
        ),
        (REF, (), "assert_parity needs at least one arm to compare with the reference"),
        (
            make_record("ddp", world_size=2),
            (make_record("ddp", world_size=2),),
            "the reference must be the 'single' arm on 1 device, got 'ddp' on 2",
        ),
        (REF, (make_record("ddp", world_size=1),), "arm 'ddp' is distributed but ran on 1 device"),
        (REF, (make_record("fsdp", world_size=1),), "arm 'fsdp' is distributed but ran on 1 device"),
        (
            REF,
            (make_record("ddp", world_size=2, recipe=dataclasses.replace(RECIPE, seed=1)),),
            "arm 'ddp' ran a different recipe than the reference (seed: 0 != 1; reference first)",
        ),
        (
            REF,
            (make_record("ddp", world_size=2, recipe=dataclasses.replace(RECIPE, rows_digest="e" * 64)),),
            "arm 'ddp' ran a different recipe than the reference (rows_digest:",
        ),
        (
            REF,
            (
                make_record(
                    "ddp", world_size=2, recipe=dataclasses.replace(RECIPE, steps=2, global_batch=8, rows=16)
                ),
            ),
            "arm 'ddp' ran a different recipe than the reference (rows: 8 != 16; global_batch: 4 != 8; reference",
        ),
        (
            REF,
            (make_record("ddp", world_size=2, precision="bf16-mixed"),),
            "assert_parity is the FP32 check: arm 'ddp' ran precision='bf16-mixed', allowed: '32-true'",
        ),
        (
            make_record(fault="wrong-scale"),
            (make_record("ddp", world_size=2),),
            "the reference must be clean",
        ),
        (
            make_record(pre=(3.0, 0.005)),
            (make_record("ddp", world_size=2),),
            "the clip is not active in the reference at step 1: pre-clip norm 0.005 <= clip 0.01",
        ),
        (
            REF,
            (make_record(),),
            "arm 'single' ran on 1 device with the reference's own configuration (strategy SingleDeviceStrategy, "
            "precision 32-true, accumulate 1): it is the reference run again and proves nothing about distributed "
            'training, whose arms must have run on more than one device; compare lora_qwen.run("ddp") or '
            'lora_qwen.run("fsdp") from a test marked @pytest.mark.ranks(n) with n >= 2, or a one-device arm of '
            "another configuration (strategy=, precision= or accumulate=)",
        ),
        (
            REF,
            (make_record("ddp", world_size=2), REF),
            "arm 'single' ran on 1 device with the reference's own configuration",
        ),
        (
            REF,
            ("not a record",),
            "arm 1 must be an ArmRecord (from lora_qwen.run(...) or load_arm_record), got str",
        ),
    ],
    ids=[
        "no-reference",
        "no-arms",
        "reference-not-single",
        "ddp-on-one-device",
        "fsdp-on-one-device",
        "other-seed",
        "other-rows",
        "other-batch",
        "bf16",
        "faulted-reference",
        "inactive-clip",
        "reference-as-arm",
        "reference-itself-as-second-arm",
        "not-a-record",
    ],
)
def test_refusals_are_errors_not_failures(ref: Any, arms: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ParityRefused) as exc:
        assert_parity(ref, *arms)
    assert not isinstance(exc.value, AssertionError)
    assert message in str(exc.value)


@pytest.mark.parametrize("rtol", [0, -1e-4, 1, math.nan, "1e-4", True])
def test_bad_rtol_is_refused(rtol: Any) -> None:
    with pytest.raises(
        ParityRefused, match=r"rtol must be a number in \(0, 1\), got .*; the FP32 parity rule uses"
    ):
        assert_parity(REF, make_record("ddp", world_size=2), rtol=rtol)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0"),
        (2.40e-6, "2.40e-6"),
        (1.0e-12, "1.00e-12"),
        (3.37e-3, "3.37e-3"),
        (0.0124, "0.0124"),
        (0.238, "0.238"),
        (3.0, "3"),
        (11.06, "11.1"),
        (47.5, "47.5"),
        (math.inf, "inf"),
        (math.nan, "nan"),
    ],
)
def test_figures_are_formatted_as_in_the_seed(value: float, text: str) -> None:
    assert format_figure(value) == text


@pytest.mark.parametrize(
    ("value", "text"), [(1e-4, "1e-4"), (2.5e-3, "2.5e-3"), (0.05, "0.05"), (1e-12, "1e-12")]
)
def test_limits_are_formatted_as_written(value: float, text: str) -> None:
    assert format_limit(value) == text


def test_table_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match=r"table row 0 has 1 cells, the header has 2: \['x'\]"):
        render_table(["a", "b"], [["x"]])


def test_record_round_trips_through_its_dict() -> None:
    rec = make_record("ddp", world_size=2, fault="wrong-scale")
    back = ArmRecord.from_dict(rec.to_dict())
    assert back.summary() == rec.summary()
    assert all(torch.equal(back.final_trainable[n], rec.final_trainable[n]) for n in rec.trainable_names)
    assert_parity(REF, back)


def test_inconsistent_record_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"pre_clip_norms has 1 steps, the recipe has 2"):
        dataclasses.replace(REF, pre_clip_norms=((3.0,),))


def test_one_device_arm_of_another_configuration_is_compared() -> None:
    """Accumulation or another strategy on one device is a real comparison, not the reference again."""
    assert assert_parity(REF, make_record(accumulate=2)).passed
    assert assert_parity(REF, dataclasses.replace(make_record(), strategy="mine.OtherSingle")).passed


def test_user_strategy_is_named_in_the_label() -> None:
    arm = dataclasses.replace(
        make_record("ddp", world_size=2, fault="wrong-scale"), strategy="mine.SummedDDP"
    )
    assert arm.label == "ddp (SummedDDP, fault wrong-scale)"
    assert make_record("ddp", world_size=2).label == "ddp"
