"""The mutant catalogue without processes: spec strings, selection, applicability, the book and its JSON."""

from __future__ import annotations

import pytest

from pytest_sprite.glue.mutation_book import MutationBook
from pytest_sprite.plumbing.mutants import (
    _RUN,
    CATALOGUE,
    applicable,
    catalogue,
    fault_mutant,
    parse_spec,
    select_mutants,
    use_fault_mutants,
)
from pytest_sprite.report.mutation_table import mutation_lines

pytestmark = pytest.mark.cpu


def test_a_spec_names_ranks_and_the_first_call() -> None:
    spec = parse_spec("skip_allreduce@rank1:from3")
    assert (spec.mutant.name, spec.ranks, spec.start) == ("skip_allreduce", (1,), 3)
    assert spec.text == "skip_allreduce@rank1:from3"
    assert parse_spec("allgather_swap@from2").text == "allgather_swap@from2"
    assert parse_spec("skip_allreduce").acts_on(3, 4) and not parse_spec("skip_allreduce").acts_on(0, 4)


def test_bad_specs_name_the_source_and_the_valid_values() -> None:
    with pytest.raises(
        ValueError, match=r"^--sprite-mutate: 'skip' is not a mutant; valid mutants: skip_allreduce, "
    ):
        parse_spec("skip")
    with pytest.raises(
        ValueError, match=r"does not say where the mutant acts; write skip_allreduce@rank1,2:from3"
    ):
        parse_spec("skip_allreduce@r1")
    with pytest.raises(ValueError, match=r"counts calls from 1; use from1 or more"):
        parse_spec("skip_allreduce@from0")
    with pytest.raises(ValueError, match=r"^ini option sprite_mutate=',' selects no mutant"):
        select_mutants(",", "ini option sprite_mutate")


def test_selection_by_family_name_or_all() -> None:
    assert [s.text for s in select_mutants("all", "x")] == [m.name for m in catalogue()]
    assert len(select_mutants("collective", "x")) == len(CATALOGUE)
    chosen = select_mutants("allgather_swap, skip_allreduce@rank0, allgather_swap", "x")
    assert [s.text for s in chosen] == ["allgather_swap", "skip_allreduce@rank0"]


def test_a_mutant_applies_only_where_its_op_was_called_often_enough() -> None:
    called = {0: ["allreduce", "broadcast"], 1: ["allreduce", "allreduce"]}
    assert applicable(parse_spec("skip_allreduce"), called, 2)  # rank 1, the last
    assert not applicable(parse_spec("skip_allreduce@rank0:from2"), called, 2)
    assert applicable(parse_spec("skip_allreduce@rank1:from2"), called, 2)
    assert applicable(parse_spec("broadcast_wrong_source"), called, 2)
    assert not applicable(parse_spec("allgather_swap"), called, 2)
    # on one rank, skipping or dividing by the world changes nothing: not applicable; a stale copy does
    assert not applicable(parse_spec("skip_allreduce"), {0: ["allreduce"]}, 1)
    assert not applicable(parse_spec("allreduce_sum_as_mean"), {0: ["allreduce"]}, 1)
    assert applicable(parse_spec("stale_allreduce"), {0: ["allreduce"]}, 1)
    assert applicable(parse_spec("allreduce_mean_of_world_plus_one"), {0: ["allreduce"]}, 1)


def test_no_mutant_applies_to_a_test_that_plants_its_own_fault() -> None:
    """A negative control (``expect_fault_rejected``) already runs a bug: a mutant on top proves nothing."""
    from pytest_sprite import expect_fault_rejected
    from pytest_sprite.plumbing.mutants import start_run

    run = start_run(None)
    try:
        with pytest.raises(AssertionError), expect_fault_rejected("missing-rank"):
            raise AssertionError("not judged here")
    finally:
        _RUN.clear()
    called = {0: ["allreduce", *run.ops], 1: ["allreduce"]}
    assert run.ops == ["planted:missing-rank"]
    assert not applicable(parse_spec("skip_allreduce"), called, 2)
    assert applicable(parse_spec("skip_allreduce"), {0: ["allreduce"], 1: ["allreduce"]}, 2)


def test_the_book_scores_and_reports() -> None:
    book = MutationBook(["skip_allreduce", "allgather_swap"])
    strong, weak = book.test("t.py::strong"), book.test("t.py::weak")
    strong.killed.append("skip_allreduce")
    strong.not_applicable.append("allgather_swap")
    weak.survived.append("skip_allreduce")
    assert (book.killed, book.applicable, book.score) == (1, 2, 0.5)
    document = book.to_json()
    assert document["tests"]["t.py::weak"] == {
        "killed": [],
        "survived": ["skip_allreduce"],
        "not_applicable": [],
    }
    assert book.junit_properties("t.py::strong") == [
        ("sprite.mutation.killed", "skip_allreduce"),
        ("sprite.mutation.survived", ""),
        ("sprite.mutation.score", 1.0),
    ]
    assert mutation_lines(book)[-1] == "mutation score: 0.50, 1 killed of 2 applicable"
    assert MutationBook([]).score is None


def test_the_fault_registry_makes_the_training_and_checkpoint_mutants() -> None:
    """One registry: each registered fault a fit can take from outside the arms is a mutant, the rest are not."""
    from pytest_sprite.planted_faults import registered_faults

    made = {m.name: m for m in catalogue() if m.family != "collective"}
    assert {n: (m.family, m.op) for n, m in made.items()} == {
        "missing-rank": ("training", "step:missing-rank"),
        "wrong-scale": ("training", "step:wrong-scale"),
        "accumulate-sum": ("training", "step:accumulate-sum"),
        "scale-grad": ("training", "step:scale-grad"),
        "dropped-optimizer-state": ("checkpoint", "restore:dropped-optimizer-state"),
        "reset-lr-scheduler": ("checkpoint", "restore:reset-lr-scheduler"),
        "perturbed-weight": ("checkpoint", "restore:perturbed-weight"),
        "unrestored-rng": ("checkpoint", "restore:unrestored-rng"),
    }
    left_out = set(registered_faults()) - set(made)
    assert left_out == {"fp32-backbone", "local-adapter", "skip-update"}  # they need the arm's own hooks
    assert [s.text for s in select_mutants("checkpoint", "x")] == [
        "dropped-optimizer-state",
        "reset-lr-scheduler",
        "perturbed-weight",
        "unrestored-rng",
    ]
    assert fault_mutant("x", "", ("loss", "forward_context")) is None


def test_a_fault_a_spec_cannot_name_is_refused() -> None:
    before = [m for m in catalogue() if m.family != "collective"]
    for name in ("skip_allreduce", "two words", "a@b"):
        mutant = fault_mutant(name, "", ("loss",))
        assert mutant is not None
        with pytest.raises(ValueError, match=rf"^fault '{name}' cannot be a --sprite-mutate mutant: "):
            use_fault_mutants([mutant])
    assert [m for m in catalogue() if m.family != "collective"] == before
