"""``--sprite-report PATH``: the session as one JSON document (schema: ``report.schema.json``).

pytest-json-report's shape where it applies (``created``, ``duration``, ``exitcode``, ``root``,
``environment``, ``summary``, ``tests`` with ``nodeid``, ``outcome``, ``setup``/``call``/``teardown``),
plus for each test its ``ranks`` (one entry per rank) and ``assertions`` (every result's ``to_dict()``).
A project adds fields with the ``pytest_sprite_report(report, config)`` hook. An existing file is never
replaced unless ``--sprite-report-overwrite`` says so.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from pytest_sprite.assertions.fault_verdict import fault_verdicts
from pytest_sprite.assertions.numeric import json_safe
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.distribution import DISTRIBUTION, installed_version
from pytest_sprite.report.logged_results import TestEntry
from pytest_sprite.report.profile import profile_of

__all__ = ["SCHEMA_PATH", "SCHEMA_VERSION", "build_document", "check_target", "load_schema", "write_document"]

SCHEMA_VERSION: Final = 1
SCHEMA_PATH: Final = Path(__file__).with_name("report.schema.json")
_PACKAGES: Final = ("pytest", DISTRIBUTION, "torch", "lightning", "pytest-xdist")


def load_schema() -> dict[str, Any]:
    """The JSON Schema every ``--sprite-report`` document validates against."""
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema


def check_target(path: str, *, overwrite: bool, option: str = "--sprite-report") -> Path:
    """Refuse a report path that exists (unless ``overwrite``) or is a directory; ``option`` names where it came
    from in the error."""
    target = Path(path)
    if target.is_dir():
        raise SpriteUsageError(
            f"{option}={path}: is a directory; pass a file path such as {path}/report.json"
        )
    if target.exists() and not overwrite:
        raise SpriteUsageError(
            f"{option}={path}: the file exists and a report is never overwritten; "
            "pass a new path or add --sprite-report-overwrite"
        )
    return target


def build_document(
    *,
    entries: Iterable[TestEntry],
    created: float,
    duration: float,
    exitcode: int,
    root: str,
    launcher: str,
    world_size: int | None,
    device: str,
    collected: int,
) -> dict[str, Any]:
    """The report as plain JSON data (the hook may still add fields)."""
    tests = [_test(e) for e in entries]
    summary: dict[str, int] = {}
    for test in tests:
        summary[test["outcome"]] = summary.get(test["outcome"], 0) + 1
    summary["total"] = len(tests)
    summary["collected"] = collected
    ranks = [r for t in tests for r in t["ranks"]]
    return {
        "schema_version": SCHEMA_VERSION,
        "created": created,
        "duration": duration,
        "exitcode": exitcode,
        "root": root,
        "environment": {
            "Python": platform.python_version(),
            "Platform": platform.platform(),
            "packages": {name: installed_version(name) for name in _PACKAGES},
            "launcher": launcher,
            "world_size": world_size,
            "devices": {
                "requested": device,
                "used": sorted({str(r["device"]) for r in ranks if r.get("device")}),
            },
            "hosts": sorted({str(r["host"]) for r in ranks if r.get("host")}),
        },
        "summary": summary,
        "tests": tests,
    }


def _test(entry: TestEntry) -> dict[str, Any]:
    test: dict[str, Any] = {
        "nodeid": entry.nodeid,
        "lineno": entry.location[1],
        "keywords": entry.keywords,
        "outcome": entry.outcome,
        "duration": entry.duration,
    }
    for phase in ("setup", "call", "teardown"):
        if phase in entry.phases:
            test[phase] = dict(entry.phases[phase])
    test["ranks"] = [dict(r) for r in entry.ranks]
    test["assertions"] = [_with_fault_verdicts(a) for a in entry.assertions]
    if entry.profile is not None:
        test["profile"] = profile_of(entry)
    return test


def _with_fault_verdicts(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The payload, with the one verdict on each fault its arms carry (``fault_verdicts``) when they carry one."""
    assertion = dict(payload)
    verdicts = fault_verdicts(payload)
    if verdicts:
        assertion["fault_verdicts"] = [v.to_dict() for v in verdicts]
    return assertion


def write_document(document: dict[str, Any], path: str, *, overwrite: bool) -> Path:
    """Write the document; a file created meanwhile is still refused unless ``overwrite``."""
    target = check_target(path, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(document), indent=1, allow_nan=False) + "\n"
    try:
        with open(target, "w" if overwrite else "x", encoding="utf-8") as fh:
            fh.write(text)
    except FileExistsError:
        raise SpriteUsageError(
            f"--sprite-report={path}: the file appeared during the session and a report is never overwritten"
        ) from None
    return target
