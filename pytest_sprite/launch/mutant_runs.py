"""``--sprite-mutate`` in the controller: which mutants a test runs under, whether one was killed, and the
bookkeeping of a test's mutant runs until its last has ended (the book: :mod:`pytest_sprite.glue.mutation_book`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pytest

from ..glue.mutation_book import MutationBook, mutation_key
from ..glue.options import Settings
from ..plumbing.mutants import MutantSpec, applicable

if TYPE_CHECKING:
    from .item_runs import _Run

__all__ = ["MutantRuns", "killed", "mutants_to_run"]


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


class MutantRuns:
    """A test's mutant runs, queued once its own run passed; the test is logged after the last one ends."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.specs = settings.mutate
        self.floor = settings.mutate_fail_under
        self.book: MutationBook | None = None
        """Each test's killed and surviving mutants (also on the config's stash, for the reports)."""
        if settings.mutate:
            self.book = config.stash[mutation_key] = MutationBook([s.text for s in settings.mutate])
        self.parent: dict[int, _Run] = {}
        """Mutant run id -> the test's own run, logged once its last mutant run has ended."""
        self.left: dict[int, set[int]] = {}
        """The test's own run id -> its mutant runs still queued or running."""

    @property
    def on(self) -> bool:
        return self.book is not None

    def submit_for(
        self,
        run: _Run,
        reports: Sequence[pytest.TestReport],
        *,
        stopping: bool,
        submit: Callable[[str], _Run],
    ) -> bool:
        """Queue ``run``'s test once per applicable mutant (``submit`` queues one); whether any was queued."""
        assert self.book is not None
        entry = self.book.test(run.item.nodeid)
        to_run, entry.not_applicable, entry.not_run = mutants_to_run(
            self.specs, run, reports, stopping=stopping
        )
        for text in to_run:
            mutant_run = submit(text)
            self.parent[mutant_run.run_id] = run
            self.left.setdefault(run.run_id, set()).add(mutant_run.run_id)
        return bool(to_run)

    def finished(self, run: _Run, reports: Sequence[pytest.TestReport], *, dropped: bool) -> _Run | None:
        """Count a mutant run that ended (not one ``dropped`` unrun); the test's own run once it was the last."""
        parent = self.parent.pop(run.run_id)
        assert self.book is not None and run.mutant is not None
        if not dropped:
            self.book.count(parent.item.nodeid, run.mutant, killed=killed(reports, run))
        left = self.left[parent.run_id]
        left.discard(run.run_id)
        if left:
            return None
        del self.left[parent.run_id]
        return parent

    def verdict(self, session: pytest.Session) -> None:
        """``--sprite-mutate-fail-under``: a session whose score is lower fails (the tests' outcomes stand)."""
        if self.book is None or self.floor is None:
            return
        score = self.book.score
        if score is not None and score < self.floor and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
