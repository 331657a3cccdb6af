"""Crash consistency judged: the ckpt-chaos method's verdict rules as pure functions over stored facts.

Each crash point's row holds only facts (how the resume ended, the weight difference to the fault-free run,
which checkpoints were complete, which one the resume used); its verdict is derived from them by
:func:`judge_row`, so a matrix read back from disk is judged again by the same rules (``judge DIR``):

- ``HARD_FAIL``: the resume raised, died or hung: the job cannot go on until someone cleans up by hand;
- ``SILENT_DIVERGENCE``: the resume succeeded and ended with weights differing from the fault-free run by more
  than ``atol`` (0: bit for bit);
- ``LOST_WORK``: the same weights, but the resume started from an older checkpoint than the newest complete one
  (only where completeness is known: the target marked which saves finished and what it resumed from);
- ``PASS`` otherwise.

The matrix as a whole fails when two fault-free runs already differ (divergence verdicts mean nothing then),
when a repeated fault-free run failed (``flake=``), when the control row (no crash) is not a PASS, or on any
HARD_FAIL or SILENT_DIVERGENCE row (LOST_WORK too with ``allow_lost_work=False``). The judge is pure: no torch,
no processes. :func:`assert_crash_consistent` asks a :class:`CrashTarget` (built by ``crash_fn``,
``crash_command``, ``crash_recipe`` or ``crash_hf_trainer`` in :mod:`pytest_sprite.save_crashes`, which runs it) for its
matrix under :class:`MatrixSettings`, and judges it here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pytest_sprite.assertions.evidence import AssertionFailure, FailedCheck, attributes
from pytest_sprite.assertions.tables import format_figure, render_table
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.recorded_results import record_assertion

__all__ = [
    "MATRIX_FILE",
    "SCRATCH",
    "TEAR_CHOICES",
    "VERDICTS",
    "CrashConsistencyError",
    "CrashMatrix",
    "CrashRow",
    "CrashTarget",
    "MatrixSettings",
    "Verdict",
    "assert_crash_consistent",
    "check_crash_matrix",
    "judge_crash_matrix",
    "judge_matrix",
    "judge_row",
]

Verdict = Literal["PASS", "HARD_FAIL", "SILENT_DIVERGENCE", "LOST_WORK"]
VERDICTS: tuple[str, ...] = ("PASS", "HARD_FAIL", "SILENT_DIVERGENCE", "LOST_WORK")
"""Every verdict a row can get, in the order the summary counts them."""

SCRATCH = "<scratch>"
"""``resumed_from`` of a run that found nothing to resume and started from the initial weights."""

MATRIX_FILE = "matrix.json"
"""Name of the stored matrix inside ``out_dir``."""
_FORMAT = 1
ResumeStatus = Literal["returned", "raised", "died", "timeout"]


@dataclass(frozen=True, kw_only=True)
class CrashRow:
    """One crash point (or the control run) and what its resume came back with."""

    point: int
    """Row number: 0 is the control run (no crash), crash points count from 1."""
    rank: int | None
    """Rank that died (None for the control run)."""
    event: str
    """Kind of the file event the rank died in (``control`` for the control run)."""
    file: str
    """File or folder of the event, relative to the training directory (``a -> b`` for a rename)."""
    torn: bool
    """The rank died with the file written and cut to half its size, rather than before the event."""
    crashed: bool
    """The crashed run reached its planned point and died there (False: the run finished without reaching it)."""
    resume_status: ResumeStatus
    """How the resume ended: ``returned`` final weights, ``raised``, ``died`` or ``timeout``."""
    error: str | None = None
    """The resume's exception (or how it died), for a HARD_FAIL."""
    weight_diff: float | None = None
    """Largest absolute difference of any weight to the fault-free run (None when the resume returned nothing)."""
    newest_complete: str | None = None
    """Newest checkpoint that was completely saved before the crash (None: unknown or none)."""
    resumed_from: str | None = None
    """Checkpoint the resume loaded, :data:`SCRATCH` for none, None if unknown."""
    note: str = ""
    """Anything the matrix could not judge by the rules alone (a crash point that was not reached)."""
    verdict: Verdict = "PASS"
    """Derived by :func:`judge_row`; stored for readers, never trusted when judging again."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready facts and verdict (non-finite numbers as strings)."""
        return {
            **attributes(self, "point", "rank", "event", "file", "torn", "crashed", "resume_status", "error"),
            "weight_diff": _json_float(self.weight_diff),
            **attributes(self, "newest_complete", "resumed_from", "note", "verdict"),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CrashRow:
        """Read a stored row back (its verdict is re-derived by the matrix reader)."""
        verdict = str(data.get("verdict", "PASS"))
        if verdict not in VERDICTS:
            raise ValueError(
                f"row {data.get('point')}: unknown verdict {verdict!r}; verdicts: {', '.join(VERDICTS)}"
            )
        status = str(data["resume_status"])
        if status not in ("returned", "raised", "died", "timeout"):
            raise ValueError(f"row {data.get('point')}: unknown resume_status {status!r}")
        return cls(
            point=int(data["point"]),
            rank=None if data.get("rank") is None else int(data["rank"]),
            event=str(data["event"]),
            file=str(data["file"]),
            torn=bool(data["torn"]),
            crashed=bool(data["crashed"]),
            resume_status=status,  # type: ignore[arg-type]
            error=data.get("error"),
            weight_diff=_read_float(data.get("weight_diff")),
            newest_complete=data.get("newest_complete"),
            resumed_from=data.get("resumed_from"),
            note=str(data.get("note", "")),
            verdict=verdict,  # type: ignore[arg-type]
        )

    def cells(self) -> list[str]:
        """This row in the matrix table."""
        return [
            "control" if self.point == 0 else str(self.point),
            "-" if self.rank is None else str(self.rank),
            self.file,
            self.event,
            "torn" if self.torn else "",
            self.verdict,
            self.newest_complete or "-",
            self.resumed_from or "-",
            "-" if self.weight_diff is None else format_figure(self.weight_diff),
            _short(self.error or self.note),
        ]


def judge_row(row: CrashRow, *, atol: float, saves: Sequence[str]) -> Verdict:
    """The verdict ckpt-chaos's rules give ``row``; ``saves`` lists the checkpoints in save order (oldest first)."""
    if row.resume_status != "returned":
        return "HARD_FAIL"
    diff = row.weight_diff
    if diff is None or math.isnan(diff) or diff > atol:
        return "SILENT_DIVERGENCE"
    if row.newest_complete is not None and row.resumed_from is not None:
        order = {name: i for i, name in enumerate(saves)}
        order[SCRATCH] = -1
        newest = order.get(row.newest_complete)
        used = order.get(row.resumed_from)
        if newest is not None and used is not None and used < newest:
            return "LOST_WORK"
    return "PASS"


@dataclass(frozen=True, kw_only=True)
class CrashMatrix:
    """Every crash point of a target, its verdict, and the runs that say whether the verdicts mean anything."""

    target: str
    """What was crashed: the function's qualified name, the command, or the recipe and strategy."""
    ranks: int
    """Processes per run."""
    atol: float
    """Largest weight difference that still counts as the same result (0: bit for bit)."""
    allow_lost_work: bool
    """False: a LOST_WORK row fails the matrix as well."""
    fault_free_diff: float
    """Largest weight difference between the two fault-free runs (above ``atol``: the target is not deterministic)."""
    flake_runs: int
    """Extra fault-free runs made (``flake=``)."""
    flake_failures: tuple[str, ...]
    """What went wrong in each failed extra fault-free run."""
    saves: tuple[str, ...]
    """Checkpoints the fault-free run marked complete, oldest first (empty: completeness is not known)."""
    control: CrashRow
    """The run without a crash, resumed like every crash point; it must PASS."""
    rows: tuple[CrashRow, ...]
    """One row per crash point, in event order (each tearable event's torn row right after it)."""
    wall_s: float = 0.0
    """Wall time of the whole matrix, seconds."""
    fault_free_error: str | None = None
    """Why the first fault-free run failed (then nothing was crashed and ``rows`` is empty)."""
    kind: str = field(default="crash_consistency", init=False)
    """Result kind, for reports."""

    @property
    def deterministic(self) -> bool:
        """True when the two fault-free runs agree within ``atol``."""
        return not math.isnan(self.fault_free_diff) and self.fault_free_diff <= self.atol

    @property
    def counts(self) -> dict[str, int]:
        """How many crash-point rows got each verdict (the control row not counted)."""
        counts = dict.fromkeys(VERDICTS, 0)
        for row in self.rows:
            counts[row.verdict] += 1
        return counts

    @property
    def problems(self) -> tuple[str, ...]:
        """Why the matrix fails, one line each; empty when it passes."""
        found: list[str] = []
        if self.fault_free_error is not None:
            return (f"the fault-free run failed, so nothing was crashed: {self.fault_free_error}",)
        if not self.deterministic:
            found.append(
                f"two fault-free runs already differ (max weight diff {format_figure(self.fault_free_diff)} > "
                f"atol {self.atol:g}): divergence verdicts mean nothing until the target is deterministic "
                "(seed every random draw, save and restore RNG state)"
            )
        if self.flake_failures:
            found.append(
                f"{len(self.flake_failures)} of {self.flake_runs} repeated fault-free runs failed: "
                + "; ".join(self.flake_failures[:3])
            )
        if not self.rows:
            found.append(
                "the fault-free run made no file event under its training directory, so nothing was crashed: "
                "the target must write its checkpoints into the directory it is given"
            )
        if self.control.verdict != "PASS":
            found.append(
                f"the control run (no crash) came back {self.control.verdict}: {self.control.error or ''}"
            )
        failing = (
            ("HARD_FAIL", "SILENT_DIVERGENCE")
            if self.allow_lost_work
            else ("HARD_FAIL", "SILENT_DIVERGENCE", "LOST_WORK")
        )
        counts = self.counts
        bad = [f"{counts[v]} {v}" for v in failing if counts[v]]
        if bad:
            found.append(f"{' + '.join(bad)} of {len(self.rows)} crash points")
        return tuple(found)

    @property
    def passed(self) -> bool:
        """True when the matrix has no problem."""
        return not self.problems

    def summary(self) -> str:
        """``17 HARD_FAIL + 1 PASS of 18 crash points (control PASS)``."""
        counts = self.counts
        parts = [f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n]
        return (
            f"{' + '.join(parts) or 'no'} of {len(self.rows)} crash points (control {self.control.verdict})"
        )

    def table(self) -> str:
        """The matrix as a table: one row per crash point, the control first."""
        headers = (
            "Point",
            "Rank",
            "File",
            "Event",
            "Torn",
            "Verdict",
            "Newest complete",
            "Resumed from",
            "Weight diff",
            "Error",
        )
        return render_table(headers, [self.control.cells(), *(r.cells() for r in self.rows)])

    def report(self) -> str:
        """The message of a failing assertion: what failed, then the whole matrix."""
        head = f"crash consistency of {self.target} ({self.ranks} rank{'s' if self.ranks != 1 else ''}): "
        head += "FAILED" if self.problems else "passed"
        lines = [head, *(f"  - {p}" for p in self.problems), self.summary()]
        if self.flake_runs:
            lines.append(
                f"fault-free runs repeated {self.flake_runs} times: {len(self.flake_failures)} failed"
            )
        return "\n".join([*lines, "", self.table()])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready matrix: the facts of every row, the derived verdicts, counts and problems."""
        return {
            "kind": self.kind,
            "format": _FORMAT,
            **attributes(self, "target", "ranks", "atol", "allow_lost_work"),
            "fault_free_diff": _json_float(self.fault_free_diff),
            "deterministic": self.deterministic,
            "flake_runs": self.flake_runs,
            "flake_failures": list(self.flake_failures),
            "saves": list(self.saves),
            **attributes(self, "wall_s", "fault_free_error", "passed"),
            "problems": list(self.problems),
            "counts": self.counts,
            "control": self.control.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CrashMatrix:
        """Read a stored matrix and judge every row again (stored verdicts are not trusted)."""
        if data.get("kind") != "crash_consistency":
            raise ValueError(f"not a crash-consistency matrix (kind={data.get('kind')!r})")
        matrix = cls(
            target=str(data["target"]),
            ranks=int(data["ranks"]),
            atol=float(data["atol"]),
            allow_lost_work=bool(data["allow_lost_work"]),
            fault_free_diff=_read_float(data["fault_free_diff"]) or 0.0,
            flake_runs=int(data.get("flake_runs", 0)),
            flake_failures=tuple(str(f) for f in data.get("flake_failures", ())),
            saves=tuple(str(s) for s in data.get("saves", ())),
            control=CrashRow.from_dict(data["control"]),
            rows=tuple(CrashRow.from_dict(r) for r in data["rows"]),
            wall_s=float(data.get("wall_s", 0.0)),
            fault_free_error=data.get("fault_free_error"),
        )
        return judge_matrix(matrix)

    def write(self, out_dir: Path) -> Path:
        """Store the matrix as ``out_dir/matrix.json`` (paths in it are relative) and the table beside it."""
        path = out_dir / MATRIX_FILE
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        (out_dir / "matrix.txt").write_text(self.report() + "\n", encoding="utf-8")
        return path


class CrashConsistencyError(AssertionFailure):
    """A crash matrix failed; ``result`` is the :class:`CrashMatrix` with every row."""


def check_crash_matrix(matrix: CrashMatrix) -> CrashMatrix:
    """Return ``matrix`` when it passes; raise :class:`CrashConsistencyError` with its report otherwise."""
    if matrix.passed:
        return matrix
    failed = tuple(
        FailedCheck(arm=matrix.target, check=_check_name(p), fault=None, detail=p) for p in matrix.problems
    )
    raise CrashConsistencyError(matrix.report(), failed=failed, result=matrix)


def _check_name(problem: str) -> str:
    for needle, name in (
        ("fault-free run failed", "fault_free"),
        ("fault-free runs already differ", "deterministic"),
        ("repeated fault-free", "flake"),
        ("control run", "control"),
    ):
        if needle in problem:
            return name
    return "crash_matrix"


def judge_matrix(matrix: CrashMatrix) -> CrashMatrix:
    """``matrix`` with every row's verdict (and the control's) derived again from its facts."""

    def judged(row: CrashRow) -> CrashRow:
        return replace(row, verdict=judge_row(row, atol=matrix.atol, saves=matrix.saves))

    return replace(matrix, control=judged(matrix.control), rows=tuple(judged(r) for r in matrix.rows))


def judge_crash_matrix(directory: str | Path) -> CrashMatrix:
    """Re-apply the verdict rules to a matrix stored under ``directory`` (an ``out_dir`` of a finished run).

    Paths in the matrix are relative, so a copied directory judges the same. Raises ``SpriteUsageError``
    when ``directory`` holds no matrix.
    """
    path = Path(directory) / MATRIX_FILE
    if not path.is_file():
        raise SpriteUsageError(
            f"{directory} holds no {MATRIX_FILE}; pass the out_dir of a finished assert_crash_consistent run"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return CrashMatrix.from_dict(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise SpriteUsageError(f"{path} is not a readable crash matrix: {exc}") from None


def _json_float(value: float | None) -> float | str | None:
    if value is None:
        return None
    return value if math.isfinite(value) else str(value)


def _read_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _short(text: str, limit: int = 70) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


TEAR_CHOICES: tuple[str, ...] = ("all", "native", "none")
"""Which written files a matrix also tears: every one, the native writers' (``torch.save``, safetensors), none."""


