"""Repository-level test configuration: pytester, and the long matrices kept out of the default run.

CI runs ``pytest -m cpu`` on 2 cores within 10 minutes. The exhaustive multi-rank matrices (criterion v2 at 2-4
ranks with every fault, resume over every strategy, precision and size, the full crash matrices) carry the ``slow``
marker and run only with ``--run-slow`` (or ``SPRITE_RUN_SLOW=1``); each has a fast unmarked sibling that covers the
same path, so the default run stays representative.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]

SLOW_MARKERS = ("slow",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=os.environ.get("SPRITE_RUN_SLOW", "") not in ("", "0"),
        help="also run the tests marked slow (the full matrices; env SPRITE_RUN_SLOW=1)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    keep, slow = [], []
    for item in items:
        (slow if any(item.get_closest_marker(m) for m in SLOW_MARKERS) else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep
