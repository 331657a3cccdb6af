"""The mutant catalogue of ``--sprite-mutate``: names, families, spec strings, and which apply to a test.

A mutant is a distributed bug planted below the user's code: the collective family in a wrapper around the
default process group's backend (:mod:`pytest_sprite.rank.mutant_backend`); the training and checkpoint
families are the fault registry's faults that can be planted into any Lightning fit from outside it
(:mod:`pytest_sprite.rank.fault_mutants`), one mutant per fault, made from the registry each session. A test
kills a mutant when it fails under it; a suite that lets one survive would pass with that bug in the
training stack. Stdlib only: the controller parses and selects, the test child plants and records
(:class:`MutationRun`).

A spec string names one mutant and, optionally, where and when it acts: ``skip_allreduce@rank1:from3``
(ranks 1 only, from the third call of the op on each rank onwards). Without ``@`` the mutant's own default
ranks and the first call apply.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = [
    "CATALOGUE",
    "PLANTABLE_HOOKS",
    "PLANTED",
    "Mutant",
    "MutantSpec",
    "MutationRun",
    "applicable",
    "catalogue",
    "current_run",
    "families",
    "fault_mutant",
    "parse_spec",
    "select_mutants",
    "start_run",
    "use_fault_mutants",
]


@dataclass(frozen=True, kw_only=True)
class Mutant:
    """One planted bug of the catalogue."""

    name: str
    family: str
    """``collective`` (planted in the process group), ``training`` (in a Lightning fit's steps) or
    ``checkpoint`` (in a Lightning fit right after its checkpoint restore)."""
    op: str
    """What the clean run must have recorded for this mutant to apply: a collective's name (``allreduce``),
    ``step:<fault>`` (a training step the fault can be planted in) or ``restore:<fault>`` (such a restore)."""
    ranks: Literal["last", "all"]
    """The ranks it acts on unless the spec names them: the last rank of the test, or every rank."""
    doc: str
    min_world: int = 1
    """The smallest world it can change: 2 for a mutant that is the identity on one rank (skipping an
    all-reduce of one, a broadcast from the next of one), not applicable to a one-rank test."""


_COLLECTIVE_DOCS: Final[Mapping[str, str]] = {
    "skip_allreduce": "the rank's all-reduce is skipped: its tensor keeps its own contribution",
    "allreduce_sum_as_mean": "the all-reduce's result is divided by the world size (a SUM read as the average)",
    "allreduce_mean_of_world_plus_one": (
        "the all-reduce's result is scaled by world/(world+1) (the average of a world one rank larger)"
    ),
    "stale_allreduce": "the rank contributes a stale copy of the buffer (its previous call's input, zeros at first)",
    "broadcast_wrong_source": "the broadcast comes from the next rank instead of its source",
    "allgather_swap": "the all-gather's shards of the first two ranks are swapped",
    "reduce_scatter_shift": "each rank receives the reduce-scatter shard of the next rank",
}
"""What each collective mutant does to the collective it is planted in (its ``doc``)."""


def _collective(name: str, op: str, ranks: Literal["last", "all"], *, min_world: int) -> Mutant:
    """A collective mutant, so that the catalogue below is a table of what sets them apart, one a line."""
    return Mutant(
        name=name, family="collective", op=op, ranks=ranks, doc=_COLLECTIVE_DOCS[name], min_world=min_world
    )


CATALOGUE: Final[tuple[Mutant, ...]] = (
    _collective("skip_allreduce", "allreduce", "last", min_world=2),
    _collective("allreduce_sum_as_mean", "allreduce", "all", min_world=2),
    _collective("allreduce_mean_of_world_plus_one", "allreduce", "all", min_world=1),
    _collective("stale_allreduce", "allreduce", "last", min_world=1),
    _collective("broadcast_wrong_source", "broadcast", "all", min_world=2),
    _collective("allgather_swap", "allgather", "all", min_world=2),
    _collective("reduce_scatter_shift", "reduce_scatter", "all", min_world=2),
)

PLANTABLE_HOOKS: Final[Mapping[str, str]] = {
    "loss": "training",
    "gradients": "training",
    "after_restore": "checkpoint",
}
"""The fault planters' hooks a mutant can reach in any Lightning fit from outside it, and the family of a
fault that acts there (a fault with a restore hook is a checkpoint mutant). The other hooks need the arm's
cooperation (which trainables the strategy syncs, the forward's context, skipping a step)."""

_FAULT_MUTANTS: list[Mutant] = []
"""This session's training and checkpoint mutants, made from the fault registry by :func:`use_fault_mutants`."""


def fault_mutant(name: str, description: str, hooks: Sequence[str]) -> Mutant | None:
    """The mutant of the registry's fault ``name`` (whose planter overrides ``hooks``), or None when a hook it
    needs cannot be reached from outside the arm (or it has none)."""
    if not hooks or any(h not in PLANTABLE_HOOKS for h in hooks):
        return None
    family = "checkpoint" if "after_restore" in hooks else "training"
    op = f"restore:{name}" if family == "checkpoint" else f"step:{name}"
    return Mutant(name=name, family=family, op=op, ranks="all", doc=description)


def use_fault_mutants(mutants: Iterable[Mutant]) -> None:
    """Make ``mutants`` (one per plantable registered fault) this session's training and checkpoint mutants.

    Raises ValueError for a fault whose name a spec cannot carry or that a collective mutant already has.
    """
    chosen = list(mutants)
    for m in chosen:
        if m.name in {c.name for c in CATALOGUE} or not _NAME.match(m.name):
            raise ValueError(
                f"fault {m.name!r} cannot be a --sprite-mutate mutant: a mutant's name is letters, digits, "
                "'-' and '_' and differs from the collective mutants'; register the fault under another name"
            )
    _FAULT_MUTANTS[:] = chosen


def catalogue() -> tuple[Mutant, ...]:
    """Every mutant of this session: the collectives', then the fault registry's, in registry order."""
    return (*CATALOGUE, *_FAULT_MUTANTS)


def families() -> tuple[str, ...]:
    """The families of this session's mutants, sorted."""
    return tuple(sorted({m.family for m in catalogue()}))


_NAME: Final = re.compile(r"^[A-Za-z0-9_-]+$")
_WHERE: Final = re.compile(r"^(?:rank(?P<ranks>\d+(?:,\d+)*))?(?::?from(?P<start>\d+))?$")


@dataclass(frozen=True, kw_only=True)
class MutantSpec:
    """A mutant and where it acts: on which ranks, from which call of its op on."""

    mutant: Mutant
    ranks: tuple[int, ...] | None = None
    """The test ranks it acts on; None: the mutant's default (its ``ranks``)."""
    start: int = 1
    """The first call (1-based, counted per rank and per op) it changes."""

    def __post_init__(self) -> None:
        if self.start < 1:
            raise ValueError(
                f"mutant {self.mutant.name}: from{self.start} counts calls from 1; use from1 or more"
            )

    @property
    def text(self) -> str:
        """The spec string, as :func:`parse_spec` reads it."""
        where = f"rank{','.join(map(str, self.ranks))}" if self.ranks is not None else ""
        when = f"from{self.start}" if self.start != 1 else ""
        tail = ":".join(p for p in (where, when) if p)
        return f"{self.mutant.name}@{tail}" if tail else self.mutant.name

    def acts_on(self, rank: int, world_size: int) -> bool:
        """Whether rank ``rank`` of a ``world_size`` test is mutated."""
        if self.ranks is not None:
            return rank in self.ranks
        return self.mutant.ranks == "all" or rank == world_size - 1


def parse_spec(text: str, where: str = "--sprite-mutate") -> MutantSpec:
    """``name`` or ``name@rank1,2:from3`` -> a MutantSpec; raises ValueError naming ``where``."""
    name, _, tail = text.strip().partition("@")
    by_name = {m.name: m for m in catalogue()}
    mutant = by_name.get(name)
    if mutant is None:
        raise ValueError(
            f"{where}: {name!r} is not a mutant; valid mutants: {', '.join(by_name)} "
            f"(or a family: {', '.join(families())}, or all)"
        )
    if not tail:
        return MutantSpec(mutant=mutant)
    match = _WHERE.match(tail)
    if match is None or not tail:
        raise ValueError(
            f"{where}: {text!r} does not say where the mutant acts; write {name}@rank1,2:from3 "
            "(ranks, the first call mutated, or both)"
        )
    ranks = tuple(int(r) for r in match["ranks"].split(",")) if match["ranks"] else None
    return MutantSpec(mutant=mutant, ranks=ranks, start=int(match["start"] or 1))


def select_mutants(value: str, where: str) -> tuple[MutantSpec, ...]:
    """A comma list of families, mutant names or specs, or ``all`` -> the selected specs, in catalogue order
    for families and ``all`` and as given otherwise; duplicates dropped."""
    chosen: list[MutantSpec] = []
    for word in (w.strip() for w in value.split(",")):
        if not word:
            continue
        if word == "all":
            chosen += [MutantSpec(mutant=m) for m in catalogue()]
        elif word in families():
            chosen += [MutantSpec(mutant=m) for m in catalogue() if m.family == word]
        else:
            chosen.append(parse_spec(word, where))
    if not chosen:
        raise ValueError(f"{where}={value!r} selects no mutant; give all, a family or mutant names")
    seen: dict[str, MutantSpec] = {}
    for spec in chosen:
        seen.setdefault(spec.text, spec)
    return tuple(seen.values())


PLANTED: Final = "planted:"
"""The prefix of the op a test's clean run records when it plants a fault of its own (``expect_fault_rejected``)."""


def applicable(spec: MutantSpec, called: Mapping[int, Sequence[str]], world_size: int) -> bool:
    """Whether ``spec`` can change a test whose clean run called ``called`` (rank -> op names, in order).

    It applies when some rank it acts on called its op at least ``start`` times; a mutant acting on every
    rank of a collective needs the call on any rank. One that cannot change a world this small never applies,
    nor does any to a test that plants a fault of its own: it proves that a check rejects a bug it already
    runs, and a second bug on top says nothing of what its checks catch.
    """
    if world_size < spec.mutant.min_world:
        return False
    if any(op.startswith(PLANTED) for ops in called.values() for op in ops):
        return False
    for rank in range(world_size):
        if spec.acts_on(rank, world_size) and _count(called.get(rank, ()), spec.mutant.op) >= spec.start:
            return True
    return False


def _count(ops: Iterable[str], op: str) -> int:
    return sum(1 for o in ops if o == op)


@dataclass
class MutationRun:
    """This process's run under ``--sprite-mutate``: the mutant it plants (None: the clean run, which only
    records) and the record of what it called, in order: collectives, and the fit steps and restores a
    fault mutant could be planted in."""

    spec: MutantSpec | None
    ops: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    group_backend: Callable[[str], str] | None = None
    """How a sub-world rank started from this process makes its default group (the same recording and
    planting backend; picklable): its ranks plant the same mutant and send back what they recorded."""

    def note(self, op: str) -> None:
        """Record ``op`` where no mutant acts (a fault the test plants itself)."""
        self.ops.append(op)

    def acting(self, op: str, rank: int, world_size: int) -> MutantSpec | None:
        """Record one call of ``op`` on ``rank``; the spec when the planted mutant changes this call there."""
        self.ops.append(op)
        self.counts[op] = self.counts.get(op, 0) + 1
        spec = self.spec
        if spec is None or spec.mutant.op != op or self.counts[op] < spec.start:
            return None
        return spec if spec.acts_on(rank, world_size) else None


_RUN: list[MutationRun] = []


def start_run(mutant: str | None) -> MutationRun:
    """Begin this process's mutation run, planting ``mutant`` (a spec string; None: the clean run)."""
    _RUN[:] = [MutationRun(spec=parse_spec(mutant) if mutant else None)]
    return _RUN[0]


def current_run() -> MutationRun | None:
    """This process's mutation run, or None outside ``--sprite-mutate`` (the planters then do nothing)."""
    return _RUN[0] if _RUN else None