@dataclass(frozen=True, kw_only=True)
class MatrixSettings:
    """How a crash matrix is run and judged, whatever its target."""

    flake: int = 0
    """Extra fault-free runs, each of which must end as the first did."""
    allow_lost_work: bool = True
    """False: a LOST_WORK row fails the matrix too."""
    atol: float = 0.0
    """The weight difference still counted as equal (0: bit for bit)."""
    timeout: float = 300.0
    """Seconds each run may take."""
    grace: float = 5.0
    """Seconds the other ranks of a run run on after one died at its crash point."""
    max_points: int | None = None
    """Sample that many crash points evenly (first and last kept); None: every one."""
    select: Callable[[Any], bool] | None = None
    """Keep only the file events it accepts (a ``FileEvent``)."""
    tear: str = "all"
    """One of :data:`TEAR_CHOICES`."""

    def __post_init__(self) -> None:
        if not isinstance(self.flake, int) or isinstance(self.flake, bool) or self.flake < 0:
            raise SpriteUsageError(
                f"flake must be a non-negative int (extra fault-free runs), got {self.flake!r}"
            )
        if not self.atol >= 0:
            raise SpriteUsageError(f"atol must be >= 0, got {self.atol!r}")
        if not self.timeout > 0:
            raise SpriteUsageError(f"timeout must be positive seconds, got {self.timeout!r}")
        if self.max_points is not None and (not isinstance(self.max_points, int) or self.max_points < 1):
            raise SpriteUsageError(f"max_points must be a positive int or None, got {self.max_points!r}")
        if self.tear not in TEAR_CHOICES:
            raise SpriteUsageError(f"tear={self.tear!r} is not one of {', '.join(map(repr, TEAR_CHOICES))}")


