"""Names that explain themselves: one name, one thing, and comments that explain the code from the code."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

import pytest_sprite

pytestmark = pytest.mark.cpu

ROOT = Path(pytest_sprite.__file__).parent

SHARED = {
    "results": "each check's package holds its own results dataclasses (criterion/, resume/), one kind of thing"
}
"""Module names more than one package uses on purpose, with why a reader cannot confuse them."""


def _names() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        if path.stem != "__init__":
            where[path.stem].append(str(path.relative_to(ROOT)))
    for path in sorted(p for p in ROOT.rglob("*") if (p / "__init__.py").exists()):
        where[path.name].append(str(path.relative_to(ROOT)) + "/")
    return where


def test_no_two_modules_or_packages_share_a_name() -> None:
    twice = {name: paths for name, paths in _names().items() if len(paths) > 1 and name not in SHARED}
    assert twice == {}


def test_a_shared_name_is_still_shared() -> None:
    """An entry in SHARED that no longer applies goes, so the exceptions stay true."""
    assert {name for name in SHARED if len(_names()[name]) < 2} == set()


CITATION = re.compile(r"\bissue #?\d+|\bthe seed\b|\bthe seeds\b", re.IGNORECASE)


def test_the_code_cites_no_issue_numbers_and_no_seed() -> None:
    """Context a reader of the repository does not have: name the rule or the document instead."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if CITATION.search(line)
    ]
    assert found == []


def test_the_citation_pattern_sees_both_forms() -> None:
    assert CITATION.search("as issue 41 asks") and CITATION.search("what the seed says")
    assert not CITATION.search("the seeded classifier") and not CITATION.search("a hypothesis seed")
