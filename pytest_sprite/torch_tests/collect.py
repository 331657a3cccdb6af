"""Which collected items are torch's multiprocess tests, and on how many ranks each runs.

Two kinds: a ``MultiProcessTestCase`` test spawns its world for itself (each becomes a ranks test); a
``MultiProcContinuousTest`` class (``DTensorContinuousTestBase``) keeps one world for all its tests
(``classworld``: the class's tests run in the same ranks, one after another).
"""

from __future__ import annotations

import unittest
import warnings
from datetime import timedelta
from typing import Any

import pytest

from ..glue.around import around_ranks_key
from ..glue.markers import timeout_source_key
from ..plumbing.dependency_internals import (
    torch_continuous_base,
    torch_continuous_in_process,
    torch_continuous_world_size,
    torch_multiprocess_in_process,
    torch_multiprocess_module,
    torch_required_world_size,
)
from .cases import TorchTest, case_id, torch_test_key

__all__ = [
    "TorchTest",
    "TorchTestsCollector",
    "case_id",
    "class_timeout",
    "class_world_size",
    "continuous_test",
    "torch_test_key",
]


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


def torch_timeout(cls: type, name: str) -> tuple[float | None, str]:
    """What torch's runner gives the test (``get_timeout``: ``TIMEOUT_OVERRIDE``, else ``TIMEOUT_DEFAULT``), and
    that source in words; (None, "") without torch's table."""
    get_timeout = getattr(torch_multiprocess_module(), "get_timeout", None)
    if not callable(get_timeout):
        return None, ""
    seconds = float(get_timeout(case_id(cls, name)))
    return seconds, f"torch's get_timeout for {cls.__qualname__}.{name}"


def class_timeout(cls: type, name: str) -> tuple[float | None, str]:
    """The class's ``timeout`` (a timedelta or seconds), else what torch's runner gives the test; and its source."""
    value = getattr(cls, "timeout", None)
    source = f"{cls.__qualname__}.timeout, the torch test class's timeout attribute"
    if isinstance(value, timedelta):
        return value.total_seconds(), source
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value), source
    return torch_timeout(cls, name)


def _unittest_method(item: pytest.Item, base: type | None) -> tuple[type, str] | None:
    """The item's class and method when it is a test of a ``base`` subclass torch's runner would run (not
    ``unittest.skip``-ped, no ``ranks`` marker of the user's); else None."""
    cls = getattr(item, "cls", None)
    if base is None or not isinstance(cls, type) or not issubclass(cls, base):
        return None
    if not issubclass(cls, unittest.TestCase):
        return None
    name = getattr(item, "originalname", item.name)
    if _skipped(cls) or _skipped(getattr(cls, name, None)) or item.get_closest_marker("ranks") is not None:
        return None
    return cls, name


def torch_test(item: pytest.Item) -> TorchTest | None:
    """The item as a ``MultiProcessTestCase`` test on ranks; None for any other item, for one torch's runner
    would skip before spawning (``unittest.skip`` on the method or class), for one that already has a
    ``ranks`` marker, and for a class that runs its tests in torch's own process (``LocalDTensorTestBase``)."""
    base = _multiprocess_base()
    found = _unittest_method(item, base)
    if found is None or base is None or torch_multiprocess_in_process(found[0], base):
        return None
    cls, name = found
    timeout, source = class_timeout(cls, name)
    return TorchTest(
        cls=cls, name=name, world_size=class_world_size(cls, name), timeout=timeout, timeout_source=source
    )


def continuous_test(item: pytest.Item) -> TorchTest | None:
    """The item as one of a ``MultiProcContinuousTest`` class's tests; None as :func:`torch_test` says, and for
    a class that runs its tests in torch's own process (``LocalDTensorContinuousTestBase``). Raises
    ``unittest.SkipTest`` where torch skips the whole class (no device, a backend not available)."""
    base = torch_continuous_base()
    found = _unittest_method(item, base)
    if found is None or base is None or torch_continuous_in_process(found[0], base):
        return None
    cls, name = found
    size = torch_continuous_world_size(cls)
    if size < 1:
        raise ValueError(f"{cls.__qualname__}.world_size resolves to {size}; a world needs at least one rank")
    timeout, source = torch_timeout(cls, name)
    return TorchTest(
        cls=cls, name=name, world_size=size, timeout=timeout, timeout_source=source, kind="continuous"
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

    @pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
    def pytest_collection_modifyitems_classworld(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        """After ``-k`` / ``-m`` deselected, before the controller plans: one world per class (``classworld``).

        Among ``trylast`` implementations the one registered first is called first: this plugin is
        registered before the controller (``plugin.py``), whose plan must see the marks made here. (pytest
        takes only methods named ``pytest_*`` for hooks; ``specname`` names the hook.)
        """
        from .classworld import group_classes

        group_classes(items, controller=self.controller, config=config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """A class world's other tests are logged with its first (``classworld.follower_protocol``)."""
        if not self.controller or torch_test_key not in item.stash:
            return None
        from .classworld import follower_protocol

        return follower_protocol(item, nextitem)

    def adopt(self, item: pytest.Item) -> None:
        try:
            test = torch_test(item) or continuous_test(item)
        except unittest.SkipTest as exc:  # torch skips the whole class (no device, no backend)
            item.add_marker(pytest.mark.skip(reason=str(exc)))
            return
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
        item.stash[torch_test_key] = test
        if test.kind == "continuous":
            return  # its class's first selected test is marked once -k has deselected (classworld)
        item.add_marker(pytest.mark.ranks(test.world_size, timeout=test.timeout, init=False))
        item.stash[timeout_source_key] = test.timeout_source
        if self.controller:
            from .parent import ParentSide

            item.stash[around_ranks_key] = ParentSide(test)
