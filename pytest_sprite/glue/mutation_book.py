"""``--sprite-mutate``'s results, kept with the session: which mutants each test killed and let survive.

The controller fills the book as mutant runs end; the reports (terminal table, ``--sprite-report``'s
``"mutation"``, JUnit properties) read it. A test's entry is complete before its own reports are logged:
the controller logs a test only after its mutant runs ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["MutationBook", "TestMutation", "mutation_key"]


@dataclass
class TestMutation:
    """One test's mutants: killed (it failed under them), survived (it passed), not applicable (never run)."""

    __test__ = False  # not a pytest test class

    killed: list[str] = field(default_factory=list)
    survived: list[str] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)
    not_run: str | None = None
    """Why no mutant ran for the test (its own run did not pass), or None."""

    @property
    def score(self) -> float | None:
        applicable = len(self.killed) + len(self.survived)
        return len(self.killed) / applicable if applicable else None


@dataclass
class MutationBook:
    """The session's mutants and each test's results, by node id in the order tests finished."""

    mutants: list[str]
    tests: dict[str, TestMutation] = field(default_factory=dict)

    def test(self, nodeid: str) -> TestMutation:
        return self.tests.setdefault(nodeid, TestMutation())

    def count(self, nodeid: str, mutant: str, *, killed: bool) -> None:
        """One mutant run of ``nodeid`` ended; lists stay in the selection's order, whatever order runs end in."""
        entry = self.test(nodeid)
        names = entry.killed if killed else entry.survived
        names.append(mutant)
        order = {name: i for i, name in enumerate(self.mutants)}
        names.sort(key=lambda name: order.get(name, len(order)))

    @property
    def killed(self) -> int:
        return sum(len(t.killed) for t in self.tests.values())

    @property
    def applicable(self) -> int:
        return sum(len(t.killed) + len(t.survived) for t in self.tests.values())

    @property
    def score(self) -> float | None:
        """Killed / applicable over the session; None when no mutant applied."""
        return self.killed / self.applicable if self.applicable else None

    def to_json(self) -> dict[str, Any]:
        """``--sprite-report``'s ``"mutation"`` object (see ``report.schema.json``)."""
        return {
            "mutants": list(self.mutants),
            "tests": {
                nodeid: {
                    "killed": list(t.killed),
                    "survived": list(t.survived),
                    "not_applicable": list(t.not_applicable),
                }
                for nodeid, t in self.tests.items()
            },
            "score": self.score,
        }

    def junit_properties(self, nodeid: str) -> list[tuple[str, Any]]:
        """``sprite.mutation.killed`` / ``.survived`` (comma lists) and ``.score`` of one test."""
        entry = self.tests.get(nodeid)
        if entry is None:
            return []
        props: list[tuple[str, Any]] = [
            ("sprite.mutation.killed", ",".join(entry.killed)),
            ("sprite.mutation.survived", ",".join(entry.survived)),
        ]
        if entry.score is not None:
            props.append(("sprite.mutation.score", round(entry.score, 4)))
        return props


mutation_key = pytest.StashKey[MutationBook]()
"""On the config under ``--sprite-mutate``: the session's book."""
