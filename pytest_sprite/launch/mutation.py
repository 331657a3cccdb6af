"""``--sprite-mutate`` in the controller: which mutants a test runs under, and whether one was killed.

Pure decisions over a finished run; the controller queues the mutant runs and keeps the book
(:mod:`pytest_sprite.glue.mutation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

from ..plumbing.mutants import MutantSpec, applicable

if TYPE_CHECKING:
    from .runs import _Run

__all__ = ["killed", "mutants_to_run"]


def mutants_to_run(
    specs: Sequence[MutantSpec], run: _Run, reports: Sequence[pytest.TestReport], *, stopping: bool
) -> tuple[list[str], list[str], str | None]:
    """The mutants ``run``'s test runs under, those that do not apply, and why none runs (or None).

    Only a test whose own run passed is mutated: a failing or skipped test kills nothing by its checks. A
    mutant applies when the clean run's record shows a rank it acts on calling its op often enough.
    """
    if stopping:
        return [], [], "the session stopped"
    if any(r.failed for r in reports) or (run.ends and any(e.ended_by for e in run.ends.values())):
        return [], [], "its own run did not pass"
    if not any(r.when == "call" and r.passed for r in reports):
        return [], [], "its own run did not pass (skipped)"
    to_run: list[str] = []
    not_applicable: list[str] = []
    for spec in specs:
        (to_run if applicable(spec, run.called, run.n) else not_applicable).append(spec.text)
    return to_run, not_applicable, None


def killed(reports: Sequence[pytest.TestReport], run: _Run) -> bool:
    """Whether the test failed, errored, crashed or timed out under its mutant run (not: it passed or skipped)."""
    return any(r.failed for r in reports) or bool(run.failed) or any(e.ended_by for e in run.ends.values())
