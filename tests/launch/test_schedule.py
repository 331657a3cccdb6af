"""The packing scheduler and the utilisation figures, without processes (issue 14).

Properties are checked against an oracle written from the policy's words, over random worlds (nodes of
different sizes), random suites and random finishing orders.
"""

from __future__ import annotations

import heapq
import random
import re
from collections.abc import Hashable, Sequence
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_sprite.launch.schedule import Scheduler, Slot, Start, Utilisation

pytestmark = pytest.mark.cpu

K = TypeVar("K", bound=Hashable)


def world(*node_sizes: int) -> list[Slot]:
    """Agents in launcher order: node 0's ranks first, then node 1's, ..."""
    slots, rank = [], 0
    for node, size in enumerate(node_sizes):
        for _ in range(size):
            slots.append(Slot(rank=rank, node=node))
            rank += 1
    return slots


def keys(starts: Sequence[Start[K]]) -> list[K]:
    return [s.key for s in starts]


# -- the rules, one example each ----------------------------------------------------------------


def test_small_tests_run_side_by_side_on_disjoint_agents() -> None:
    sched: Scheduler[str] = Scheduler(world(8))
    for i in range(5):
        sched.submit(f"t{i}", 2)
    starts = sched.starts()
    assert [(s.key, s.agents) for s in starts] == [
        ("t0", (0, 1)),
        ("t1", (2, 3)),
        ("t2", (4, 5)),
        ("t3", (6, 7)),
    ]
    assert sched.pending == ("t4",)
    assert sched.finish("t2") == (4, 5)
    assert [(s.key, s.agents) for s in sched.starts()] == [("t4", (4, 5))]


def test_the_first_test_of_a_session_gets_agents_0_to_n_minus_1_as_before() -> None:
    sched: Scheduler[str] = Scheduler(world(4, 4))
    sched.submit("t", 3)
    assert sched.starts() == [Start("t", (0, 1, 2))]


def test_a_blocked_head_holds_back_every_test_behind_it() -> None:
    sched: Scheduler[str] = Scheduler(world(8))
    sched.submit("a", 2)
    sched.submit("b", 4)
    sched.submit("whole", 8)
    sched.submit("small", 1)
    assert keys(sched.starts()) == ["a", "b"]
    # Two agents are free and "small" would fit, but "whole" is first in collection order.
    assert sched.free == {6, 7}
    assert sched.starts() == []
    sched.finish("a")
    assert sched.starts() == []
    sched.finish("b")
    assert sched.starts() == [Start("whole", tuple(range(8)))]
    sched.finish("whole")
    assert keys(sched.starts()) == ["small"]


def test_a_whole_world_test_is_not_starved_by_a_stream_of_small_ones() -> None:
    sched: Scheduler[int] = Scheduler(world(4))
    sched.submit(0, 2)
    sched.submit(1, 2)
    sched.submit(2, 4)
    for key in range(3, 100):
        sched.submit(key, 1)
    assert keys(sched.starts()) == [0, 1]
    sched.finish(0)
    assert sched.starts() == []
    sched.finish(1)
    assert keys(sched.starts()) == [2]


def test_a_test_that_fits_a_node_waits_for_room_on_one_node() -> None:
    sched: Scheduler[str] = Scheduler(world(4, 4))
    for key in ("a", "b", "c"):
        sched.submit(key, 3)
    started = sched.starts()
    assert [(s.key, s.agents) for s in started] == [("a", (0, 1, 2)), ("b", (4, 5, 6))]
    # Agents 3 and 7 are free (two of them), but on two nodes: "c" waits.
    assert sched.free == {3, 7}
    assert sched.starts() == []
    sched.finish("b")
    assert sched.starts() == [Start("c", (4, 5, 6))]


