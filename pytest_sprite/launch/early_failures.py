"""Launched agents that fail before they can serve: each error once, with the ranks that saw it.

A launched agent (mpiexec, pals, srun, torchrun) imports the conftests and collects the tests again, and
several may fail there: the same SyntaxError on every rank but 0, or a different error on each. The first
failure is not the whole story, so the failures are gathered until every agent of the world has either
connected or failed, the launch has ended, or :data:`SETTLE` seconds have passed since the first; then
each distinct error is shown once, under the ranks that saw it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ..plumbing.ranges import fold_ranks
from ..plumbing.timing import monotonic

__all__ = ["SETTLE", "EarlyFailures", "agents_failed", "collection_differs"]

SETTLE: Final = 5.0
"""Seconds the other agents get, after the first one failed, to fail too (or connect) before it is shown."""


def _agents(ranks: list[int | None]) -> str:
    known = [rank for rank in ranks if rank is not None]
    if not known:
        return "a rank agent"
    return f"{fold_ranks(known).replace('rank', 'rank agent', 1)}"


def _grouped(details: Mapping[int | None, str]) -> list[tuple[list[int | None], str]]:
    """Identical texts together, in the order of their lowest rank (an unknown rank last)."""
    groups: dict[str, list[int | None]] = {}
    for rank in sorted(details, key=lambda r: (r is None, r or 0)):
        groups.setdefault(details[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def agents_failed(details: Mapping[int | None, str]) -> str:
    """The agents that failed before they could join (their ``agent_failed`` texts), each error once."""
    groups = _grouped(details)
    if len(groups) == 1:
        ranks, text = groups[0]
        verb = "it" if len(ranks) == 1 else "they"
        return f"{_agents(ranks)} failed before {verb} could join the world:\n{text}"
    everyone = [rank for ranks, _ in groups for rank in ranks]
    parts = [
        f"{_agents(everyone)} failed before they could join the world, with {len(groups)} different errors:"
    ]
    parts += [f"--- {_agents(ranks)} ---\n{text}" for ranks, text in groups]
    return "\n".join(parts)


def collection_differs(errors: Mapping[int, Mapping[str, str]]) -> str:
    """Agents that collected with errors this process did not see (their ``collect_errors``), each once."""
    shown: dict[tuple[str, str], list[int]] = {}
    for agent in sorted(errors):
        for nodeid, text in errors[agent].items():
            shown.setdefault((nodeid, text.rstrip()), []).append(agent)
    lines = [f"{_agents(list(sorted(errors)))} could not collect what this process collected"]
    lines += [
        f"error collecting {nodeid or '.'} on {_agents(list(agents))}:\n{text}"
        for (nodeid, text), agents in shown.items()
    ]
    return "\n".join(lines)


class EarlyFailures:
    """Failures of agents gathered until they can be shown together (see the module's docstring)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.by_agent: dict[int, dict[str, str]] = {}

    def note(self, agent: int, errors: Mapping[str, str]) -> None:
        if self.first is None:
            self.first = monotonic()
        self.by_agent[agent] = dict(errors)

    def due(self, *, every_agent_spoke: bool) -> bool:
        """True once the gathered failures are to be shown: every agent spoke, or the others had their time."""
        if self.first is None:
            return False
        return every_agent_spoke or monotonic() - self.first > SETTLE

    def take(self) -> str:
        """The folded text, once; the gathering starts again empty."""
        text = collection_differs(self.by_agent)
        self.first, self.by_agent = None, {}
        return text
