"""The ``ranks`` marker: parsing, validation and the per-item settings it implies.

Pure functions over marker arguments, unit-tested without pytest sessions; each test's marker is
parsed once at collection and its spec kept in the item's stash (``ranks_spec_key``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import pytest

from ..errors import SpriteUsageError

__all__ = [
    "PARAM_NAME",
    "WORLD",
    "RanksSpec",
    "Size",
    "item_ranks_spec",
    "parse_positive_int",
    "parse_ranks_marker",
    "parse_timeout",
    "ranks_spec_key",
    "remember_ranks_spec",
    "size_id",
    "timeout_source_key",
    "world_sizes",
]

PARAM_NAME: Final = "_sprite_world_size"
"""Hidden parameter that ``ranks([1, 2, 4])`` parametrizes over."""

WORLD: Final = "world"
"""``ranks("world")``: the whole world the session has (``--ranks``), whatever its size."""

Size = int | Literal["world"]

_EXAMPLES: Final = (
    'use e.g. @pytest.mark.ranks(4), @pytest.mark.ranks([1, 2, 4]), @pytest.mark.ranks("world"), '
    '@pytest.mark.ranks([2, "world"]) or @pytest.mark.ranks(2, timeout=60)'
)


@dataclass(frozen=True, kw_only=True)
class RanksSpec:
    """What a ``ranks`` marker asks for."""

    sizes: tuple[Size, ...]
    """World sizes the test runs at, ``"world"`` for the session's whole world; one unless parametrized."""
    parametrized: bool
    """True for the list form and for ``"world"``, which make one test per world size, named for it."""
    timeout: float | None
    """The marker's ``timeout=`` in seconds, None when not given."""
    init: bool = True
    """``init=False``: each rank starts without a default process group, torchrun's variables set and
    ``MASTER_PORT`` free, for a test that makes its own groups."""


ranks_spec_key: Final = pytest.StashKey[RanksSpec]()
"""An item's parsed ``ranks`` marker (absent: an ordinary test), set by :func:`item_ranks_spec`."""
timeout_source_key: Final = pytest.StashKey[str]()
"""Who gave the item's ``ranks`` marker its ``timeout=``, in the words a timeout failure names it: a plugin
that adds the marker sets it (``--torch-tests=ranks``: the torch test class's ``timeout``, or torch's
``get_timeout``); absent: the user's own ``@pytest.mark.ranks(timeout=...)``."""
_by_definition_key: Final = pytest.StashKey[dict[str, RanksSpec]]()
"""Specs parsed while generating tests, by the function definition's node id."""


def remember_ranks_spec(metafunc: pytest.Metafunc) -> RanksSpec | None:
    """Parse the marker of the function being generated, once; its items find the spec by :func:`item_ranks_spec`."""
    definition = metafunc.definition
    own = [m for m in definition.own_markers if m.name == "ranks"]
    if len(own) > 1:  # stacked decorators: pytest would silently take the one nearest the function
        raise SpriteUsageError(
            f"{definition.nodeid} has {len(own)} @pytest.mark.ranks markers: "
            f"{' and '.join(_shown(m) for m in own)}; keep one (a function's marker overrides its class's "
            "or module's, but two on one function are ambiguous)"
        )
    mark = definition.get_closest_marker("ranks")
    if mark is None:
        return None
    spec = parse_ranks_marker(mark.args, dict(mark.kwargs), definition.nodeid)
    metafunc.config.stash.setdefault(_by_definition_key, {})[definition.nodeid] = spec
    return spec


def item_ranks_spec(item: pytest.Item) -> RanksSpec | None:
    """The item's ranks spec: the one parsed when its function was generated, kept in ``item.stash``.

    A marker that reached the item only later (another plugin's ``add_marker``) is parsed here, once.
    """
    if ranks_spec_key in item.stash:
        return item.stash[ranks_spec_key]
    parent = item.parent.nodeid if item.parent is not None else ""
    name = getattr(item, "originalname", item.name)
    spec = item.config.stash.get(_by_definition_key, {}).get(f"{parent}::{name}" if parent else name)
    if spec is None:
        mark = item.get_closest_marker("ranks")
        if mark is None:
            return None
        spec = parse_ranks_marker(mark.args, dict(mark.kwargs), item.nodeid)
    item.stash[ranks_spec_key] = spec
    return spec