def test_best_fit_keeps_the_larger_hole_for_a_larger_test() -> None:
    sched: Scheduler[str] = Scheduler(world(4, 4))
    sched.submit("x", 3)  # node 0: 1 free left
    sched.starts()
    sched.submit("one", 1)  # best fit: node 0's last agent, not node 1
    sched.submit("four", 4)  # node 1 stays whole for it
    assert [(s.key, s.agents) for s in sched.starts()] == [("one", (3,)), ("four", (4, 5, 6, 7))]


def test_a_test_larger_than_a_node_spans_the_fewest_nodes() -> None:
    sched: Scheduler[str] = Scheduler(world(4, 4, 4))
    sched.submit("a", 2)  # node 0 keeps 2 free
    sched.starts()
    sched.submit("big", 6)  # larger than a node: node 1 whole (the freest), then 2 of node 2
    (start,) = sched.starts()
    assert start.agents == (4, 5, 6, 7, 8, 9)
    sched.submit("rest", 4)
    assert sched.starts() == []  # node 0 has 2 free and node 2 has 2: a 4-rank test fits a node
    sched.finish("a")
    assert sched.starts() == [Start("rest", (0, 1, 2, 3))]


def test_a_spanning_test_orders_its_ranks_by_node_then_rank() -> None:
    sched: Scheduler[str] = Scheduler([Slot(rank=0, node=1), Slot(rank=1, node=0), Slot(rank=2, node=1)])
    sched.submit("all", 3)
    assert sched.starts() == [Start("all", (1, 0, 2))]


def test_pack_off_runs_one_test_at_a_time_on_agents_0_to_n_minus_1() -> None:
    sched: Scheduler[str] = Scheduler(world(2, 2), pack=False)
    sched.submit("a", 1)
    sched.submit("b", 3)
    assert sched.starts() == [Start("a", (0,))]
    assert sched.starts() == []
    sched.finish("a")
    assert sched.starts() == [Start("b", (0, 1, 2))]  # across nodes, as before packing existed


def test_stop_finishes_what_is_in_flight_and_starts_nothing_new() -> None:
    sched: Scheduler[str] = Scheduler(world(4))
    for key in ("a", "b", "c", "d"):
        sched.submit(key, 2)
    assert keys(sched.starts()) == ["a", "b"]
    assert sched.stop() == ["c", "d"]
    assert sched.in_flight == {"a": (0, 1), "b": (2, 3)}
    sched.finish("a")
    sched.submit("e", 1)
    assert sched.starts() == []
    sched.finish("b")
    assert sched.starts() == []
    assert not sched.in_flight


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.submit("t", 0), "test 't' needs 0 ranks; a world of 4 can place 1 to 4"),
        (lambda s: s.submit("t", 5), "test 't' needs 5 ranks; a world of 4 can place 1 to 4"),
        (lambda s: s.finish("nope"), "test 'nope' is not in flight"),
    ],
)
def test_misuse_is_a_clear_error(call: object, message: str) -> None:
    sched: Scheduler[str] = Scheduler(world(4))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call(sched)  # type: ignore[operator]


def test_a_key_cannot_be_queued_twice() -> None:
    sched: Scheduler[str] = Scheduler(world(4))
    sched.submit("t", 1)
    with pytest.raises(ValueError, match=r"^test 't' is already queued or running$"):
        sched.submit("t", 1)
    sched.starts()
    with pytest.raises(ValueError, match=r"^test 't' is already queued or running$"):
        sched.submit("t", 1)


def test_agents_must_be_distinct_and_present() -> None:
    with pytest.raises(ValueError, match=r"^agent rank 0 is given twice$"):
        Scheduler([Slot(rank=0, node=0), Slot(rank=0, node=1)])
    with pytest.raises(ValueError, match=r"^a scheduler needs at least one agent$"):
        Scheduler([])


# -- properties over random worlds, suites and finishing orders -----------------------------------

node_sizes = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@st.composite
def sessions(draw: st.DrawFn) -> tuple[list[Slot], list[int], list[int], bool]:
    slots = world(*draw(node_sizes))
    sizes = draw(st.lists(st.integers(1, len(slots)), min_size=1, max_size=30))
    # Which in-flight test finishes next, at each step: an index into the tests in flight.
    picks = draw(st.lists(st.integers(0, 10**6), min_size=len(sizes), max_size=len(sizes)))
    return slots, sizes, picks, draw(st.booleans())


