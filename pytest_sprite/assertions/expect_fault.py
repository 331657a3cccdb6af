"""``expect_fault_rejected``: proof that an assertion catches a planted bug, judged by the fault registry.

A negative control only counts when the assertion fails *because of* the fault, as the one verdict on a
planted fault decides (:func:`~pytest_sprite.assertions.fault_verdict.fault_verdict`, which the report
tables read too): the failing checks must sit on arms that carry it, no clean arm may fail in the same
assertion (then the failure could have any cause), and the checks the registry (``pytest_sprite.planted_faults``)
lists for the fault, or ``by=``, must be among the failed ones. A block that passes, or fails for an
unrelated reason, fails the test instead.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pytest_sprite.assertions.criterion_v2 import CRITERION_CHECKS
from pytest_sprite.assertions.evidence import AssertionFailure, FailedCheck
from pytest_sprite.assertions.fault_verdict import fault_verdict
from pytest_sprite.assertions.parity import PARITY_CHECKS
from pytest_sprite.assertions.resume import RESUME_CHECKS
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.planted_faults import get_fault
from pytest_sprite.plumbing.mutants import PLANTED, current_run

__all__ = ["FaultNotRejected", "FaultRejection", "expect_fault_rejected"]


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

    ``by=None`` requires the checks the registry lists for the fault (``pytest_sprite.planted_faults.FAULTS``) in the
    assertion that failed: ``missing-rank`` needs ``pre_norm`` in ``assert_parity`` and ``pre_norm`` and
    ``gradients`` in ``assert_criterion_v2``.

    ``with expect_fault_rejected("missing-rank") as rejection: assert_parity(ref, faulted_arm)``.
    After the block, ``rejection.evidence`` holds the :class:`FaultRejection`. A block that passes fails
    with "fault X was not rejected"; an exception that is not an assertion failure propagates unchanged.
    """

    def __init__(self, fault: str, by: str | Iterable[str] | None = None) -> None:
        entry = get_fault(fault)
        self.fault = entry.name
        self.description = entry.description
        self._entry = entry
        required = (by,) if isinstance(by, str) else tuple(by) if by is not None else None
        known = tuple(dict.fromkeys((*PARITY_CHECKS, *CRITERION_CHECKS, *RESUME_CHECKS)))
        unknown = [c for c in required or () if c not in known]
        if unknown:
            raise SpriteUsageError(
                f"expect_fault_rejected({fault!r}, by={by!r}): unknown check {', '.join(map(repr, unknown))}; "
                f"known checks: {', '.join(known)}"
            )
        self._by = required
        self._evidence: FaultRejection | None = None

    @property
    def by(self) -> tuple[str, ...]:
        """The checks required: ``by=`` as given, else the registry's for the assertion that failed (or the default)."""
        return self._by if self._by is not None else self._entry.by

    @property
    def evidence(self) -> FaultRejection:
        """The rejection evidence; only available after the block rejected the fault."""
        if self._evidence is None:
            raise SpriteUsageError(
                f"no evidence for fault {self.fault!r} yet: read .evidence after the with-block has ended"
            )
        return self._evidence

    def __enter__(self) -> expect_fault_rejected:
        if (run := current_run()) is not None:  # under --sprite-mutate: no mutant applies to this test
            run.note(PLANTED + self.fault)
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
                f"The assertion did not notice that {self.description}."
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
        kind = getattr(exc.result, "kind", None)
        verdict = fault_verdict(
            self.fault, exc.failed, kind=kind if isinstance(kind, str) else None, by=self._by
        )
        if verdict.elsewhere:
            listed = "; ".join(f"{f.arm}: {f.check}" for f in verdict.elsewhere)
            raise FaultNotRejected(
                f"fault {self.fault!r}: the assertion failed, but also on arms that do not carry the fault "
                f"({listed}), so the failure cannot be attributed to it. Fix those arms first.\n\n{exc}"
            ) from exc
        if not verdict.checks:
            raise FaultNotRejected(
                f"fault {self.fault!r}: the assertion failed without a failed check on an arm that carries the fault; "
                f'run the arm with fault="{self.fault}".\n\n{exc}'
            ) from exc
        if not verdict.rejected:
            raise FaultNotRejected(
                f"fault {self.fault!r} was rejected by {', '.join(verdict.checks)}, but by= requires "
                f"{', '.join(verdict.missing)} among them.\n\n{exc}"
            ) from exc
        on_fault = tuple(f for f in exc.failed if f.fault == self.fault)
        return FaultRejection(
            fault=self.fault, checks=verdict.checks, failed=on_fault, message=str(exc), result=exc.result
        )
