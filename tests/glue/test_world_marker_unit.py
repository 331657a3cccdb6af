"""ranks("world") parsing and the sizes it generates, without sessions (issue 9)."""

from __future__ import annotations

import pytest

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.markers import WORLD, parse_ranks_marker, size_id, world_sizes

pytestmark = pytest.mark.cpu


def sizes(arg: object, world: int | None) -> tuple[object, ...]:
    return world_sizes(parse_ranks_marker([arg], {}, "t.py::test"), world)


def test_world_alone_is_the_sessions_world_named_for_its_size() -> None:
    spec = parse_ranks_marker(["world"], {}, "t.py::test")
    assert (spec.sizes, spec.parametrized) == ((WORLD,), True)
    assert sizes("world", 4) == (4,)
    assert sizes("world", None) == (WORLD,)
    assert [size_id(n) for n in (4, WORLD)] == ["ranks4", "ranks-world"]


@pytest.mark.parametrize(
    ("world", "expected"),
    [(1, (1,)), (2, (2,)), (3, (2, 3)), (4, (2, 3, 4)), (12, (2, 3, 4, 12)), (96, (2, 3, 4, 12, 96))],
)
def test_sizes_beside_world_stop_below_it(world: int, expected: tuple[int, ...]) -> None:
    assert sizes([2, 3, 4, 12, WORLD], world) == expected


def test_a_list_without_world_is_kept_as_written() -> None:
    assert sizes([2, 8], 4) == (2, 8)


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (
            "all",
            '@pytest.mark.ranks(...) on t.py::test: the world size must be a positive int, "world" or a non-empty '
            "list of them, got 'all' (a str); use e.g. @pytest.mark.ranks(4), @pytest.mark.ranks([1, 2, 4]), "
            '@pytest.mark.ranks("world"), @pytest.mark.ranks([2, "world"]) or @pytest.mark.ranks(2, timeout=60)',
        ),
        (
            [2, "World"],
            '@pytest.mark.ranks(...) on t.py::test: every world size must be a positive int or "world", got '
            "'World' (a str) in [2, 'World']; use e.g.",
        ),
        (
            [WORLD, WORLD],
            "@pytest.mark.ranks(...) on t.py::test: world sizes ['world', 'world'] repeat a size",
        ),
    ],
)
def test_bad_world_markers_say_what_is_allowed(arg: object, message: str) -> None:
    with pytest.raises(SpriteUsageError) as exc:
        parse_ranks_marker([arg], {}, "t.py::test")
    assert str(exc.value).startswith(message)