def oracle_can_place(slots: list[Slot], free: set[int], size: int) -> bool:
    """The policy's words: one node when the test fits a node, else any agents."""
    capacity: dict[int, int] = {}
    room: dict[int, int] = {}
    for slot in slots:
        capacity[slot.node] = capacity.get(slot.node, 0) + 1
        if slot.rank in free:
            room[slot.node] = room.get(slot.node, 0) + 1
    if size <= max(capacity.values()):
        return any(n >= size for n in room.values())
    return len(free) >= size


def fewest_nodes(slots: list[Slot], free: set[int], size: int) -> int:
    room = sorted(
        (sum(1 for s in slots if s.node == node and s.rank in free) for node in {s.node for s in slots}),
        reverse=True,
    )
    total = 0
    for used, n in enumerate(room, start=1):
        total += n
        if total >= size:
            return used
    raise AssertionError("not placeable")


@settings(max_examples=400, deadline=None)
@given(sessions())
def test_every_schedule_keeps_the_policy(session: tuple[list[Slot], list[int], list[int], bool]) -> None:
    slots, sizes, picks, pack = session
    node_of = {s.rank: s.node for s in slots}
    largest = max(sum(1 for s in slots if s.node == node) for node in set(node_of.values()))
    sched: Scheduler[int] = Scheduler(slots, pack=pack)
    for key, size in enumerate(sizes):
        sched.submit(key, size)
    order: list[int] = []
    picks_left = list(picks)
    while not sched.done:
        free_before = set(sched.free)
        busy_before = {a for agents in sched.in_flight.values() for a in agents}
        for start in sched.starts():
            size = sizes[start.key]
            assert len(start.agents) == size == len(set(start.agents))
            assert set(start.agents) <= free_before, "an agent was given to two tests"
            assert not set(start.agents) & busy_before
            nodes = [node_of[a] for a in start.agents]
            assert nodes == sorted(nodes), "test ranks are not in node order"
            if pack and size <= largest:
                assert len(set(nodes)) == 1, f"a {size}-rank test that fits a node spans {set(nodes)}"
            elif pack:
                assert len(set(nodes)) == fewest_nodes(slots, free_before, size)
            else:
                assert start.agents == tuple(range(size))
            free_before -= set(start.agents)
            order.append(start.key)
        # Work-conserving for the head: if it could start, it did.
        if sched.pending:
            head = sched.pending[0]
            if pack:
                assert not oracle_can_place(slots, set(sched.free), sizes[head])
            else:
                assert sched.in_flight
        in_flight = sorted(sched.in_flight)
        assert in_flight, "nothing runs, yet tests are queued: a deadlock"
        assert pack or len(in_flight) == 1
        sched.finish(in_flight[picks_left.pop() % len(in_flight)] if picks_left else in_flight[0])
    assert order == list(range(len(sizes))), "start order is not collection order"
    assert sched.free == set(node_of)


@settings(max_examples=200, deadline=None)
@given(sessions(), st.integers(0, 29))
def test_stop_at_any_point_starts_nothing_more(
    session: tuple[list[Slot], list[int], list[int], bool], stop_after: int
) -> None:
    slots, sizes, picks, pack = session
    sched: Scheduler[int] = Scheduler(slots, pack=pack)
    for key, size in enumerate(sizes):
        sched.submit(key, size)
    started: list[int] = []
    finished = 0
    while sched.in_flight or (sched.pending and not sched.stopped):
        started += [s.key for s in sched.starts()]
        if finished == stop_after and not sched.stopped:
            dropped = sched.stop()
            assert dropped == list(range(len(started), len(sizes)))
            frozen = list(started)
        in_flight = sorted(sched.in_flight)
        if not in_flight:
            break
        sched.finish(in_flight[picks[finished % len(picks)] % len(in_flight)])
        finished += 1
    if sched.stopped:
        assert started == frozen
    assert started == list(range(len(started)))


