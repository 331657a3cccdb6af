"""Which collected items are torch ``MultiProcessTestCase`` tests, and on how many ranks each runs."""

from __future__ import annotations

import unittest
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import pytest

from ..glue.around import around_ranks_key
from ..plumbing.dependency_internals import torch_multiprocess_module, torch_required_world_size

__all__ = ["TorchTest", "TorchTestsCollector", "class_timeout", "class_world_size", "torch_test_key"]


@dataclass(frozen=True, kw_only=True)
class TorchTest:
    """One test method of a ``MultiProcessTestCase`` subclass, run on ranks."""

    cls: type[unittest.TestCase]
    name: str
    """The method's name (``self._testMethodName``)."""
    world_size: int
    timeout: float | None
    """Seconds, from the class (``timeout``) or torch's own table (``get_timeout``); None: the session's."""


torch_test_key: Final = pytest.StashKey[TorchTest]()
"""Set on an item that runs as a torch test on ranks."""


def _multiprocess_base() -> type | None:
    common = torch_multiprocess_module()
    base = getattr(common, "MultiProcessTestCase", None)
    return base if isinstance(base, type) else None


def _skipped(obj: Any) -> bool:
    return bool(getattr(obj, "__unittest_skip__", False))


def class_world_size(cls: Any, name: str) -> int:
    """``@requires_world_size(n)`` on the method, else the class's ``world_size`` (a property may read the
    environment or the device count), read on an instance made without ``__init__``, else on a real one."""
    required = torch_required_world_size(getattr(cls, name, None))
    if required is not None:
        return required
    try:
        value = cls.__new__(cls).world_size
    except Exception:
        value = cls(name).world_size
    size = int(value)
    if size < 1:
        raise ValueError(f"{cls.__qualname__}.world_size is {value!r}; a world needs at least one rank")
    return size


def class_timeout(cls: type, name: str) -> float | None:
    """The class's ``timeout`` (a timedelta or seconds), else what torch's runner gives the test (``get_timeout``)."""
    value = getattr(cls, "timeout", None)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    get_timeout = getattr(torch_multiprocess_module(), "get_timeout", None)
    if callable(get_timeout):
        return float(get_timeout(f"{cls.__module__}.{cls.__qualname__}.{name}"))
    return None


def torch_test(item: pytest.Item) -> TorchTest | None:
    """The item as a torch test on ranks; None for any other item, and for one torch's runner would skip
    before spawning (``unittest.skip`` on the method or class) or that already has a ``ranks`` marker."""
    base = _multiprocess_base()
    cls = getattr(item, "cls", None)
    if base is None or not isinstance(cls, type) or not issubclass(cls, base):
        return None
    if not issubclass(cls, unittest.TestCase):
        return None
    name = getattr(item, "originalname", item.name)
    if _skipped(cls) or _skipped(getattr(cls, name, None)) or item.get_closest_marker("ranks") is not None:
        return None
    return TorchTest(
        cls=cls, name=name, world_size=class_world_size(cls, name), timeout=class_timeout(cls, name)
    )


class TorchTestsCollector:
    """Collection plugin of ``--torch-tests=ranks``, in the controller and in every agent."""

    def __init__(self, *, controller: bool) -> None:
        self.controller = controller

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Before the controller plans the world (``trylast``): mark every torch test ``ranks(n, init=False)``."""
        for item in items:
            self.adopt(item)

    def adopt(self, item: pytest.Item) -> None:
        try:
            test = torch_test(item)
        except Exception as exc:  # a world_size that cannot be read: torch's own runner keeps the test
            warnings.warn(
                pytest.PytestWarning(
                    f"--torch-tests=ranks: {item.nodeid} runs natively: its world size could not be read "
                    f"({type(exc).__name__}: {exc})"
                ),
                stacklevel=1,
            )
            return
        if test is None:
            return
        item.add_marker(pytest.mark.ranks(test.world_size, timeout=test.timeout, init=False))
        item.stash[torch_test_key] = test
        if self.controller:
            from .parent import ParentSide

            item.stash[around_ranks_key] = ParentSide(test)
