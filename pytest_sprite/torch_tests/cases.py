"""The torch test an item runs as: its record (:class:`TorchTest`), the stash key that marks the item, and
its unittest id. Every other module of this package reads these; this one imports none of them."""

from __future__ import annotations

import unittest
from dataclasses import dataclass
from typing import Final, Literal

import pytest

__all__ = ["TorchTest", "case_id", "torch_test_key"]


@dataclass(frozen=True, kw_only=True)
class TorchTest:
    """One test method of a torch multiprocess test class, run on ranks."""

    cls: type[unittest.TestCase]
    name: str
    """The method's name (``self._testMethodName``)."""
    world_size: int
    timeout: float | None
    """Seconds, from the class (``timeout``) or torch's own table (``get_timeout``); None: the session's."""
    timeout_source: str = ""
    """Where ``timeout`` came from, in the words a timeout failure says it."""
    kind: Literal["multiprocess", "continuous"] = "multiprocess"
    """``multiprocess``: a ``MultiProcessTestCase`` test, its own world; ``continuous``: one of a
    ``MultiProcContinuousTest`` class's tests, which share one world (``classworld``)."""


torch_test_key: Final = pytest.StashKey[TorchTest]()
"""Set on an item that runs as a torch test on ranks."""


def case_id(cls: type, name: str) -> str:
    """``TestCase.id()`` of ``cls(name)``: the key of torch's per-test timeouts and of its skip messages."""
    return f"{cls.__module__}.{cls.__qualname__}.{name}"