# -- time: the bench's suite, simulated -------------------------------------------------------------


def simulate(slots: list[Slot], durations: Sequence[tuple[int, float]], *, pack: bool) -> Utilisation:
    """Run a suite of (size, seconds) tests through the scheduler on a simulated clock."""
    sched: Scheduler[int] = Scheduler(slots, pack=pack)
    use = Utilisation()
    use.open(len(slots), 0.0)
    for key, (size, _) in enumerate(durations):
        sched.submit(key, size)
    now, ends = 0.0, list[tuple[float, int]]()
    while not sched.done:
        for start in sched.starts():
            use.started(start.key, len(start.agents), now)
            heapq.heappush(ends, (now + durations[start.key][1], start.key))
        now, key = heapq.heappop(ends)
        sched.finish(key)
        use.finished(key, now)
    use.close(now)
    return use


def test_the_bench_suite_packs_into_the_ideal_wall_time() -> None:
    suite = [(2, 1.0)] * 24 + [(4, 1.0)] * 4
    off = simulate(world(8), suite, pack=False)
    on = simulate(world(8), suite, pack=True)
    assert off.held_seconds == 28.0
    assert on.held_seconds == 8.0  # (24 x 2 + 4 x 4) rank-seconds over 8 ranks: no idle agent
    assert on.ratio == 1.0
    assert off.ratio == pytest.approx(64 / 224)
    assert on.max_side_by_side == 4 and off.max_side_by_side == 1


def test_shuffled_suites_never_pack_worse_than_one_at_a_time() -> None:
    rng = random.Random(14)
    for _ in range(200):
        slots = world(*[rng.randint(1, 6) for _ in range(rng.randint(1, 3))])
        suite = [(rng.randint(1, len(slots)), rng.choice([0.5, 1.0, 3.0])) for _ in range(rng.randint(1, 20))]
        on = simulate(slots, suite, pack=True)
        off = simulate(slots, suite, pack=False)
        assert on.busy_rank_seconds == pytest.approx(off.busy_rank_seconds)
        # Each test starts no later than one at a time would start it, so the suite ends no later.
        assert on.held_seconds <= off.held_seconds + 1e-9


# -- the utilisation figures ------------------------------------------------------------------------


def test_utilisation_counts_busy_rank_seconds_over_the_held_world() -> None:
    use = Utilisation()
    use.open(8, 10.0)
    use.started("a", 2, 11.0)
    use.started("b", 4, 11.0)
    use.finished("a", 13.0)  # 2 x 2
    use.started("c", 8, 14.0)  # not really side by side with b, but counted as started
    use.finished("b", 14.0)  # 4 x 3
    use.finished("c", 15.0)  # 8 x 1
    use.close(20.0)
    assert use.busy_rank_seconds == 24.0
    assert use.held_rank_seconds == 80.0
    assert use.ratio == 0.3
    assert use.max_side_by_side == 2
    assert use.line() == (
        "sprite: the world of 8 ranks was 30% busy (24.0 busy rank-seconds of 8 x 10.0s held); "
        "3 ranks tests, at most 2 side by side"
    )
    assert use.line(pack=False) is not None and use.line(pack=False).endswith(  # type: ignore[union-attr]
        "at most 2 side by side (--pack=off)"
    )


def test_a_replaced_world_adds_its_held_time() -> None:
    use = Utilisation()
    use.open(4, 0.0)
    use.started("a", 4, 0.0)
    use.close(2.0)  # lost with "a" in flight: counted to the close
    use.open(4, 3.0)
    use.started("b", 2, 3.0)
    use.finished("b", 5.0)
    use.close(5.0)
    assert use.held_rank_seconds == 4 * 2 + 4 * 2
    assert use.busy_rank_seconds == 4 * 2 + 2 * 2
    assert use.line() == (
        "sprite: the world of 4 ranks was 75% busy (12.0 busy rank-seconds of 4 x 4.0s held); "
        "2 ranks tests, at most 1 side by side"
    )


