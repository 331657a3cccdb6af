"""BF16 parity, criterion v2: the public import path of :mod:`pytest_sprite.assertions.criterion`.

The assertion lives in the ``criterion`` package, one module per concern (results, invariants, scoring,
verdict, the terminal's table); this module keeps every name importable from where it always was.
"""

from __future__ import annotations

from pytest_sprite.assertions.criterion import (
    ABS_FLOOR,
    CLIP_RTOL,
    CRITERION_CHECKS,
    CRITERION_INVARIANTS,
    CRITERION_SCORED,
    EPS_FP32,
    INVARIANTS,
    RTOL,
    CriterionError,
    CriterionRefused,
    CriterionResult,
    Diagnostics,
    InvariantFailure,
    InvariantResult,
    PairDiagnostic,
    ScoredComparison,
    TensorGap,
    assert_criterion_v2,
    tensor_gap,
)

__all__ = [
    "ABS_FLOOR",
    "CLIP_RTOL",
    "CRITERION_CHECKS",
    "CRITERION_INVARIANTS",
    "CRITERION_SCORED",
    "EPS_FP32",
    "INVARIANTS",
    "RTOL",
    "CriterionError",
    "CriterionRefused",
    "CriterionResult",
    "Diagnostics",
    "InvariantFailure",
    "InvariantResult",
    "PairDiagnostic",
    "ScoredComparison",
    "TensorGap",
    "assert_criterion_v2",
    "tensor_gap",
]