@runtime_checkable
class CrashTarget(Protocol):
    """A training job :func:`assert_crash_consistent` can crash: built by a ``crash_*`` constructor."""

    @property
    def label(self) -> str:
        """How the matrix names the target."""
        ...

    def crash_matrix(self, out_dir: str | os.PathLike[str], settings: MatrixSettings) -> CrashMatrix:
        """Create ``out_dir`` (refusing one that exists), run and judge the whole matrix there; store it."""
        ...


def assert_crash_consistent(
    target: CrashTarget,
    *,
    out_dir: str | os.PathLike[str],
    flake: int = 0,
    allow_lost_work: bool = True,
    atol: float = 0.0,
    timeout: float = 300.0,
    grace: float = 5.0,
    max_points: int | None = None,
    select: Callable[[Any], bool] | None = None,
    tear: str = "all",
) -> CrashMatrix:
    """Crash ``target`` at every file event of its run, resume each crash, and require every resume to be sound.

    ``target`` is built by a constructor of :mod:`pytest_sprite`: ``crash_fn(train)`` (a training function
    ``train(train_dir)`` that resumes from whatever it finds there and returns its final weights),
    ``crash_command([..., "{out}"], result_file=...)`` (an unmodified script), ``crash_recipe(lora_qwen,
    strategy="ddp")`` (a recipe's Lightning fit) or ``crash_hf_trainer()``. In a ranks test call it on every
    rank: each run is then a sub-world of the test's ranks.

    Raises :class:`CrashConsistencyError` (an ``AssertionError`` carrying the matrix) on any HARD_FAIL or
    SILENT_DIVERGENCE row, on LOST_WORK when ``allow_lost_work=False``, when two fault-free runs differ, when any
    of ``flake`` extra fault-free runs fails, or when the control run (no crash) does not pass; returns the
    matrix otherwise. Writes only inside ``out_dir``, which it creates and refuses if it exists; the matrix is
    stored there as ``matrix.json`` for ``judge_crash_matrix``. The other arguments are :class:`MatrixSettings`.
    """
    settings = MatrixSettings(
        flake=flake,
        allow_lost_work=allow_lost_work,
        atol=float(atol),
        timeout=float(timeout),
        grace=float(grace),
        max_points=max_points,
        select=select,
        tear=tear,
    )
    if not isinstance(target, CrashTarget):
        raise SpriteUsageError(
            f"cannot crash a {type(target).__name__}: build the target with pytest_sprite.crash_fn(train), "
            "crash_command([..., '{out}'], result_file=...), crash_recipe(recipe, strategy=...) or "
            "crash_hf_trainer()"
        )
    matrix = target.crash_matrix(out_dir, settings)
    record_assertion(matrix, inputs=[Path(out_dir) / MATRIX_FILE])  # rank 0 wrote it: a manifest for `judge`
    return check_crash_matrix(matrix)
