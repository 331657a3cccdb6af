"""The resume check's results: the required checks, every reported figure, and the tables they print.

Frozen dataclasses with ``to_dict()`` for the reports; :data:`RESUME_KIND` is the terminal's table of a
result, which ``pytest_sprite.report.kinds`` registers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_sprite.assertions.evidence import ArmsResult, AssertionFailure, FailedCheck, attributes
from pytest_sprite.assertions.fault_verdict import item_verdict
from pytest_sprite.assertions.numeric import finite_or_repr
from pytest_sprite.assertions.tables import (
    Row,
    figure_cell,
    format_figure,
    pass_or_fail_kind,
    render_table,
)

__all__ = [
    "RESTORE_CHECKS",
    "RESUME_CHECKS",
    "RESUME_GAPS",
    "RESUME_HEADERS",
    "RESUME_KIND",
    "ResumeArm",
    "ResumeError",
    "ResumeGaps",
    "ResumeResult",
    "resume_rows",
]

RESTORE_CHECKS: tuple[str, ...] = (
    "trainables",
    "optimizer_state",
    "param_groups",
    "lr_scheduler",
    "frozen",
    "loop",
)
"""What a restore must reproduce exactly, against the state captured inside the save."""
RESUME_CHECKS: tuple[str, ...] = (*RESTORE_CHECKS, "first_loss", "lr", "rows")
"""Every required check, in evaluation order (``by=`` of ``expect_fault_rejected`` names these)."""

_VERDICT_HEADERS = (
    "Run",
    "Ranks",
    "Global batch",
    "Reshard ranks",
    "Required restore, continuation, reshard, export",
)
_GAP_HEADERS = (
    "Run",
    "Arm",
    "Reported loss gap",
    "Reported pre-clip norm gap",
    "Reported update gap",
    "Reported Adam first-moment gap",
    "Reported Adam second-moment gap",
)
_ARM_HEADERS = ("Arm", "Role", "Ranks", "Loads", "Result", "Failed checks")
RESUME_GAPS: tuple[str, ...] = ("loss", "pre_clip_norm", "update", "adam_m", "adam_v")
"""The reported continuation gaps of a resumed arm, in the lightning-sprite procedure's column order (fields of :class:`ResumeGaps`)."""


class ResumeError(AssertionFailure):
    """The resume check failed; ``result`` is the :class:`ResumeResult` with every figure."""


@dataclass(frozen=True, kw_only=True)
class ResumeGaps:
    """Reported continuation gaps of one arm against the uninterrupted fit (largest relative gaps)."""

    arm: str
    """``single``, ``ddp``, ``fsdp``, ``fsdp_file``, ``fsdp_reshard`` or ``<strategy>_export``."""
    loss: float
    """Largest relative gap of the step loss (mean over ranks) over the resumed steps."""
    pre_clip_norm: float
    """Largest relative gap of the pre-clip global gradient norm over the resumed steps."""
    update: float
    """Largest per-tensor relative gap of the final weights, relative to the fit's update since the checkpoint."""
    adam_m: float
    """Largest per-tensor relative gap of Adam's first moment at the end."""
    adam_v: float
    """Largest per-tensor relative gap of Adam's second moment at the end."""

    def cells(self) -> list[str]:
        """The five figures as the lightning-sprite procedure's table prints them."""
        return [format_figure(getattr(self, k)) for k in RESUME_GAPS]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {"arm": self.arm, **{k: finite_or_repr(getattr(self, k)) for k in RESUME_GAPS}}


@dataclass(frozen=True, kw_only=True)
class ResumeArm:
    """One restore (resume, reload, reshard or export) and the required checks it failed."""

    label: str
    """As in the tables: ``ddp resume``, ``fsdp reshard 4->2``, ``ddp export``, with the fault if any."""
    role: str
    """``resume``, ``reload``, ``reshard`` or ``export``."""
    ranks: int
    """Ranks of this role."""
    loads: str
    """Which checkpoint it loaded: the killed fit's epoch-1 checkpoint, or the resume's final one."""
    fault: str | None
    """Fault planted after its restore."""
    failed: tuple[FailedCheck, ...]
    """Required checks it failed, empty when it passed."""

    @property
    def passed(self) -> bool:
        """True when every required check passed."""
        return not self.failed

    def row(self) -> list[str]:
        """This arm's cells in the per-arm table."""
        checks = ", ".join(dict.fromkeys(f.check for f in self.failed)) or "-"
        return [self.label, self.role, str(self.ranks), self.loads, "pass" if self.passed else "FAIL", checks]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            **attributes(self, "label", "role", "ranks", "loads", "fault", "passed"),
            "failed": [f.to_dict() for f in self.failed],
        }


