"""Assertions on distributed training: FP32 parity against one device, and proof that planted faults are caught.

Every assertion raises an ``AssertionError`` with a table a person can read and returns a structured result.
Importing this package imports no torch.
"""

from __future__ import annotations

from pytest_sprite.assertions._evidence import AssertionFailure, FailedCheck
from pytest_sprite.assertions.faults import (
    FAULTS,
    Fault,
    FaultNotRejected,
    FaultRejection,
    expect_fault_rejected,
    get_fault,
)
from pytest_sprite.assertions.parity import (
    PARITY_CHECKS,
    ArmParity,
    ParityError,
    ParityRefused,
    ParityResult,
    assert_parity,
)

__all__ = [
    "FAULTS",
    "PARITY_CHECKS",
    "ArmParity",
    "AssertionFailure",
    "FailedCheck",
    "Fault",
    "FaultNotRejected",
    "FaultRejection",
    "ParityError",
    "ParityRefused",
    "ParityResult",
    "assert_parity",
    "expect_fault_rejected",
    "get_fault",
]
