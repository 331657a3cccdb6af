"""``python -m pytest_sprite judge DIR``: judge stored records again, offline, with the same rules.

Every assertion that judged stored records (arms written under ``--sprite-artifacts``) left a manifest
beside them, ``<kind>-NN.assertion.json``: its kind, its inputs (paths relative to the manifest, so a
copied directory judges the same) and the result it reached. ``judge`` finds every manifest under DIR,
hands it to the judge function registered for its kind (:data:`JUDGES`), prints the same tables as the
terminal summary, and exits 1 when any row's verdict is a failure or differs from the stored one.
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


register_judge("parity", _judge_parity)
register_judge("criterion_v2", _judge_criterion_v2)
# resume and crash_consistency (their stored runs and matrices) register theirs here: one function each,
# from the stored payload and its inputs.


@dataclass(frozen=True, kw_only=True)
class Judged:
    """One manifest judged again."""

    manifest: Path
    test_id: str
    """The manifest's folder and name relative to DIR: what the tables show in the Test column."""
    stored: dict[str, Any]
    result: dict[str, Any]

    @property
    def changed(self) -> list[str]:
        """Rows whose verdict differs from the stored result's: ``label: stored -> now``."""
        kind = get_kind(str(self.result["kind"]))
        before = {r.label: r.verdict for r in kind.rows(self.stored)}
        return [
            f"{r.label}: {before.get(r.label)} -> {r.verdict}"
            for r in kind.rows(self.result)
            if before.get(r.label) != r.verdict
        ]

    @property
    def failed(self) -> bool:
        kind = get_kind(str(self.result["kind"]))
        return any(r.verdict in kind.bad_verdicts for r in kind.rows(self.result))


def judge_manifest(path: Path, root: Path) -> Judged:
    """Judge one manifest's inputs again with its kind's judge."""
    document = json.loads(path.read_text(encoding="utf-8"))
    from pytest_sprite._results import MANIFEST_FORMAT

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
    )


def judge_directory(root: Path) -> list[Judged]:
    """Every manifest under ``root``, judged again, in path order."""
    if not root.is_dir():
        raise SpriteUsageError(f"judge: {root} is not a directory; pass the --sprite-artifacts directory")
    manifests = sorted(root.rglob("*.assertion.json"))
    if not manifests:
        raise SpriteUsageError(
            f"judge: no *.assertion.json under {root}; run the tests with --sprite-artifacts {root} first"
        )
    return [judge_manifest(m, root) for m in manifests]
