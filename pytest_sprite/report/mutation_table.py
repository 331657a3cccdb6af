"""``--sprite-mutate``'s terminal table: each test's killed and surviving mutants, and the session's score."""

from __future__ import annotations

from typing import Any

from pytest_sprite.glue.mutation_book import MutationBook

__all__ = ["mutation_lines", "write_mutation_table"]


def mutation_lines(book: MutationBook) -> list[str]:
    """The table as lines: one per test, then the session's score (killed / applicable)."""
    lines: list[str] = []
    for nodeid, entry in book.tests.items():
        score = f"{entry.score:.2f}" if entry.score is not None else "-"
        killed = len(entry.killed)
        applicable = killed + len(entry.survived)
        lines.append(f"{nodeid}: killed {killed}/{applicable} (score {score})")
        if entry.killed:
            lines.append(f"    killed: {', '.join(entry.killed)}")
        if entry.survived:
            lines.append(f"    survived: {', '.join(entry.survived)}")
        if entry.not_applicable:
            lines.append(f"    not applicable: {', '.join(entry.not_applicable)}")
        if entry.not_run:
            lines.append(f"    not mutated: {entry.not_run}")
    total = book.score
    score = f"{total:.2f}" if total is not None else "- (no mutant applied)"
    lines.append(f"mutation score: {score}, {book.killed} killed of {book.applicable} applicable")
    return lines


def write_mutation_table(terminalreporter: Any, book: MutationBook) -> None:
    terminalreporter.write_sep("=", "sprite mutation score")
    for line in mutation_lines(book):
        terminalreporter.write_line(line)
