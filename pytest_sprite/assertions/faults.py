"""The fault catalogue and ``expect_fault_rejected``: proof that an assertion catches a planted bug.

A negative control only counts when the assertion fails *because of* the fault: the failing checks must
sit on arms that carry it, and no clean arm may fail in the same assertion (then the failure could have
any cause). A block that passes, or fails for an unrelated reason, fails the test instead.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pytest_sprite.assertions._evidence import AssertionFailure, FailedCheck
from pytest_sprite.assertions.parity import PARITY_CHECKS
from pytest_sprite.errors import SpriteUsageError

__all__ = [
    "FAULTS",
    "Fault",
    "FaultNotRejected",
    "FaultRejection",
    "expect_fault_rejected",
    "get_fault",
]


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One catalogued fault: what it breaks, where it applies and which checks are expected to see it."""

    name: str
    """Catalogue name, as passed to ``run(fault=...)`` and ``expect_fault_rejected``."""
    description: str
    """What the fault does to the training step."""
    arms: tuple[str, ...]
    """Arms (or assertion roles) the fault applies to."""
    applied_by: str | None
    """What plants it (``lora_qwen.run``), or None while only the name is reserved for a later assertion."""


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            name="missing-rank",
            description="the last rank's loss is multiplied by 0, so its gradient never reaches the average",
            arms=("ddp", "fsdp"),
            applied_by="lora_qwen.run",
        ),
        Fault(
            name="wrong-scale",
            description="every rank's loss is multiplied by N (the world size), so gradients are summed, not averaged",
            arms=("ddp", "fsdp"),
            applied_by="lora_qwen.run",
        ),
        Fault(
            name="accumulate-sum",
            description=(
                "gradient accumulation skips the division by the k micro-batches, so the step uses k times the mean"
            ),
            arms=("ddp", "fsdp"),
            applied_by="lora_qwen.run",
        ),
        Fault(
            name="fp32-backbone",
            description="the backbone forward runs without autocast (BF16 criterion v2)",
            arms=("ddp",),
            applied_by=None,
        ),
        Fault(
            name="local-adapter",
            description="one LoRA tensor keeps its local, unsynchronized gradient (BF16 criterion v2)",
            arms=("ddp",),
            applied_by=None,
        ),
        Fault(
            name="scale-grad",
            description="gradients are multiplied by N after synchronization (BF16 criterion v2)",
            arms=("ddp",),
            applied_by=None,
        ),
        Fault(
            name="skip-update",
            description="ranks other than 0 skip the last update (BF16 criterion v2)",
            arms=("ddp",),
            applied_by=None,
        ),
        Fault(
            name="dropped-optimizer-state",
            description="the optimizer state is dropped after a checkpoint restore (resume check)",
            arms=("resume",),
            applied_by=None,
        ),
        Fault(
            name="reset-lr-scheduler",
            description="the LR scheduler restarts from step 0 after a restore (resume check)",
            arms=("resume",),
            applied_by=None,
        ),
        Fault(
            name="perturbed-weight",
            description="a trainable weight is perturbed after a restore (resume check)",
            arms=("resume",),
            applied_by=None,
        ),
    )
}
"""Every fault pytest-sprite knows, by name."""


def get_fault(name: object) -> Fault:
    """The catalogue entry for ``name``; an unknown name raises listing the known ones."""
    if not isinstance(name, str) or name not in FAULTS:
        raise SpriteUsageError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    return FAULTS[name]


class FaultNotRejected(AssertionError):
    """A planted fault went through: the assertion passed, or failed for a reason not attributable to it."""


@dataclass(frozen=True, kw_only=True)
class FaultRejection:
    """Evidence that an assertion rejected a fault: the checks that failed on the faulted arms."""

    fault: str
    """The planted fault."""
    checks: tuple[str, ...]
    """Names of the failed checks on arms carrying the fault, in evaluation order, without repeats."""
    failed: tuple[FailedCheck, ...]
    """Every failed check with its arm and detail."""
    message: str
    """The assertion's own failure text (its table)."""
    result: Any
    """The assertion's structured result (e.g. a ``ParityResult``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready evidence for reports."""
        return {
            "kind": "fault",
            "fault": self.fault,
            "status": "rejected",
            "checks": list(self.checks),
            "failed": [f.to_dict() for f in self.failed],
        }


class expect_fault_rejected:
    """Context manager: the block must fail an assertion because of ``fault``; ``by`` names required checks.

    ``with expect_fault_rejected("missing-rank") as rejection: assert_parity(ref, faulted_arm)``.
    After the block, ``rejection.evidence`` holds the :class:`FaultRejection`. A block that passes fails
    with "fault X was not rejected"; an exception that is not an assertion failure propagates unchanged.
    """

    def __init__(self, fault: str, by: str | Iterable[str] | None = None) -> None:
        self.fault = get_fault(fault).name
        required = (by,) if isinstance(by, str) else tuple(by) if by is not None else ()
        unknown = [c for c in required if c not in PARITY_CHECKS]
        if unknown:
            raise SpriteUsageError(
                f"expect_fault_rejected({fault!r}, by={by!r}): unknown check {', '.join(map(repr, unknown))}; "
                f"known checks: {', '.join(PARITY_CHECKS)}"
            )
        self.by = required
        self._evidence: FaultRejection | None = None

    @property
    def evidence(self) -> FaultRejection:
        """The rejection evidence; only available after the block rejected the fault."""
        if self._evidence is None:
            raise SpriteUsageError(
                f"no evidence for fault {self.fault!r} yet: read .evidence after the with-block has ended"
            )
        return self._evidence

    def __enter__(self) -> expect_fault_rejected:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> bool:
        if exc is None:
            raise FaultNotRejected(
                f"fault {self.fault!r} was not rejected: the block passed. "
                f"The assertion did not notice that {FAULTS[self.fault].description}."
            )
        if not isinstance(exc, AssertionError):
            return False
        if not isinstance(exc, AssertionFailure):
            raise FaultNotRejected(
                f"fault {self.fault!r}: the block raised an AssertionError that carries no sprite evidence, so "
                f"the failure cannot be attributed to the fault; put only a sprite assertion in the block. "
                f"It raised: {exc}"
            ) from exc
        self._evidence = self._attribute(exc)
        return True

    def _attribute(self, exc: AssertionFailure) -> FaultRejection:
        on_fault = [f for f in exc.failed if f.fault == self.fault]
        elsewhere = [f for f in exc.failed if f.fault != self.fault]
        if elsewhere:
            listed = "; ".join(f"{f.arm}: {f.check}" for f in elsewhere)
            raise FaultNotRejected(
                f"fault {self.fault!r}: the assertion failed, but also on arms that do not carry the fault "
                f"({listed}), so the failure cannot be attributed to it. Fix those arms first.\n\n{exc}"
            ) from exc
        if not on_fault:
            raise FaultNotRejected(
                f"fault {self.fault!r}: the assertion failed without a failed check on an arm that carries the fault; "
                f'run the arm with fault="{self.fault}".\n\n{exc}'
            ) from exc
        checks = tuple(dict.fromkeys(f.check for f in on_fault))
        missing = [c for c in self.by if c not in checks]
        if missing:
            raise FaultNotRejected(
                f"fault {self.fault!r} was rejected by {', '.join(checks)}, but by= requires "
                f"{', '.join(missing)} among them.\n\n{exc}"
            ) from exc
        return FaultRejection(
            fault=self.fault, checks=checks, failed=tuple(on_fault), message=str(exc), result=exc.result
        )
