"""The one number rule of every assertion (assertions.numeric) and the one record codec (records._codec)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from pytest_sprite.assertions.numeric import (  # noqa: E402
    bit_equal,
    finite_or_repr,
    json_safe,
    ratio,
    rel,
    rel_l2,
    rel_l2_tensors,
    same_float,
    tensor_rel,
)
from pytest_sprite.records import CommConfig, LinearCall, RankStep  # noqa: E402
from pytest_sprite.records._codec import AS_ROWS, Stored, decode, encode  # noqa: E402

pytestmark = pytest.mark.cpu

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    ("value", "reference", "expected"),
    [
        (1.0, 1.0, 0.0),
        (1.001, 1.0, pytest.approx(1e-3)),
        (-0.0, 0.0, 0.0),  # equal values are 0 apart
        (INF, INF, 0.0),
        (1.0, 0.0, INF),  # a zero reference
        (NAN, 1.0, INF),  # a NaN is never within a limit ...
        (NAN, NAN, INF),  # ... not even against itself
        (1.0, NAN, INF),
        (INF, 1.0, INF),
        (1.0, INF, INF),
    ],
)
def test_rel_has_one_rule_for_values_that_are_not_finite(
    value: float, reference: float, expected: float
) -> None:
    assert rel(value, reference) == expected


def test_ratio_and_the_update_measures_share_the_rule() -> None:
    assert (ratio(0.0, 0.0), ratio(1.0, 0.0), ratio(NAN, 1.0), ratio(1.0, NAN), ratio(2.0, 4.0)) == (
        0.0,
        INF,
        INF,
        INF,
        0.5,
    )
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])
    assert rel_l2(a, a) == 0.0 and rel_l2(a, torch.zeros(3)) == INF
    assert rel_l2(b, a) == pytest.approx(0.5 / math.sqrt(5))
    assert rel_l2_tensors({"x": b}, {"x": a}, ["x"]) == pytest.approx(0.5 / math.sqrt(5))
    assert rel_l2_tensors({"x": a}, {"x": torch.zeros(3)}, ["x"]) == INF
    assert tensor_rel(b, a, torch.tensor([0.0, 1.0])) == pytest.approx(0.5)
    assert tensor_rel(torch.tensor([NAN]), torch.tensor([NAN]), torch.tensor([1.0])) == INF


def test_bit_equal_is_the_seeds_bit_identical() -> None:
    x = torch.tensor([1.0, NAN, 0.0])
    assert bit_equal(x, x.clone())  # the same NaN bits
    assert not bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bit_equal(x, x.double())
    assert not bit_equal(x, x.reshape(3, 1))
    assert bit_equal(torch.zeros(0), torch.zeros(0))
    assert same_float(NAN, NAN) and not same_float(0.0, -0.0) and same_float(1.5, 1.5)


def test_json_numbers_are_finite_or_their_repr() -> None:
    assert (finite_or_repr(1.5), finite_or_repr(INF), finite_or_repr(-INF), finite_or_repr(NAN)) == (
        1.5,
        "inf",
        "-inf",
        "nan",
    )
    doc = {"a": [1.0, INF, (NAN, 2)], "b": {"c": -INF}, "d": "x"}
    assert json_safe(doc) == {"a": [1.0, "inf", ["nan", 2]], "b": {"c": "-inf"}, "d": "x"}
    json.dumps(json_safe(doc), allow_nan=False)


@dataclass(frozen=True, kw_only=True)
class _Inner(Stored):
    n: int
    x: float


@dataclass(frozen=True, kw_only=True)
class _Outer(Stored):
    name: str
    pairs: tuple[tuple[int, float], ...]
    inner: _Inner | None
    rows: tuple[_Inner, ...] = field(default=(), metadata=AS_ROWS)
    captured: tuple[dict[str, object], ...] = ()
    source: str | None = None


def test_the_codec_stores_from_the_field_types_and_reads_back() -> None:
    rec = _Outer(
        name="a",
        pairs=((1, 0.5),),
        inner=_Inner(n=2, x=1.0),
        rows=(_Inner(n=3, x=2.0),),
        captured=({"betas": (0.9, 0.999)},),
        source="not stored",
    )
    stored = encode(rec, {"format": 1})
    assert stored == {
        "format": 1,
        "name": "a",
        "pairs": [[1, 0.5]],
        "inner": {"n": 2, "x": 1.0},
        "rows": [[3, 2.0]],
        "captured": [{"betas": (0.9, 0.999)}],  # values as captured
    }
    back = decode(_Outer, stored)
    assert back == dataclass_replace_source(rec)
    assert decode(_Outer, {"name": "b", "pairs": [], "inner": None}).rows == ()  # a missing field's default


def dataclass_replace_source(rec: _Outer) -> _Outer:
    import dataclasses

    return dataclasses.replace(rec, source=None)


def test_bf16_rank_steps_keep_their_positional_linear_rows() -> None:
    call = LinearCall(
        site="s",
        kind="head",
        output_dtype="torch.float32",
        param_dtype="torch.float32",
        autocast=False,
        autocast_dtype=None,
        calls=2,
    )
    rank = RankStep(
        pre_clip_norm=1.0,
        post_clip_norm=0.5,
        grad_dtypes={"w": "torch.float32"},
        grad_digests={},
        param_digests={},
        frozen_digests={},
        linear=(call,),
    )
    stored = rank.to_dict()
    assert stored["linear"] == [["s", "head", "torch.float32", "torch.float32", False, None, 2]]
    assert stored["param_sharded"] is None and stored["grad_nonfinite"] == []
    assert RankStep.from_dict(stored) == rank
    assert CommConfig.from_dict(CommConfig(strategy="ddp").to_dict()) == CommConfig(strategy="ddp")
