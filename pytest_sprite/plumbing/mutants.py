"""The mutant catalogue of ``--sprite-mutate``: names, families, spec strings, and which apply to a test.

A mutant is a distributed bug planted below the user's code (the collective family: in a wrapper around the
default process group's backend, see :mod:`pytest_sprite.rank.mutant_backend`). A test kills a mutant when it
fails under it; a suite that lets one survive would pass with that bug in the training stack. Stdlib only:
the controller parses and selects, the test child plants.

A spec string names one mutant and, optionally, where and when it acts: ``skip_allreduce@rank1:from3``
(ranks 1 only, from the third call of the op on each rank onwards). Without ``@`` the mutant's own default
ranks and the first call apply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "CATALOGUE",
    "FAMILIES",
    "Mutant",
    "MutantSpec",
    "applicable",
    "parse_spec",
    "select_mutants",
]

Op = Literal["allreduce", "broadcast", "allgather", "reduce_scatter", "training"]
"""The collective a mutant changes (what the clean run must have called for it to apply)."""


@dataclass(frozen=True, kw_only=True)
class Mutant:
    """One planted bug of the catalogue."""

    name: str
    family: str
    """``collective`` (planted in the process group) or ``training`` (planted by the fault hook)."""
    op: Op
    """The collective the clean run must have called for this mutant to apply."""
    ranks: Literal["last", "all"]
    """The ranks it acts on unless the spec names them: the last rank of the test, or every rank."""
    doc: str


CATALOGUE: Final[tuple[Mutant, ...]] = (
    Mutant(
        name="skip_allreduce",
        family="collective",
        op="allreduce",
        ranks="last",
        doc="the rank's all-reduce is skipped: its tensor keeps its own contribution",
    ),
    Mutant(
        name="allreduce_sum_as_mean",
        family="collective",
        op="allreduce",
        ranks="all",
        doc="the all-reduce's result is divided by the world size (a SUM read as the average)",
    ),
    Mutant(
        name="allreduce_mean_of_world_plus_one",
        family="collective",
        op="allreduce",
        ranks="all",
        doc="the all-reduce's result is scaled by world/(world+1) (the average of a world one rank larger)",
    ),
    Mutant(
        name="stale_allreduce",
        family="collective",
        op="allreduce",
        ranks="last",
        doc="the rank contributes a stale copy of the buffer (its previous call's input, zeros at first)",
    ),
    Mutant(
        name="broadcast_wrong_source",
        family="collective",
        op="broadcast",
        ranks="all",
        doc="the broadcast comes from the next rank instead of its source",
    ),
    Mutant(
        name="allgather_swap",
        family="collective",
        op="allgather",
        ranks="all",
        doc="the all-gather's shards of the first two ranks are swapped",
    ),
    Mutant(
        name="reduce_scatter_shift",
        family="collective",
        op="reduce_scatter",
        ranks="all",
        doc="each rank receives the reduce-scatter shard of the next rank",
    ),
)

FAMILIES: Final = tuple(sorted({m.family for m in CATALOGUE}))
_BY_NAME: Final[Mapping[str, Mutant]] = {m.name: m for m in CATALOGUE}
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
    mutant = _BY_NAME.get(name)
    if mutant is None:
        raise ValueError(
            f"{where}: {name!r} is not a mutant; valid mutants: {', '.join(_BY_NAME)} "
            f"(or a family: {', '.join(FAMILIES)}, or all)"
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
            chosen += [MutantSpec(mutant=m) for m in CATALOGUE]
        elif word in FAMILIES:
            chosen += [MutantSpec(mutant=m) for m in CATALOGUE if m.family == word]
        else:
            chosen.append(parse_spec(word, where))
    if not chosen:
        raise ValueError(f"{where}={value!r} selects no mutant; give all, a family or mutant names")
    seen: dict[str, MutantSpec] = {}
    for spec in chosen:
        seen.setdefault(spec.text, spec)
    return tuple(seen.values())


def applicable(spec: MutantSpec, called: Mapping[int, Sequence[str]], world_size: int) -> bool:
    """Whether ``spec`` can change a test whose clean run called ``called`` (rank -> op names, in order).

    It applies when some rank it acts on called its op at least ``start`` times; a mutant acting on every
    rank of a collective needs the call on any rank.
    """
    for rank in range(world_size):
        if spec.acts_on(rank, world_size) and _count(called.get(rank, ()), spec.mutant.op) >= spec.start:
            return True
    return False


def _count(ops: Iterable[str], op: str) -> int:
    return sum(1 for o in ops if o == op)