def test_no_line_without_a_ranks_test() -> None:
    use = Utilisation()
    assert use.line() is None
    use.open(4, 0.0)
    use.close(1.0)
    assert use.line() is None


def test_utilisation_misuse_is_a_clear_error() -> None:
    use = Utilisation()
    with pytest.raises(ValueError, match=r"^test 'a' started while no world is open$"):
        use.started("a", 1, 0.0)
    use.open(2, 0.0)
    with pytest.raises(ValueError, match=r"^the world is already open; close it first$"):
        use.open(2, 0.0)
    use.started("a", 1, 0.0)
    with pytest.raises(ValueError, match=r"^test 'a' started twice$"):
        use.started("a", 1, 0.0)


# -- agents that join as they connect ---------------------------------------------------------------


def test_tests_start_on_the_agents_that_have_joined_before_the_world_is_complete() -> None:
    sched: Scheduler[str] = Scheduler([], world_size=8)
    sched.submit("a", 2)
    sched.submit("b", 2)
    assert sched.starts() == [] and not sched.complete
    sched.join(Slot(rank=5, node=0))
    sched.join(Slot(rank=2, node=0))
    assert sched.starts() == [Start("a", (2, 5))]  # the first two agents to connect, whichever they are
    sched.join(Slot(rank=0, node=0))
    assert sched.starts() == []  # "b" waits for a second free agent
    sched.join(Slot(rank=7, node=0))
    assert sched.starts() == [Start("b", (0, 7))]


def test_a_straggler_delays_only_the_tests_that_need_it() -> None:
    sched: Scheduler[str] = Scheduler([], world_size=4)
    for rank in (0, 1, 2):
        sched.join(Slot(rank=rank, node=0))
    sched.submit("whole", 4)
    assert sched.starts() == []  # a whole-world test waits for every agent
    sched.join(Slot(rank=3, node=0))
    assert sched.complete and sched.starts() == [Start("whole", (0, 1, 2, 3))]


def test_before_the_world_is_complete_a_test_larger_than_every_node_seen_waits() -> None:
    # Two nodes of 4; node 0 complete, node 1 has one agent so far: a 4-rank test takes node 0 (it shows
    # that 4 fits a node), a 5-rank test would span nodes and waits for the world to be known.
    sched: Scheduler[str] = Scheduler([], world_size=8)
    for rank in (0, 1, 2, 3, 4):
        sched.join(Slot(rank=rank, node=0 if rank < 4 else 1))
    sched.submit("four", 4)
    assert sched.starts() == [Start("four", (0, 1, 2, 3))]
    sched.submit("five", 5)
    sched.finish("four")
    assert sched.starts() == []
    for rank in (5, 6, 7):
        sched.join(Slot(rank=rank, node=1))
    assert sched.starts() == [Start("five", (0, 1, 2, 3, 4))]


def test_one_at_a_time_waits_for_agents_zero_to_n_minus_one() -> None:
    sched: Scheduler[str] = Scheduler([], pack=False, world_size=4)
    sched.join(Slot(rank=1, node=0))
    sched.join(Slot(rank=2, node=0))
    sched.submit("a", 2)
    assert sched.starts() == []  # agents 1 and 2 are free, but --pack=off runs on agents 0 and 1
    sched.join(Slot(rank=0, node=0))
    assert sched.starts() == [Start("a", (0, 1))]


def test_joining_twice_or_beyond_the_world_is_refused() -> None:
    sched: Scheduler[str] = Scheduler([Slot(rank=0, node=0)], world_size=2)
    with pytest.raises(ValueError, match="given twice"):
        sched.join(Slot(rank=0, node=0))
    sched.join(Slot(rank=1, node=0))
    with pytest.raises(ValueError, match="complete"):
        sched.join(Slot(rank=2, node=0))