def _shown(mark: pytest.Mark) -> str:
    """A marker as its decorator reads: ``ranks(2, timeout=5)``."""
    words = [repr(a) for a in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
    return f"ranks({', '.join(words)})"


def _describe(value: object) -> str:
    return f"{value!r} (a {type(value).__name__})"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_ranks_marker(args: Sequence[Any], kwargs: dict[str, Any], where: str) -> RanksSpec:
    """Validate ``@pytest.mark.ranks(...)`` arguments; ``where`` names the test for the error."""
    prefix = f"@pytest.mark.ranks(...) on {where}"
    unknown = sorted(set(kwargs) - {"timeout", "init"})
    if unknown:
        raise SpriteUsageError(
            f"{prefix}: unknown keyword {', '.join(unknown)}; the keywords are timeout=SECONDS and init=False"
        )
    init = kwargs.get("init", True)
    if not isinstance(init, bool):
        raise SpriteUsageError(f"{prefix}: init= must be True or False, got {_describe(init)}")
    if len(args) != 1:
        raise SpriteUsageError(
            f"{prefix}: takes exactly one world size or list of sizes, got {len(args)} arguments; {_EXAMPLES}"
        )
    (arg,) = args
    if isinstance(arg, (list, tuple)):
        if not arg:
            raise SpriteUsageError(f"{prefix}: the list of world sizes is empty; {_EXAMPLES}")
        bad = [v for v in arg if not (_is_count(v) or v == WORLD)]
        if bad:
            raise SpriteUsageError(
                f'{prefix}: every world size must be a positive int or "world", got {_describe(bad[0])} in '
                f"{list(arg)!r}; {_EXAMPLES}"
            )
        if len(set(arg)) != len(arg):
            raise SpriteUsageError(f"{prefix}: world sizes {list(arg)!r} repeat a size; list each once")
        sizes, parametrized = tuple(arg), True
    elif _is_count(arg):
        sizes, parametrized = (arg,), False
    elif arg == WORLD:
        sizes, parametrized = (WORLD,), True
    else:
        raise SpriteUsageError(
            f'{prefix}: the world size must be a positive int, "world" or a non-empty list of them, got '
            f"{_describe(arg)}; {_EXAMPLES}"
        )
    timeout = kwargs.get("timeout")
    if timeout is not None:
        timeout = parse_timeout(timeout, f"{prefix}: timeout=")
    return RanksSpec(sizes=sizes, parametrized=parametrized, timeout=timeout, init=init)


def world_sizes(spec: RanksSpec, world: int | None) -> tuple[Size, ...]:
    """The sizes a test is generated at, once the session's world is known (``None``: not yet).

    ``"world"`` becomes the world's size; beside it, the listed sizes at or above the world are left
    out (the world entry covers them), so ``ranks([2, 3, "world"])`` is 2, 3 and 4 at ``--ranks=4`` and
    2 at ``--ranks=2``, never a skip for being beyond the world. A list without ``"world"`` is kept
    as written. While the world is unknown, ``"world"`` stays and the controller sizes it.
    """
    if WORLD not in spec.sizes or world is None:
        return spec.sizes
    out: list[Size] = []
    for size in spec.sizes:
        n = world if size == WORLD else size
        if (size == WORLD or n < world) and n not in out:
            out.append(n)
    return tuple(out)


def size_id(size: Size) -> str:
    """The id a generated test carries for its world size: ``ranks4``, or ``ranks-world`` while unsized."""
    return f"ranks{size}" if size != WORLD else "ranks-world"


def parse_positive_int(value: object, where: str) -> int:
    """An int >= 1 from an option, ini or environment value."""
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
        valid = False
    else:
        valid = number >= 1 and str(value).strip().lstrip("+").isdigit()
    if not valid:
        raise SpriteUsageError(f"{where} must be a positive integer (1, 2, 24, ...), got {value!r}")
    return number


def parse_timeout(value: object, where: str) -> float:
    """Seconds > 0 from a marker, option, ini or environment value."""
    if isinstance(value, bool):
        raise SpriteUsageError(f"{where} must be a number of seconds > 0, got {value!r}")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SpriteUsageError(f"{where} must be a number of seconds > 0, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise SpriteUsageError(f"{where} must be a number of seconds > 0, got {value!r}")
    return seconds
