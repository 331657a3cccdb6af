"""The one verdict on a planted fault: was it rejected, and by which checks.

A fault counts as rejected only when the assertion failed *because of* it: some check failed on an arm that
carries it, no arm without it failed (then the failure could have any cause), and the checks the fault
registry lists for it under the assertion's kind (or ``by=``) are among the failed ones. The terminal
tables, the JSON report, ``judge`` and ``expect_fault_rejected`` all read :func:`fault_verdict`'s answer,
so none of them can call a fault rejected that another calls not rejected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_sprite.assertions.evidence import FailedCheck
from pytest_sprite.planted_faults import FAULTS

__all__ = ["FaultVerdict", "fault_verdict", "fault_verdicts", "item_verdict", "payload_failures"]


@dataclass(frozen=True, kw_only=True)
class FaultVerdict:
    """Whether one assertion rejected one fault, and why (or why not)."""

    fault: str
    rejected: bool
    checks: tuple[str, ...]
    """Failed checks on arms carrying the fault, in evaluation order, without repeats."""
    required: tuple[str, ...]
    """Checks that had to be among them: ``by=``, else the registry's for the assertion's kind."""
    missing: tuple[str, ...]
    """Required checks that did not fail."""
    elsewhere: tuple[FailedCheck, ...]
    """Failed checks on arms that do not carry the fault: any one makes the failure unattributable."""
    reason: str
    """Empty when rejected; else why not, in a few words."""

    @property
    def status(self) -> str:
        """The word the tables show: ``rejected`` or ``NOT REJECTED``."""
        return "rejected" if self.rejected else "NOT REJECTED"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready verdict (the JSON report's ``fault_verdicts``)."""
        return {
            "fault": self.fault,
            "status": "rejected" if self.rejected else "not rejected",
            "checks": list(self.checks),
            "required": list(self.required),
            "missing": list(self.missing),
            "elsewhere": [f.to_dict() for f in self.elsewhere],
            "reason": self.reason,
        }


def _failed_check(f: FailedCheck | Mapping[str, Any]) -> FailedCheck:
    if isinstance(f, FailedCheck):
        return f
    return FailedCheck(
        arm=str(f["arm"]), check=str(f["check"]), fault=f.get("fault"), detail=str(f.get("detail", ""))
    )


def fault_verdict(
    fault: str,
    failed: Iterable[FailedCheck | Mapping[str, Any]],
    *,
    kind: str | None,
    by: Sequence[str] | None = None,
) -> FaultVerdict:
    """Judge ``fault`` from every check the assertion failed (objects or their ``to_dict()`` forms).

    ``kind`` is the assertion's (``parity``, ``criterion_v2``, ``resume``): the registry may name other
    checks per kind. A fault no registry entry describes (a stored report judged where its plugin is not
    installed) only needs a failed check on its arm.
    """
    failures = [_failed_check(f) for f in failed]
    on_fault = [f for f in failures if f.fault == fault]
    elsewhere = tuple(f for f in failures if f.fault != fault)
    checks = tuple(dict.fromkeys(f.check for f in on_fault))
    entry = FAULTS.get(fault)
    required = tuple(by) if by is not None else entry.checks_for(kind) if entry is not None else ()
    missing = tuple(c for c in required if c not in checks)
    if not failures:
        reason = "the assertion passed"
    elif elsewhere:
        reason = "arms without the fault failed too"
    elif not on_fault:
        reason = "no check failed on an arm carrying the fault"
    elif missing:
        reason = f"required checks did not fail: {', '.join(missing)}"
    else:
        reason = ""
    return FaultVerdict(
        fault=fault,
        rejected=not reason,
        checks=checks,
        required=required,
        missing=missing,
        elsewhere=elsewhere,
        reason=reason,
    )


def payload_failures(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every failed check of an assertion's ``to_dict()``: its ``failed`` list, else its arms'."""
    if "failed" in payload:
        return list(payload["failed"])
    return [f for arm in payload.get("arms", ()) for f in arm.get("failed", ())]


def fault_verdicts(payload: Mapping[str, Any]) -> list[FaultVerdict]:
    """The verdict on every fault an assertion's ``to_dict()`` carries, in the order its arms name them."""
    items = [*payload.get("arms", ()), *payload.get("scored", ())]
    faults = dict.fromkeys(str(i["fault"]) for i in items if isinstance(i, Mapping) and i.get("fault"))
    failures = payload_failures(payload)
    kind = payload.get("kind")
    return [fault_verdict(f, failures, kind=kind if isinstance(kind, str) else None) for f in faults]


def item_verdict(item: Mapping[str, Any], payload: Mapping[str, Any]) -> str:
    """A table row's verdict: ``pass`` / ``FAIL`` for a clean arm; the fault's :class:`FaultVerdict` status
    (``rejected`` / ``NOT REJECTED``) for an arm carrying one."""
    fault = item.get("fault")
    if not fault:
        return "pass" if item["passed"] else "FAIL"
    kind = payload.get("kind")
    return fault_verdict(
        str(fault), payload_failures(payload), kind=kind if isinstance(kind, str) else None
    ).status
