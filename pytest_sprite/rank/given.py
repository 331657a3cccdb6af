"""Hypothesis ``@given`` in a ranks test: every rank draws the same examples and agrees on each outcome.

Each rank of a ranks test is its own process with its own hypothesis engine. For a collective inside
the test not to deadlock, every rank must run the same examples in the same order, and every engine
must take the same path (replay, generate, shrink). So, in each test child before the test runs:

- the hypothesis seed is the one the controller decided for the session (``--hypothesis-seed`` when given, else
  drawn once), mixed with the test's id, so every rank's engine starts from the same random state
  under every launcher;
- every rank reads the same example database, and only rank 0 writes it (the others get a read-only
  view of it);
- settings that depend on each process's own clock are off: the per-example ``deadline`` and the
  ``too_slow`` health check (a collective's wait would differ between ranks);
- the function-scoped-fixture health check is suppressed when the only function-scoped fixtures the
  test takes are the harness's own (``world`` is the same object for every example);
- each example's outcome is agreed over the test's process group: when one rank fails an example,
  the others raise :class:`PeerFailedExample` for it, so every engine sees the same failure and
  shrinks the same way. The failing example is reported once, by the rank that failed it; the other
  ranks' echoes become a note in their passed report.

Imports hypothesis only when the test module already did.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from random import Random
from typing import TYPE_CHECKING, Any, Final

from ..plumbing.ranges import fold_ranks

if TYPE_CHECKING:
    import pytest

__all__ = [
    "HARNESS_FIXTURES",
    "PeerFailedExample",
    "echo_note",
    "is_peer_echo",
    "prepare_given",
    "prepare_hypothesis_item",
]

HARNESS_FIXTURES: Final = frozenset({"world"})
"""Function-scoped fixtures that hold the same object for every example of a ranks test."""

Agree = Callable[[object], Sequence[object]]
"""All-gather of one picklable outcome per rank, in rank order."""

_OK: Final = None
_ASSUMED: Final = "assume"


class PeerFailedExample(AssertionError):
    """Raised on a rank whose example passed while another rank of the test failed it."""


def is_peer_echo(exc: BaseException | None) -> bool:
    """True when ``exc`` only says that other ranks failed (a group of such echoes included)."""
    if isinstance(exc, PeerFailedExample):
        return True
    members = _group_members(exc)
    return members is not None and all(is_peer_echo(e) for e in members)


def _group_members(exc: BaseException | None) -> tuple[BaseException, ...] | None:
    """The exceptions of an exception group (builtin, or the backport on Python 3.10), else None."""
    members = getattr(exc, "exceptions", None)
    return members if isinstance(members, tuple) and members else None


def _outcome(error: BaseException | None) -> object:
    from hypothesis.errors import UnsatisfiedAssumption

    if error is None:
        return _OK
    if isinstance(error, UnsatisfiedAssumption):
        return _ASSUMED
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _agreeing(inner: Callable[..., Any], rank: int, agree: Agree) -> Callable[..., Any]:
    """``inner`` wrapped so that every rank ends each example the same way."""
    from hypothesis.errors import UnsatisfiedAssumption

    @functools.wraps(inner)
    def run_example(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        error: Exception | None = None
        result = None
        try:
            result = inner(*args, **kwargs)
        except Exception as exc:  # BaseExceptions (hypothesis' StopTest, skip, Ctrl-C) end every rank alike
            error = exc
        outcomes = list(agree(_outcome(error)))
        if error is not None and outcomes[rank] != _ASSUMED:
            raise error
        failed = [r for r, o in enumerate(outcomes) if o not in (_OK, _ASSUMED)]
        if failed:
            raise PeerFailedExample(f"{fold_ranks(failed)} failed this example: {outcomes[failed[0]]}")
        assumed = [r for r, o in enumerate(outcomes) if o == _ASSUMED]
        if assumed:  # an example one rank rejects with assume() is discarded by every rank
            if error is not None:
                raise error
            raise UnsatisfiedAssumption(f"{fold_ranks(assumed)} rejected this example with assume()")
        return result

    return run_example


def prepare_given(
    test: Any,
    *,
    nodeid: str,
    rank: int,
    world_size: int,
    seed: int | str | None,
    only_harness_fixtures: bool | Callable[[], bool],
    agree: Agree,
    seed_pinned: bool = False,
) -> bool:
    """Make the ``@given`` test ``test`` safe to run on ``world_size`` ranks; False if it is not one.

    Changes the test object in place: this is a fresh test child, nothing else runs it. ``seed_pinned``:
    the user gave ``--hypothesis-seed``, which already starts every rank's engine alike.
    ``only_harness_fixtures`` may be a callable: it is then asked only for a hypothesis test, so a test
    that does not use hypothesis is never inspected.
    """
    if "hypothesis" not in sys.modules:
        return False
    from hypothesis import HealthCheck, is_hypothesis_test, settings
    from hypothesis.database import ReadOnlyDatabase

    from ..plumbing.dependency_internals import (
        hypothesis_explicit_seed,
        hypothesis_test_settings,
        replace_hypothesis_settings,
    )

    if not is_hypothesis_test(test):
        return False
    fn = getattr(test, "__func__", test)
    current: Any = hypothesis_test_settings(fn)
    suppress = set(current.suppress_health_check)
    if only_harness_fixtures() if callable(only_harness_fixtures) else only_harness_fixtures:
        suppress.add(HealthCheck.function_scoped_fixture)
    changes: dict[str, Any] = {"suppress_health_check": suppress, "database": current.database}
    if world_size > 1:
        suppress.add(HealthCheck.too_slow)
        changes["deadline"] = None
        if rank != 0 and current.database is not None:
            changes["database"] = ReadOnlyDatabase(current.database)
        fn.hypothesis.inner_test = _agreeing(fn.hypothesis.inner_test, rank, agree)
    if seed is not None and not seed_pinned and hypothesis_explicit_seed(fn) is None:
        _seed_engine(fn, seed, nodeid)
    replace_hypothesis_settings(fn, settings(current, **changes))
    return True


def _seed_engine(fn: Any, seed: int | str, nodeid: str) -> None:
    """Start every rank's engine from the same random state, keeping the example database in use.

    With hypothesis' public ``@seed`` (per session and test id), every rank generates the same examples
    under every launcher. ``@seed`` also turns the database off; :func:`prepare_given` sets the test's
    database back afterwards, so a failing example is still saved (by rank 0) and replayed first.
    """
    from hypothesis import seed as pin_seed

    pin_seed(Random(f"{seed}/{nodeid}").getrandbits(128))(fn)


def prepare_hypothesis_item(
    item: pytest.Item, *, rank: int, world_size: int, seed: int | str | None, agree: Agree
) -> bool:
    """:func:`prepare_given` for a collected item in a test child."""
    from ..glue.pytest_internals import function_scoped_arguments

    test = getattr(item, "obj", None)
    if test is None:
        return False
    return prepare_given(
        test,
        nodeid=item.nodeid,
        rank=rank,
        world_size=world_size,
        seed=seed,
        only_harness_fixtures=lambda: function_scoped_arguments(item) <= HARNESS_FIXTURES,
        agree=agree,
        seed_pinned=item.config.getoption("hypothesis_seed", None) is not None,
    )


def echo_note(exc: BaseException | None) -> str | None:
    """The note for a rank whose only failure is other ranks' failed example; None otherwise."""
    if exc is None or not is_peer_echo(exc):
        return None
    first = exc
    while (members := _group_members(first)) is not None:
        first = members[0]
    return (
        f"{first} This rank ran the same examples and passed them; it raised only to keep every rank's "
        "hypothesis engine in step, and the failure is reported by the rank that had it."
    )
