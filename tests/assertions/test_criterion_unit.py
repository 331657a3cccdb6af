"""assert_criterion_v2 on synthetic BF16 records: thresholds, gate, invariants, verdict, refusals, tables."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pytest_sprite.assertions.criterion_v2 import (  # noqa: E402
    ABS_FLOOR,
    CRITERION_INVARIANTS,
    EPS_FP32,
    RTOL,
    CriterionError,
    CriterionRefused,
    CriterionResult,
    assert_criterion_v2,
    tensor_gap,
)
from pytest_sprite.assertions.expect_fault import expect_fault_rejected  # noqa: E402
from pytest_sprite.errors import SpriteUsageError  # noqa: E402
from pytest_sprite.records import (  # noqa: E402
    BF16_ARMS,
    Bf16ArmRecord,
    Bf16StepRecord,
    CommConfig,
    LinearCall,
    RankStep,
    RecipeIdentity,
    tensor_digest,
)

pytestmark = pytest.mark.cpu

STEPS = 2
CLIP = 0.01
SITES = (
    ("layer.q.base_layer", "backbone"),
    ("layer.q.lora_A", "lora_A"),
    ("layer.q.lora_B", "lora_B"),
    ("head", "head"),
)
SHAPES = {"a": (3, 4), "b": (4,), "head": (2, 3)}
FROZEN = {"w": torch.arange(6.0).reshape(2, 3)}


def recipe(n: int) -> RecipeIdentity:
    return RecipeIdentity(
        model="tiny-qwen2:0123456789abcdef",
        seed=0,
        rows=STEPS * 2 * n,
        rows_digest="d" * 64,
        seq_len=8,
        steps=STEPS,
        global_batch=2 * n,
        lr=1.0,
        clip=CLIP,
    )


def _base(initial_scale: float = 1.0) -> tuple[dict[str, Any], list[dict[str, Any]], list[float]]:
    gen = torch.Generator().manual_seed(0)
    # float64 weights, so that planted update differences are not hidden by float32 rounding of the endpoints
    initial = {
        k: initial_scale * torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()
    }
    grads = [{k: torch.randn(s, generator=gen) for k, s in SHAPES.items()} for _ in range(STEPS)]
    pre = [math.sqrt(sum(float((g.double() ** 2).sum()) for g in step.values())) for step in grads]
    return initial, grads, pre


def make_arms(n: int = 2, *, initial_scale: float = 1.0) -> dict[str, Bf16ArmRecord]:
    """Six clean arms of a two-step run that criterion v2 passes: every arm saw the same numbers."""
    initial, grads, pre = _base(initial_scale)
    params: list[dict[str, Any]] = []
    prev = initial
    for s in range(STEPS):
        coef = CLIP / pre[s]
        prev = {k: prev[k] - coef * grads[s][k].double() for k in SHAPES}
        params.append(prev)
    frozen_digests = {k: tensor_digest(t) for k, t in FROZEN.items()}
    initial_digests = {**{k: tensor_digest(t) for k, t in initial.items()}, **frozen_digests}
    batch = 2 * n
    arms = {}
    for arm in BF16_ARMS:
        single = arm in ("ref32", "ref", "split", "split_premul")
        world = 1 if single else n
        fp32 = arm == "ref32"
        calls = tuple(
            LinearCall(
                site=site,
                kind=kind,
                output_dtype="torch.float32" if fp32 else "torch.bfloat16",
                param_dtype="torch.float32",
                autocast=not fp32,
                autocast_dtype=None if fp32 else "torch.bfloat16",
            )
            for site, kind in SITES
        )
        if single:
            comm = CommConfig(strategy="none")
        elif arm == "ddp":
            comm = CommConfig(strategy="ddp", reducer_dtype="torch.float32")
        else:
            comm = CommConfig(strategy="fsdp")
        steps = []
        for s in range(STEPS):
            rows = tuple(range(s * batch, (s + 1) * batch))
            shards = (rows,) if arm in ("ref32", "ref") else tuple(rows[r::n] for r in range(n))
            rank = RankStep(
                pre_clip_norm=pre[s],
                post_clip_norm=CLIP,
                grad_dtypes={k: "torch.float32" for k in SHAPES},
                grad_digests={k: tensor_digest(g) for k, g in grads[s].items()},
                param_digests={k: tensor_digest(p) for k, p in params[s].items()},
                frozen_digests=frozen_digests,
                param_sharded={k: True for k in SHAPES} if arm == "fsdp" else None,
                grad_sharded={k: True for k in SHAPES} if arm == "fsdp" else None,
                linear=calls,
            )
            steps.append(
                Bf16StepRecord(
                    rows=shards, grads=dict(grads[s]), params=dict(params[s]), ranks=(rank,) * world
                )
            )
        arms[arm] = Bf16ArmRecord(
            arm=arm,
            recipe=recipe(n),
            world_size=world,
            shards=n,
            device_type="cpu",
            precision="32-true" if fp32 else "bf16-mixed",
            tf32=False,
            fault=None,
            strategy="SingleDeviceStrategy" if single else arm,
            trainable_names=tuple(SHAPES),
            frozen_names=tuple(FROZEN),
            linear_sites=tuple(site for site, _ in SITES),
            initial_trainable=dict(initial),
            initial_digests=(initial_digests,) * world,
            comm=(comm,) * world,
            steps=tuple(steps),
        )
    return arms


def edit_step(rec: Bf16ArmRecord, s: int, **changes: Any) -> Bf16ArmRecord:
    steps = list(rec.steps)
    steps[s] = dataclasses.replace(steps[s], **changes)
    return dataclasses.replace(rec, steps=tuple(steps))


def edit_rank(rec: Bf16ArmRecord, s: int, r: int, **changes: Any) -> Bf16ArmRecord:
    ranks = list(rec.steps[s].ranks)
    ranks[r] = dataclasses.replace(ranks[r], **changes)
    return edit_step(rec, s, ranks=tuple(ranks))


def with_grad(rec: Bf16ArmRecord, s: int, name: str, value: Any) -> Bf16ArmRecord:
    return edit_step(rec, s, grads={**rec.steps[s].grads, name: value})


def with_params(rec: Bf16ArmRecord, s: int, name: str, value: Any) -> Bf16ArmRecord:
    return edit_step(rec, s, params={**rec.steps[s].params, name: value})


def judge(arms: dict[str, Bf16ArmRecord]) -> CriterionResult:
    """The result, whether the assertion passed or raised."""
    try:
        return assert_criterion_v2(arms)
    except CriterionError as exc:
        assert isinstance(exc.result, CriterionResult)
        return exc.result


def failed_checks(result: CriterionResult) -> set[str]:
    return {f.check for f in result.failed}


def failed_invariants(result: CriterionResult) -> set[str]:
    return {i.name for i in result.invariants if not i.passed}


def direction(shape: tuple[int, ...], seed: int = 7) -> Any:
    d = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return d / d.norm()


# --- clean run ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_clean_arms_pass_with_every_table(n: int) -> None:
    result = assert_criterion_v2(make_arms(n))
    assert result.verdict == "pass" and result.passed and result.failed == ()
    assert result.gate.passed and all(c.passed for c in result.scored)
    assert all(i.passed for i in result.invariants) and len(result.invariants) == len(CRITERION_INVARIANTS)
    assert [c.role for c in result.scored] == ["ddp", "fsdp"] and result.ranks == n
    data = result.to_dict()
    assert data["kind"] == CriterionResult.kind == "criterion_v2"
    json.dumps(data)  # JSON-serializable as it stands
    report = result.report()
    for header in ("Pre-clip norm rel", "Max tensor gradient gap", "Update rel L2", "Max tensor update gap"):
        assert header in report
    assert "Invariant" in report and "Largest tensor gradient gap per step" in report
    # identical arms: every diagnostic gap is 0 and every gradient bitwise equal
    for pair in result.diagnostics.pairs:
        assert pair.max_gap == (0.0,) * STEPS and pair.equal_tensors == (len(SHAPES),) * STEPS
        assert pair.equal_fraction == (1.0,) * STEPS


# --- scored thresholds, just inside and just outside -----------------------------------------------------


@pytest.mark.parametrize(("factor", "passes"), [(0.99, True), (1.01, False)])
def test_pre_clip_norm_rel_limit_on_every_rank(factor: float, passes: bool) -> None:
    arms = make_arms(3)
    ref = arms["split"].steps[0].ranks[0].pre_clip_norm
    arms["fsdp"] = edit_rank(arms["fsdp"], 0, 2, pre_clip_norm=ref * (1 + factor * RTOL))
    result = judge(arms)
    assert result.passed is passes
    if not passes:
        assert failed_checks(result) == {"pre_norm"} and "rank 2" in result.failed[0].detail


@given(
    rel=st.floats(min_value=0.0, max_value=0.999 * RTOL) | st.floats(min_value=1.001 * RTOL, max_value=10.0)
)
@settings(max_examples=25, deadline=None)
def test_pre_clip_norm_property(rel: float) -> None:
    arms = make_arms(2)
    ref = arms["split"].steps[0].ranks[0].pre_clip_norm
    arms["ddp"] = edit_rank(arms["ddp"], 0, 1, pre_clip_norm=ref * (1 + rel))
    result = judge(arms)
    assert result.passed is (rel <= RTOL)
    assert ("pre_norm" in failed_checks(result)) is (rel > RTOL)


@pytest.mark.parametrize(("factor", "passes"), [(0.99, True), (1.01, False)])
def test_tensor_gradient_limit(factor: float, passes: bool) -> None:
    arms = make_arms(2)
    ref = arms["split"].steps[0].grads["a"]
    bound = RTOL * float(ref.double().norm()) + ABS_FLOOR * math.sqrt(ref.numel())
    planted = (ref.double() + factor * bound * direction(ref.shape)).float()
    realized = float((planted.double() - ref.double()).norm())
    assert (realized <= bound) is passes  # float32 storage kept the plant on its side of the bound
    arms["ddp"] = with_grad(arms["ddp"], 0, "a", planted)
    result = judge(arms)
    assert result.passed is passes
    if not passes:
        assert failed_checks(result) == {"gradients"}
        assert result.scored[0].gradients_over == 1 and result.scored[1].gradients_over == 0


@pytest.mark.parametrize(("factor", "passes"), [(0.9, True), (1.1, False)])
def test_gradient_additive_floor(factor: float, passes: bool) -> None:
    """A tensor whose reference gradient is zero may differ by 1e-12 * sqrt(numel), no more."""
    arms = make_arms(2)
    zero = torch.zeros(SHAPES["b"])
    for arm in ("split", "split_premul", "fsdp"):
        arms[arm] = with_grad(arms[arm], 0, "b", zero)
    floor = ABS_FLOOR * math.sqrt(zero.numel())
    planted = torch.full(SHAPES["b"], factor * floor / math.sqrt(zero.numel()), dtype=torch.float32)
    arms["ddp"] = with_grad(arms["ddp"], 0, "b", planted)
    result = judge(arms)
    assert result.passed is passes
    gap = next(g for g in result.scored[0].gradients if g.name == "b")
    assert gap.ref_norm == 0 and gap.floor == pytest.approx(floor)
    assert gap.gap == pytest.approx(factor, rel=1e-6)  # normalized by the floor, since the norm is 0
    if not passes:
        assert failed_checks(result) == {"gradients"}


@pytest.mark.parametrize(("factor", "passes"), [(0.99, True), (1.01, False)])
def test_update_rel_l2_limit(factor: float, passes: bool) -> None:
    arms = make_arms(2)
    split = arms["split"]
    update = split.step_update(0)
    planted = arms["ddp"]
    for k in SHAPES:  # proportional, so each tensor's own (floored) bound is not reached first
        planted = with_params(planted, 0, k, split.steps[0].params[k] + factor * RTOL * update[k])
    arms["ddp"] = planted
    result = judge(arms)
    assert result.passed is passes
    assert result.scored[0].update_rel_l2 == pytest.approx(factor * RTOL, rel=1e-6)
    if not passes:
        assert failed_checks(result) == {"update"}


def _tensor_update_plant(arms: dict[str, Bf16ArmRecord], diff: float) -> None:
    split = arms["split"]
    arms["ddp"] = with_params(
        arms["ddp"], 0, "head", split.steps[0].params["head"] + diff * direction(SHAPES["head"], seed=3)
    )


@pytest.mark.parametrize(("factor", "passes"), [(0.99, True), (1.01, False)])
def test_tensor_update_limit_with_endpoint_term(factor: float, passes: bool) -> None:
    arms = make_arms(2)
    split = arms["split"]
    u = split.step_update(0)["head"]
    init = split.initial_trainable["head"]
    bound = RTOL * float(u.norm()) + ABS_FLOOR * math.sqrt(u.numel()) + 2 * EPS_FP32 * float(init.norm())
    _tensor_update_plant(arms, factor * bound)
    result = judge(arms)
    assert result.passed is passes
    gap = next(g for g in result.scored[0].updates if g.name == "head")
    assert gap.bound == pytest.approx(bound, rel=1e-12)
    if not passes:
        assert failed_checks(result) == {"tensor_updates"}


@pytest.mark.parametrize(("endpoint_share", "passes"), [(0.9, True), (1.1, False)])
def test_endpoint_term_scales_with_the_initial_norm(endpoint_share: float, passes: bool) -> None:
    """A difference within 1e-3*norm + floor + share*2*eps*norm(initial) passes only while share <= 1."""
    # large enough that the endpoint term matters, small enough that the whole-update rel L2 stays within 1e-3
    arms = make_arms(2, initial_scale=4.0)
    split = arms["split"]
    u = split.step_update(0)["head"]
    init = split.initial_trainable["head"]
    endpoint = 2 * EPS_FP32 * float(init.norm())
    assert endpoint > 0.2 * RTOL * float(u.norm())  # a plant within 10% of it is told apart
    _tensor_update_plant(
        arms, RTOL * float(u.norm()) + ABS_FLOOR * math.sqrt(u.numel()) + endpoint_share * endpoint
    )
    result = judge(arms)
    assert result.passed is passes
    if not passes:
        assert failed_checks(result) == {"tensor_updates"}


@given(
    ref_scale=st.floats(min_value=1e-8, max_value=1e3),
    init_scale=st.floats(min_value=0.0, max_value=1e4),
    k=st.floats(min_value=0.0, max_value=0.999) | st.floats(min_value=1.001, max_value=1e3),
    numel=st.integers(min_value=1, max_value=64),
    with_initial=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_tensor_gap_bound_property(
    ref_scale: float, init_scale: float, k: float, numel: int, with_initial: bool
) -> None:
    """over <=> diff > 1e-3*|ref| + 1e-12*sqrt(numel) (+ 2*eps_fp32*|initial| for updates), for any size."""
    gen = torch.Generator().manual_seed(numel)
    ref = ref_scale * torch.randn(numel, generator=gen, dtype=torch.float64)
    initial = init_scale * torch.randn(numel, generator=gen, dtype=torch.float64) if with_initial else None
    bound = RTOL * float(ref.norm()) + ABS_FLOOR * math.sqrt(numel)
    if initial is not None:
        bound += 2 * EPS_FP32 * float(initial.norm())
    value = ref + k * bound * direction((numel,), seed=numel + 1)
    gap = tensor_gap("t", value, ref, initial=initial)
    assert gap.bound == pytest.approx(bound, rel=1e-12)
    assert gap.over is (k > 1)
    assert gap.gap == pytest.approx(gap.diff / max(gap.ref_norm, gap.floor)) if gap.diff else gap.gap == 0


def test_nan_and_shape_mismatch_are_over() -> None:
    ref = torch.ones(3)
    assert tensor_gap("t", torch.tensor([1.0, math.nan, 1.0]), ref).over
    assert tensor_gap("t", torch.ones(4), ref).over


# --- gate and verdict precedence ------------------------------------------------------------------------


def _break_gate(arms: dict[str, Bf16ArmRecord]) -> None:
    ref = arms["split"].steps[0].grads["a"]
    arms["split_premul"] = with_grad(arms["split_premul"], 0, "a", ref * 1.5)


def _break_scored(arms: dict[str, Bf16ArmRecord]) -> None:
    ref = arms["split"].steps[0].grads["a"]
    arms["ddp"] = with_grad(arms["ddp"], 0, "a", ref * 2)


def _break_invariant(arms: dict[str, Bf16ArmRecord]) -> None:
    arms["ref"] = edit_rank(arms["ref"], 1, 0, grad_nonfinite=("a",))


def test_gate_failure_alone_is_void_and_raises() -> None:
    arms = make_arms(2)
    _break_gate(arms)
    with pytest.raises(CriterionError) as info:
        assert_criterion_v2(arms)
    result = info.value.result
    assert result.verdict == "void" and not result.passed
    assert "void" in str(info.value) and "gate" in str(info.value)
    assert [f.check for f in info.value.failed] == ["gate"] and info.value.failed[0].fault is None
    assert not result.gate.passed and all(c.passed for c in result.scored)


def test_void_takes_precedence_over_a_scored_failure() -> None:
    arms = make_arms(2)
    _break_gate(arms)
    _break_scored(arms)
    result = judge(arms)
    assert result.verdict == "void"
    assert not result.scored[0].passed  # still computed and shown


def test_an_invariant_failure_takes_precedence_over_void() -> None:
    arms = make_arms(2)
    _break_gate(arms)
    _break_scored(arms)
    _break_invariant(arms)
    result = judge(arms)
    assert result.verdict == "fail" and failed_checks(result) == {"grads"}


def test_scored_failure_with_a_good_gate_is_fail() -> None:
    arms = make_arms(2)
    _break_scored(arms)
    result = judge(arms)
    assert result.verdict == "fail" and failed_checks(result) == {"gradients"}


# --- each invariant failing alone ----------------------------------------------------------------------


def _plant(
    arm: str, edit: Callable[[Bf16ArmRecord], Bf16ArmRecord]
) -> Callable[[dict[str, Bf16ArmRecord]], None]:
    def apply(arms: dict[str, Bf16ArmRecord]) -> None:
        arms[arm] = edit(arms[arm])

    return apply


def _bf16_call(site: str, kind: str, **changes: Any) -> LinearCall:
    base = LinearCall(
        site=site,
        kind=kind,
        output_dtype="torch.bfloat16",
        param_dtype="torch.float32",
        autocast=True,
        autocast_dtype="torch.bfloat16",
    )
    return dataclasses.replace(base, **changes)


def _other_digest(mapping: Any, key: str) -> dict[str, str]:
    return {**mapping, key: "0" * 64}


INVARIANT_PLANTS: dict[str, list[Callable[[dict[str, Bf16ArmRecord]], None]]] = {
    "metadata": [
        _plant("ref32", lambda r: dataclasses.replace(r, tf32=True)),
        _plant("split", lambda r: dataclasses.replace(r, shards=3)),
        _plant("fsdp", lambda r: dataclasses.replace(r, device_type="cuda")),
    ],
    "steps": [_plant("ddp", lambda r: dataclasses.replace(r, steps=r.steps[:1]))],
    "initial": [
        _plant(
            "ddp",
            lambda r: dataclasses.replace(
                r, initial_digests=(r.initial_digests[0], _other_digest(r.initial_digests[1], "a"))
            ),
        ),
        _plant(
            "ref",
            lambda r: dataclasses.replace(
                r,
                initial_trainable={
                    **r.initial_trainable,
                    "b": r.initial_trainable["b"].float().double() + 1e-9,
                },
            ),
        ),
    ],
    "frozen": [
        _plant(
            "fsdp",
            lambda r: edit_rank(
                r, 1, 1, frozen_digests=_other_digest(r.steps[1].ranks[1].frozen_digests, "w")
            ),
        )
    ],
    "comm": [
        _plant(
            "ddp",
            lambda r: dataclasses.replace(
                r, comm=(r.comm[0], CommConfig(strategy="ddp", reducer_dtype="torch.bfloat16"))
            ),
        ),
        _plant(
            "ddp",
            lambda r: dataclasses.replace(
                r, comm=(r.comm[0], dataclasses.replace(r.comm[1], comm_hook="bf16_compress"))
            ),
        ),
        _plant(
            "fsdp",
            lambda r: dataclasses.replace(
                r, comm=(CommConfig(strategy="fsdp", reduce_dtype="torch.bfloat16"),) * 2
            ),
        ),
    ],
    "clip": [
        _plant("ref", lambda r: edit_rank(r, 1, 0, post_clip_norm=CLIP * (1 + 1.1e-4))),
        _plant("ddp", lambda r: edit_rank(r, 1, 1, pre_clip_norm=CLIP * 0.5, post_clip_norm=CLIP * 0.5)),
    ],
    "grads": [
        _plant("split", lambda r: edit_rank(r, 1, 0, grad_nonfinite=("a",))),
        _plant("ddp", lambda r: edit_rank(r, 1, 1, grad_dtypes={"a": "torch.float32", "b": "torch.float32"})),
        _plant(
            "fsdp",
            lambda r: edit_rank(
                r, 0, 1, grad_dtypes={**r.steps[0].ranks[1].grad_dtypes, "b": "torch.bfloat16"}
            ),
        ),
        _plant("ref32", lambda r: with_grad(r, 1, "head", r.steps[1].grads["head"].double())),
    ],
    "dtype": [
        _plant(
            "ddp",
            lambda r: edit_rank(
                r,
                0,
                1,
                linear=(
                    _bf16_call(
                        "layer.q.base_layer", "backbone", output_dtype="torch.float32", autocast=False
                    ),
                    *r.steps[0].ranks[1].linear[1:],
                ),
            ),
        ),
        _plant("split", lambda r: edit_rank(r, 1, 0, linear=r.steps[1].ranks[0].linear[:-1])),
        _plant(
            "ref",
            lambda r: edit_rank(
                r,
                0,
                0,
                linear=(
                    *r.steps[0].ranks[0].linear,
                    _bf16_call("head", "head", param_dtype="torch.bfloat16"),
                ),
            ),
        ),
        _plant(
            "ref32",
            lambda r: edit_rank(
                r, 1, 0, linear=(*r.steps[1].ranks[0].linear[:-1], _bf16_call("head", "head"))
            ),
        ),
    ],
    "rows": [
        _plant("split", lambda r: edit_step(r, 0, rows=tuple(reversed(r.steps[0].rows)))),
        _plant("ddp", lambda r: edit_step(r, 1, rows=(r.steps[1].rows[0], r.steps[1].rows[0]))),
        _plant("ref", lambda r: edit_step(r, 1, rows=(tuple(sorted(r.steps[1].rows[0], reverse=True)),))),
    ],
    "synchronized": [
        _plant(
            "ddp",
            lambda r: edit_rank(r, 1, 1, param_digests=_other_digest(r.steps[1].ranks[1].param_digests, "b")),
        ),
        _plant(
            "ddp",
            lambda r: edit_rank(
                r, 0, 1, grad_digests=_other_digest(r.steps[0].ranks[1].grad_digests, "head")
            ),
        ),
        _plant(
            "fsdp",
            lambda r: edit_rank(r, 0, 0, param_sharded={**r.steps[0].ranks[0].param_sharded, "b": False}),
        ),
        _plant(
            "fsdp",
            lambda r: edit_rank(r, 1, 1, grad_digests=_other_digest(r.steps[1].ranks[1].grad_digests, "a")),
        ),
    ],
}


@pytest.mark.parametrize(
    ("name", "index"), [(name, i) for name, plants in INVARIANT_PLANTS.items() for i in range(len(plants))]
)
def test_each_invariant_fails_alone(name: str, index: int) -> None:
    arms = make_arms(2)
    INVARIANT_PLANTS[name][index](arms)
    with pytest.raises(CriterionError) as info:
        assert_criterion_v2(arms)
    result = info.value.result
    assert result.verdict == "fail"
    assert failed_invariants(result) == {name}
    assert {f.check for f in info.value.failed} == {name}
    row = next(
        line for line in result.invariants_table().splitlines() if line.startswith(name) and "FAIL" in line
    )
    assert row  # the evidence is in the table


def test_every_invariant_has_a_plant() -> None:
    assert set(INVARIANT_PLANTS) == set(CRITERION_INVARIANTS)


def test_clip_within_limit_passes() -> None:
    arms = make_arms(2)
    arms["ref"] = edit_rank(arms["ref"], 1, 0, post_clip_norm=CLIP * (1 + 0.9e-4))
    assert assert_criterion_v2(arms).passed


def test_dtype_evidence_counts_sites_and_observations() -> None:
    arms = make_arms(2)
    fp32 = tuple(
        dataclasses.replace(c, output_dtype="torch.float32", autocast=False, autocast_dtype=None)
        for c in arms["ddp"].steps[0].ranks[0].linear[:-1]
    )
    ddp = arms["ddp"]
    for s in range(STEPS):
        for r in range(2):
            ddp = edit_rank(ddp, s, r, linear=(*fp32, ddp.steps[s].ranks[r].linear[-1]))
    arms["ddp"] = dataclasses.replace(ddp, fault="fp32-backbone")
    result = judge(arms)
    failure = next(i for i in result.invariants if i.name == "dtype").failures[0]
    assert failure.observations == "3/4 invalid Linear sites per rank and step; 4/4 rank-step observations"
    row = result.rejection_rows()[0]
    assert (
        row["fault"] == "fp32-backbone"
        and row["status"] == "rejected"
        and row["rejecting_evidence"] == ["dtype"]
    )


# --- faults and the rejection table ---------------------------------------------------------------------


def test_scale_grad_rejected_by_pre_norm_and_gradients_with_the_table() -> None:
    arms = make_arms(2)
    ddp = dataclasses.replace(arms["ddp"], fault="scale-grad")
    for s in range(STEPS):
        ddp = edit_step(ddp, s, grads={k: 2 * g for k, g in ddp.steps[s].grads.items()})
        for r in range(2):
            ddp = edit_rank(ddp, s, r, pre_clip_norm=2 * ddp.steps[s].ranks[r].pre_clip_norm)
    arms["ddp"] = ddp
    with expect_fault_rejected("scale-grad", by="pre_norm") as rejection:
        assert_criterion_v2(arms)
    assert rejection.evidence.checks == ("pre_norm", "gradients")
    result = rejection.evidence.result
    assert result.verdict == "fail"
    row = result.rejection_rows()[0]
    assert row["arm"] == "ddp (fault scale-grad)" and row["status"] == "rejected"
    assert row["supporting_observations"] == "tensor gradients over 3/3; tensor updates over 0/3"
    assert row["pre_norm_rel"] == pytest.approx(1.0)
    table = result.rejection_table()
    assert "Rejecting evidence" in table and "pre_norm, gradients" in table
    assert "Faults:" in rejection.evidence.message
    json.dumps(result.to_dict())


def test_a_void_run_does_not_count_as_a_fault_rejection() -> None:
    from pytest_sprite.assertions.expect_fault import FaultNotRejected

    arms = make_arms(2)
    _break_gate(arms)
    ddp = dataclasses.replace(arms["ddp"], fault="scale-grad")
    arms["ddp"] = with_grad(ddp, 0, "a", ddp.steps[0].grads["a"] * 2)
    with pytest.raises(FaultNotRejected, match="do not carry the fault"), expect_fault_rejected("scale-grad"):
        assert_criterion_v2(arms)


# --- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", BF16_ARMS)
def test_missing_arm_is_refused_by_name(missing: str) -> None:
    arms = make_arms(2)
    del arms[missing]
    with pytest.raises(CriterionRefused, match=f"missing: {missing}"):
        assert_criterion_v2(arms)


def test_refusals() -> None:
    def refused(arms: Any, match: str) -> None:
        with pytest.raises(CriterionRefused, match=match):
            assert_criterion_v2(arms)

    base = make_arms(2)
    refused({**base, "single": base["ref"]}, "unknown arm 'single'")
    refused([base["ref32"]], "mapping of arm name")
    refused({**base, "ref": base["split"]}, "passed as 'ref' is the 'split' arm")
    refused({**base, "ddp": "record"}, "must be a Bf16ArmRecord")
    other = dataclasses.replace(base["fsdp"], recipe=dataclasses.replace(base["fsdp"].recipe, clip=0.02))
    refused({**base, "fsdp": other}, "different recipe than ref32.*clip")
    fewer = dataclasses.replace(
        base["split"],
        trainable_names=("a", "b"),
        initial_trainable={k: v for k, v in base["split"].initial_trainable.items() if k != "head"},
    )
    refused({**base, "split": fewer}, "another model")
    one = make_arms(2)["ref"]
    one_device = dataclasses.replace(
        base["ddp"], world_size=1, initial_digests=one.initial_digests, comm=one.comm, steps=one.steps
    )
    refused({**base, "ddp": one_device}, "'ddp' ran on 1 device")
    refused(
        {**base, "split": dataclasses.replace(base["split"], precision="32-true")},
        "must run precision='bf16-mixed'",
    )
    refused(
        {**base, "fsdp": dataclasses.replace(base["fsdp"], precision="16-mixed")},
        "must run precision='bf16-mixed'",
    )
    refused({**base, "ref32": dataclasses.replace(base["ref32"], precision="bf16-mixed")}, "FP32 reference")
    refused(
        {**base, "split_premul": dataclasses.replace(base["split_premul"], fault="skip-update")},
        "must be clean",
    )


def test_refusal_is_a_usage_error_not_an_assertion() -> None:
    arms = make_arms(2)
    del arms["fsdp"]
    with pytest.raises(SpriteUsageError) as info:
        assert_criterion_v2(arms)
    assert not isinstance(info.value, AssertionError)


def test_inconsistent_record_is_refused_at_construction() -> None:
    rec = make_arms(2)["ddp"]
    with pytest.raises(SpriteUsageError, match="step 0 has 1 ranks"):
        edit_step(rec, 0, ranks=rec.steps[0].ranks[:1])
