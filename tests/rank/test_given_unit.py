"""@given in ranks tests, the child-side part, without processes: settings, seed, agreed outcomes (issue 9)."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.database import InMemoryExampleDatabase, ReadOnlyDatabase  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from pytest_sprite.rank.given import PeerFailedExample, echo_note, is_peer_echo, prepare_given  # noqa: E402

pytestmark = pytest.mark.cpu


def alone(outcome: object) -> Sequence[object]:
    return [outcome]


def prepare(
    test: Any, *, rank: int = 0, world_size: int = 2, seed: int | None = 1, agree: Any = None
) -> None:
    assert prepare_given(
        test,
        nodeid="t.py::test",
        rank=rank,
        world_size=world_size,
        seed=seed,
        only_harness_fixtures=True,
        agree=agree or (lambda outcome: [outcome] * world_size),
    )


def test_settings_that_depend_on_a_ranks_clock_are_off_and_only_rank_0_writes() -> None:
    db = InMemoryExampleDatabase()
    made = []
    for rank in (0, 1):

        @settings(database=db, deadline=200, suppress_health_check=[HealthCheck.filter_too_much])
        @given(st.integers())
        def test(x: int) -> None:
            pass

        prepare(test, rank=rank)
        made.append(test._hypothesis_internal_use_settings)  # type: ignore[attr-defined]
    for made_settings in made:
        assert made_settings.deadline is None
        assert set(made_settings.suppress_health_check) == {
            HealthCheck.filter_too_much,
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
        }
    assert made[0].database is db
    assert isinstance(made[1].database, ReadOnlyDatabase)


def test_one_rank_keeps_deadline_and_a_user_fixture_keeps_the_health_check() -> None:
    @settings(deadline=200)
    @given(st.integers())
    def test(x: int) -> None:
        pass

    assert prepare_given(
        test, nodeid="t", rank=0, world_size=1, seed=None, only_harness_fixtures=False, agree=alone
    )
    made = test._hypothesis_internal_use_settings  # type: ignore[attr-defined]
    assert made.deadline is not None and HealthCheck.function_scoped_fixture not in made.suppress_health_check


def test_plain_functions_are_left_alone() -> None:
    def test(x: int) -> None:
        pass

    assert not prepare_given(
        test, nodeid="t", rank=0, world_size=2, seed=1, only_harness_fixtures=True, agree=alone
    )


def draws(seed: int, nodeid: str = "t.py::test") -> list[int]:
    seen: list[int] = []

    # derandomize=False: under CI (the CI variable set) hypothesis loads its "ci" profile, which
    # derandomizes every test and so ignores the seed this checks
    @settings(database=None, max_examples=20, derandomize=False)
    @given(st.integers())
    def test(x: int) -> None:
        seen.append(x)

    assert prepare_given(
        test, nodeid=nodeid, rank=0, world_size=1, seed=seed, only_harness_fixtures=True, agree=alone
    )
    test()
    return seen


def test_the_same_seed_draws_the_same_examples_in_the_same_order() -> None:
    first = draws(1234)
    assert len(first) == 20
    assert draws(1234) == first
    assert draws(1235) != first
    assert draws(1234, nodeid="t.py::other") != first


def scripted_peer(rank: int, peer_outcome: Callable[[], object]) -> Callable[[object], Sequence[object]]:
    """An agree() for a world of two in which the other rank's outcome is scripted."""

    def agree(outcome: object) -> Sequence[object]:
        peer = peer_outcome()
        return [outcome, peer] if rank == 0 else [peer, outcome]

    return agree


def test_a_peers_failed_example_fails_this_rank_too_and_shrinks_alike() -> None:
    current: list[int] = []

    @settings(database=None, max_examples=200)
    @given(st.integers(min_value=0, max_value=1000))
    def test(x: int) -> None:
        current[:] = [x]

    def peer() -> object:  # rank 1 fails every example above 5
        return "AssertionError: x too big" if current[0] > 5 else None

    prepare(test, rank=0, agree=scripted_peer(0, peer))
    with pytest.raises(PeerFailedExample) as exc:
        test()
    assert str(exc.value) == "rank 1 failed this example: AssertionError: x too big"
    assert current == [6], "rank 0's engine shrank to the peer's minimal failing example"
    assert is_peer_echo(exc.value)
    note = echo_note(exc.value)
    assert note == (
        "rank 1 failed this example: AssertionError: x too big This rank ran the same examples and passed them; "
        "it raised only to keep every rank's hypothesis engine in step, and the failure is reported by the rank "
        "that had it."
    )


def test_own_failure_is_raised_as_itself() -> None:
    @settings(database=None)
    @given(st.integers(min_value=0, max_value=10))
    def test(x: int) -> None:
        assert x < 3, "mine"

    prepare(test, rank=1, agree=scripted_peer(1, lambda: None))
    with pytest.raises(AssertionError, match="mine") as exc:
        test()
    assert not is_peer_echo(exc.value) and echo_note(exc.value) is None


def test_an_example_a_peer_rejects_is_rejected_here_too() -> None:
    @settings(database=None, max_examples=20, suppress_health_check=[HealthCheck.filter_too_much])
    @given(st.integers())
    def test(x: int) -> None:
        pass

    prepare(test, rank=0, agree=scripted_peer(0, lambda: "assume"))
    with pytest.raises(Unsatisfiable):
        test()


def test_groups_of_echoes_are_echoes() -> None:
    group_type = getattr(builtins, "ExceptionGroup", None)
    if group_type is None:
        pytest.skip("ExceptionGroup is builtin from Python 3.11")
    group = group_type("two", [PeerFailedExample("rank 1 failed this example: A"), PeerFailedExample("B")])
    assert is_peer_echo(group)
    assert not is_peer_echo(group_type("mixed", [PeerFailedExample("x"), ValueError("y")]))
    assert not is_peer_echo(None)
