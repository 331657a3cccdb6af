"""``python -m pytest_sprite judge DIR``: judge stored records again, offline, with the same rules.

Every assertion that judged stored records (parity and criterion v2 arms written under
``--sprite-artifacts``, a resume check's ``resume-run.pt``, a crash matrix in its ``out_dir``) left a
manifest beside them, ``<kind>-NN.assertion.json``: its kind, its inputs
(paths relative to the manifest, so a copied directory judges the same) and the result it reached.
``judge`` finds every manifest under DIR, hands it to the judge function registered for its kind
(:data:`JUDGES`), prints the same tables as the terminal summary, and exits 1 when any row's verdict is
a failure or differs from the stored one. A crash ``matrix.json`` stored without a manifest
(``assert_crash_consistent`` run outside a test) is judged too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.records import ArmRecord
from pytest_sprite.report.kinds import get_kind

__all__ = ["JUDGES", "Judged", "judge_directory", "judge_manifest", "register_judge"]

Judge = Callable[[Mapping[str, Any], list[Path]], dict[str, Any]]
"""(stored result payload, input paths) -> the result's ``to_dict()`` judged again."""

JUDGES: dict[str, Judge] = {}


def register_judge(kind: str, judge: Judge) -> None:
    """Judge stored manifests of ``kind`` with ``judge``."""
    JUDGES[kind] = judge


def _judge_parity(stored: Mapping[str, Any], inputs: list[Path]) -> dict[str, Any]:
    from pytest_sprite.assertions.parity import ParityError, assert_parity
    from pytest_sprite.recipes.artifacts import load_arm_record

    records = [load_arm_record(p) for p in inputs]
    bf16 = [str(p) for p, r in zip(inputs, records, strict=True) if not isinstance(r, ArmRecord)]
    if bf16:
        raise SpriteUsageError(
            f"a parity manifest lists BF16 arm records ({', '.join(bf16)}); those are judged by criterion v2"
        )
    ref, *arms = (r for r in records if isinstance(r, ArmRecord))
    try:
        result = assert_parity(ref, *arms, rtol=float(stored["rtol"]))
    except ParityError as exc:
        result = exc.result
    payload: dict[str, Any] = result.to_dict()
    return payload


def _judge_criterion_v2(stored: Mapping[str, Any], inputs: list[Path]) -> dict[str, Any]:
    from pytest_sprite.assertions.criterion_v2 import CriterionError, assert_criterion_v2
    from pytest_sprite.recipes.artifacts import load_arm_record
    from pytest_sprite.records import BF16_ARMS, Bf16ArmRecord

    records = [load_arm_record(p) for p in inputs]
    bf16 = [r for r in records if isinstance(r, Bf16ArmRecord)]
    if len(bf16) != len(BF16_ARMS) or len(bf16) != len(records):
        raise SpriteUsageError(
            f"a criterion_v2 manifest needs the six BF16 records, got {len(records)} inputs"
        )
    try:
        result = assert_criterion_v2(dict(zip(BF16_ARMS, bf16, strict=True)))
    except CriterionError as exc:
        result = exc.result
    payload: dict[str, Any] = result.to_dict()
    return payload


def _judge_crash_consistency(stored: Mapping[str, Any], inputs: list[Path]) -> dict[str, Any]:
    """The stored ``out_dir/matrix.json`` judged again: every row's verdict re-derived from its facts."""
    from pytest_sprite.assertions.crash_consistency import MATRIX_FILE, judge_crash_matrix

    if len(inputs) != 1 or inputs[0].name != MATRIX_FILE:
        raise SpriteUsageError(
            f"a crash_consistency manifest lists one {MATRIX_FILE} (the assertion's out_dir), got "
            f"{', '.join(map(str, inputs)) or 'none'}"
        )
    payload: dict[str, Any] = judge_crash_matrix(inputs[0].parent).to_dict()
    return payload


def _judge_resume(stored: Mapping[str, Any], inputs: list[Path]) -> dict[str, Any]:
    """The stored ``resume-run.pt`` (every role's records, every rank) judged again, bit for bit."""
    from pytest_sprite.assertions.resume import judge_resume
    from pytest_sprite.recipes.artifacts import RESUME_RUN_FILE, load_resume_run

    if len(inputs) != 1:
        raise SpriteUsageError(
            f"a resume manifest lists one {RESUME_RUN_FILE}, got {', '.join(map(str, inputs)) or 'none'}"
        )
    payload: dict[str, Any] = judge_resume(load_resume_run(inputs[0]), run_label=stored.get("run")).to_dict()
    return payload