@dataclass(frozen=True, kw_only=True)
class ResumeResult(ArmsResult):
    """Every required check and reported figure of one resume check; returned on a pass, carried on a failure."""

    kind = "resume"

    run: str
    """Row label of the verdict table, e.g. ``ddp, 32-true``."""
    strategy: str
    """``single``, ``ddp``, ``fsdp`` or ``fsdp_file``."""
    precision: str
    """Lightning precision flag."""
    ranks: int
    """Ranks of the fit and the resume."""
    global_batch: int
    """Rows per optimizer step."""
    reshard_ranks: int | None
    """Ranks of the resharded resume, None when not run."""
    export: bool
    """True when the checkpoint was also loaded on one device."""
    fault: str | None
    """Fault planted after the resume's restore."""
    arms: tuple[ResumeArm, ...]
    """Every restore that was checked."""
    gaps: tuple[ResumeGaps, ...]
    """Reported continuation gaps, per resumed arm."""
    departs: str
    """Where the resumed run first departs from the uninterrupted fit (step and what), or ``never``."""
    twin: str
    """Whether the twin fit reproduced the fit bit for bit, and if not, where it first differs."""
    rng: str
    """Whether the resumed run's RNG streams match the fit's on every rank (reported)."""
    timings: Mapping[str, tuple[float, float]]
    """Per role: wall seconds and process start-up seconds."""

    def verdict_table(self) -> str:
        """The resume check's run table: run, ranks, global batch, reshard ranks, verdict."""
        reshard = f"{self.ranks} → {self.reshard_ranks}" if self.reshard_ranks else "-"
        verdict = "pass" if self.passed else "FAIL: " + ", ".join(dict.fromkeys(f.check for f in self.failed))
        if self.fault is not None:
            verdict += f" (fault {self.fault})"
        return render_table(
            _VERDICT_HEADERS, [[self.run, str(self.ranks), str(self.global_batch), reshard, verdict]]
        )

    def arms_table(self) -> str:
        """One row per checked restore."""
        return render_table(_ARM_HEADERS, [a.row() for a in self.arms])

    def gaps_table(self) -> str:
        """The reported continuation and reshard gaps, one row per resumed arm."""
        return render_table(_GAP_HEADERS, [[self.run, g.arm, *g.cells()] for g in self.gaps])

    def report(self) -> str:
        """Heading, the three tables, the reported items and one line per failed check."""
        heading = "passed" if self.passed else f"failed: {len(self.failed)} required checks"
        lines = [
            f"Checkpoint resume {heading} ({self.strategy}, {self.precision}, {self.ranks} ranks"
            + (f", fault {self.fault}" if self.fault else "")
            + ")",
            "",
            self.verdict_table(),
            "",
            self.arms_table(),
            "",
            "Reported, not required:",
            self.gaps_table(),
            f"  resumed run departs from the uninterrupted fit: {self.departs}",
            f"  twin fit: {self.twin}",
            f"  RNG streams: {self.rng}",
        ]
        if not self.passed:
            lines += ["", "Failed checks:"]
            lines += [f"  {f.arm}: {f.check}: {f.detail}" for f in self.failed]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures of this result."""
        return {
            **attributes(self, "kind", "run", "strategy", "precision", "ranks", "global_batch"),
            **attributes(self, "reshard_ranks", "export", "fault", "passed"),
            "arms": [a.to_dict() for a in self.arms],
            "gaps": [g.to_dict() for g in self.gaps],
            **attributes(self, "departs", "twin", "rng"),
            "timings": {k: list(v) for k, v in self.timings.items()},
        }


# -- the terminal's table ------------------------------------------------------------

RESUME_HEADERS: tuple[str, ...] = (
    "Run",
    "Arm",
    "Ranks",
    "Global batch",
    "Reshard ranks",
    "Failed checks",
    "Loss gap",
    "Pre-clip norm gap",
    "Update gap",
    "Adam m gap",
    "Adam v gap",
)


def _gaps_arm(payload: Mapping[str, Any], arm: Mapping[str, Any]) -> str | None:
    """The ``gaps`` entry of a restore: the resume's under the strategy, reshard and export under a suffix."""
    suffix = {"resume": "", "reshard": "_reshard", "export": "_export"}.get(str(arm["role"]))
    return None if suffix is None else f"{payload['strategy']}{suffix}"


def resume_rows(payload: Mapping[str, Any]) -> list[Row]:
    """One row per checked restore (resume, reload, reshard, export), with the run's verdict-table columns
    and the continuation gaps reported for that arm (``-`` for the reload, which trains nothing compared).

    The gaps are reported, never required: the verdict is the required checks'. An arm carrying a fault
    reads the fault's verdict (:func:`~pytest_sprite.assertions.fault_verdict.fault_verdict`).
    """
    gaps = {str(g["arm"]): g for g in payload["gaps"]}
    reshard = f"{payload['ranks']} → {payload['reshard_ranks']}" if payload.get("reshard_ranks") else "-"
    rows = []
    for arm in payload["arms"]:
        gap = gaps.get(_gaps_arm(payload, arm) or "")
        failed = ", ".join(dict.fromkeys(str(f["check"]) for f in arm["failed"])) or "-"
        verdict = item_verdict(arm, payload)
        figures: dict[str, float | int | str | None] = {"failed": failed if failed != "-" else ""}
        figures.update({k: gap[k] for k in RESUME_GAPS} if gap is not None else {})
        rows.append(
            Row(
                cells=(
                    str(payload["run"]),
                    str(arm["label"]),
                    str(arm["ranks"]),
                    str(payload["global_batch"]),
                    reshard,
                    failed,
                    *(figure_cell(gap[k]) if gap is not None else "-" for k in RESUME_GAPS),
                ),
                verdict=verdict,
                figures=figures,
                label=str(arm["label"]),
            )
        )
    return rows


RESUME_KIND = pass_or_fail_kind(
    "resume",
    "Checkpoint resume, bit for bit (gaps against the uninterrupted fit: reported, not required)",
    RESUME_HEADERS,
    resume_rows,
)
"""How the reports show a resume payload."""
