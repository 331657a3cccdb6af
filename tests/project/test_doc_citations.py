"""Every repository path the docs cite exists: files, folders, globs, ``file:line`` and ``file::test`` ids.

A page that sends a reader to ``tests/save_crashes/test_chaos_matrix.py`` or ``pytest_sprite/launch/merge.py:137`` is
wrong the day that file moves or shrinks; this test reads every page and checks each citation against the tree.
Paths that name the reader's own files in an example (``tests/test_my_parity.py``) are listed in ``READERS``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)])
TOP = ("pytest_sprite", "tests", "bench", "hpc", "docs", ".ci")
CITATION = re.compile(
    r"(?<![\w./<-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*-]*[\w*/])"
    r"(?:::([\w]+)|:(\d+))?"
)
READERS = {
    "tests/test_my_parity.py",
    "tests/test_first.py",
    "tests/test_x.py",
    "tests/test_allreduce.py",
    "docs/_build/html",
}
"""Files of the reader's project that examples name, not files of this repository."""


def citations(text: str) -> list[tuple[int, str, str | None, int | None]]:
    """(line, path, test name, line number) of every repository path the text cites."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            found.append((n, m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None))
    return found


def problem(path: str, test: str | None, line: int | None) -> str | None:
    if path in READERS:
        return None
    if "*" in path:
        return None if list(ROOT.glob(path)) else "matches no file"
    target = ROOT / path
    if not target.exists():
        return "does not exist"
    if line is not None:
        length = len(target.read_text(encoding="utf-8").splitlines())
        return None if 1 <= line <= length else f"has {length} lines, not {line}"
    if test is not None and target.is_file():
        text = target.read_text(encoding="utf-8")
        return (
            None if re.search(rf"^\s*(?:async )?(?:def|class) {test}\b", text, re.M) else f"defines no {test}"
        )
    return None


def test_the_pattern_reads_paths_lines_and_test_ids() -> None:
    text = "see `tests/save_crashes/test_x.py::test_y[a-b]`, pytest_sprite/launch/merge.py:137 and hpc/*/README.md."
    assert [c[1:] for c in citations(text)] == [
        ("tests/save_crashes/test_x.py", "test_y", None),
        ("pytest_sprite/launch/merge.py", None, 137),
        ("hpc/*/README.md", None, None),
    ]
    assert citations("a site-packages/pytest_sprite/x.py path, <basetemp>/docs/y") == []


def test_every_path_the_docs_cite_exists() -> None:
    wrong = [
        f"{page.relative_to(ROOT)}:{n}: {path}{'::' + test if test else ''}{f':{line}' if line else ''} {why}"
        for page in PAGES
        for n, path, test, line in citations(page.read_text(encoding="utf-8"))
        if (why := problem(path, test, line))
    ]
    assert not wrong, "the docs cite what the repository does not have:\n" + "\n".join(wrong)