register_judge("parity", _judge_parity)
register_judge("criterion_v2", _judge_criterion_v2)
register_judge("resume", _judge_resume)
register_judge("crash_consistency", _judge_crash_consistency)


@dataclass(frozen=True, kw_only=True)
class Judged:
    """One manifest judged again."""

    manifest: Path
    test_id: str
    """The manifest's folder and name relative to DIR: what the tables show in the Test column."""
    stored: dict[str, Any]
    result: dict[str, Any]
    origins: tuple[str, ...] = ()
    """Where each input record came from, as its ``record.json`` says (``ref32: reused from <test>``)."""

    @property
    def changed(self) -> list[str]:
        """Rows whose verdict differs from the stored result's: ``label: stored -> now``."""
        kind = get_kind(str(self.result["kind"]))
        before = {r.label: r.verdict for r in kind.rows(self.stored)}
        after = {r.label: r.verdict for r in kind.rows(self.result)}
        # A kind may list only some rows (a crash matrix lists the points that did not PASS): a row in
        # one payload only changed from or to what goes unlisted.
        return [
            f"{label}: {before.get(label, kind.unlisted)} -> {after.get(label, kind.unlisted)}"
            for label in dict.fromkeys([*after, *before])
            if before.get(label) != after.get(label)
        ]

    @property
    def failed(self) -> bool:
        kind = get_kind(str(self.result["kind"]))
        return any(r.verdict in kind.bad_verdicts for r in kind.rows(self.result))


def judge_manifest(path: Path, root: Path) -> Judged:
    """Judge one manifest's inputs again with its kind's judge."""
    document = json.loads(path.read_text(encoding="utf-8"))
    from pytest_sprite.glue.recorded_results import MANIFEST_FORMAT

    if document.get("format") != MANIFEST_FORMAT:
        raise SpriteUsageError(
            f"{path}: manifest format {document.get('format')!r} is not readable here (this version reads "
            f"format {MANIFEST_FORMAT}); judge it with the pytest-sprite version that wrote it"
        )
    kind = document["kind"]
    judge = JUDGES.get(kind)
    if judge is None:
        raise SpriteUsageError(
            f"{path}: no offline judge for assertion kind {kind!r}; kinds with one: {', '.join(sorted(JUDGES))}"
        )
    inputs = [(path.parent / p).resolve() for p in document["inputs"]]
    missing = [str(p) for p in inputs if not p.exists()]
    if missing:
        raise SpriteUsageError(
            f"{path}: its inputs are missing: {', '.join(missing)}; copy the whole test directory"
        )
    return Judged(
        manifest=path,
        test_id=str(path.relative_to(root)),
        stored=document["result"],
        result=judge(document["result"], inputs),
        origins=_origins(inputs),
    )


def _origins(inputs: list[Path]) -> tuple[str, ...]:
    """``<arm>: <origin>`` for each input arm directory whose ``record.json`` names where it came from."""
    found = []
    for path in inputs:
        try:
            summary = json.loads((path / "record.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and summary.get("origin"):
            found.append(f"{summary.get('arm', path.name)}: {summary['origin']}")
    return tuple(found)


def judge_directory(root: Path) -> list[Judged]:
    """Every manifest under ``root``, judged again, in path order."""
    if not root.is_dir():
        raise SpriteUsageError(f"judge: {root} is not a directory; pass the --sprite-artifacts directory")
    from pytest_sprite.assertions.crash_consistency import MATRIX_FILE

    manifests = sorted(root.rglob("*.assertion.json"))
    # A crash matrix stored outside a test (a script's out_dir) has no manifest: its matrix.json is one.
    covered = {m.parent for m in manifests if m.name.startswith("crash_consistency-")}
    matrices = sorted(p for p in root.rglob(MATRIX_FILE) if p.parent not in covered and _is_matrix(p))
    if not manifests and not matrices:
        raise SpriteUsageError(
            f"judge: no *.assertion.json (nor a crash {MATRIX_FILE}) under {root}; run the tests with "
            f"--sprite-artifacts {root} first, or pass an assert_crash_consistent out_dir"
        )
    judged = [judge_manifest(m, root) for m in manifests]
    for path in matrices:
        stored = json.loads(path.read_text(encoding="utf-8"))
        judged.append(
            Judged(
                manifest=path,
                test_id=str(path.relative_to(root)),
                stored=stored,
                result=_judge_crash_consistency(stored, [path]),
            )
        )
    return sorted(judged, key=lambda j: j.manifest)


def _is_matrix(path: Path) -> bool:
    """True for a stored crash matrix (another tool's ``matrix.json`` is left alone)."""
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get("kind") == "crash_consistency")
    except (ValueError, OSError, AttributeError):
        return False
