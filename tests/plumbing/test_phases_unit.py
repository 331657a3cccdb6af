"""The phase clock of ``--sprite-profile``: nested phases counted once, absorbed totals not counted twice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_sprite.plumbing import phases

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """A clock that moves only when the test says: ``now[0] += 2`` is two seconds."""
    now = [100.0]
    monkeypatch.setattr(phases, "perf_counter", lambda: now[0])
    phases.enable(True)
    yield now
    phases.enable(False)


def test_a_nested_phase_is_taken_out_of_the_one_around_it(clock: list[float]) -> None:
    with phases.phase("fit setup"):
        clock[0] += 1
        with phases.phase("steps"):
            clock[0] += 5
        clock[0] += 2
    assert phases.take() == {"steps": 5.0, "fit setup": 3.0}
    assert phases.take() == {}


def test_the_same_phase_nested_in_itself_adds_up(clock: list[float]) -> None:
    with phases.phase("fit setup"):
        clock[0] += 1
        phases.enter("fit setup")
        clock[0] += 2
        phases.leave("fit setup")
        clock[0] += 4
    assert phases.take() == {"fit setup": 7.0}


def test_leaving_a_phase_closes_what_was_left_open_inside_it(clock: list[float]) -> None:
    phases.enter("fit setup")
    phases.enter("steps")  # a fit that raised mid-step never left it
    clock[0] += 3
    phases.leave("fit setup")
    phases.leave("steps")  # no longer open: nothing happens
    assert phases.take() == {"steps": 3.0, "fit setup": 0.0}


def test_absorbed_totals_are_counted_once_inside_the_open_phase(clock: list[float]) -> None:
    with phases.phase("fork"):
        clock[0] += 10  # the sub-world ran for 10 s, 8 of them in its rank's phases
        phases.absorb({"join": 1.0, "steps": 7.0})
    assert phases.take() == {"join": 1.0, "steps": 7.0, "fork": 2.0}


def test_a_lifetime_counts_what_no_phase_did(clock: list[float]) -> None:
    started = clock[0]
    with phases.phase("join"):
        clock[0] += 1
    clock[0] += 4
    assert phases.take_lifetime(started, "sub-world other") == {"join": 1.0, "sub-world other": 4.0}


def test_off_it_records_nothing(clock: list[float]) -> None:
    phases.enable(False)
    with phases.phase("steps"):
        clock[0] += 1
    phases.absorb({"join": 1.0})
    assert phases.take() == {}
