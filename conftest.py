"""Repository-level test configuration: pytester, and the long matrices kept out of the default run.

CI runs ``pytest -m cpu`` on 2 cores within 10 minutes. The exhaustive multi-rank matrices (criterion v2 at 2-4
ranks with every fault, resume over every strategy, precision and size, the full crash matrices) carry the ``slow``
marker and run only with ``--run-slow`` (or ``SPRITE_RUN_SLOW=1``); each has a fast unmarked sibling that covers the
same path, so the default run stays representative.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SLOW_MARKERS = ("slow",)

REPORTED_VERSIONS = (
    "torch",
    "lightning",
    "transformers",
    "peft",
    "hypothesis",
    "pytest",
    "pytest-xdist",
    "mpi4py",
)
"""Printed at the top of every run, so a CI log says what a fresh install got today (issue 20)."""


def pytest_report_header(config: pytest.Config) -> str:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return "versions: " + ", ".join(f"{name} {installed(name)}" for name in REPORTED_VERSIONS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=os.environ.get("SPRITE_RUN_SLOW", "") not in ("", "0"),
        help="also run the tests marked slow (the full matrices; env SPRITE_RUN_SLOW=1)",
    )


HARDWARE_MARKERS = ("cpu", "cuda", "xpu")
"""Every test of this repository says what it runs on: CI selects ``-m cpu``, so a test with none never runs."""

TESTS = Path(__file__).parent / "tests"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if item.path.is_relative_to(TESTS) and not any(item.get_closest_marker(m) for m in HARDWARE_MARKERS)
    ]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) say nothing of the hardware they need, so CI (`pytest -m cpu`) never runs "
            f"them: {', '.join(unmarked[:5])}{' ...' if len(unmarked) > 5 else ''}. Mark their module "
            "`pytestmark = pytest.mark.cpu` (or cuda / xpu for an accelerator)."
        )
    if config.getoption("--run-slow"):
        return
    keep, slow = [], []
    for item in items:
        (slow if any(item.get_closest_marker(m) for m in SLOW_MARKERS) else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


@pytest.fixture(autouse=True)
def _pytester_sessions_without_hypothesis(request: pytest.FixtureRequest) -> None:
    """Start pytester's sessions without hypothesis' pytest plugin, unless the test is about hypothesis.

    That plugin imports all of hypothesis in every session's terminal summary (about 1.3 s here, 2.4 s
    for a session with ranks tests), which over this suite's ~150 pytester sessions is minutes of CI.
    Pytester clears ``PYTEST_ADDOPTS`` when it starts, so this sets it after pytester is set up.
    """
    if "pytester" not in request.fixturenames or request.node.get_closest_marker("hypothesis_plugin"):
        return
    request.getfixturevalue("pytester")
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the warm interpreter the project's own pytest sessions fork from, when a collected test runs one.

    Also import torch (and numpy with it) here when a test runs pytester: an in-process session
    (``pytester.runpytest``) drops from ``sys.modules`` what was first imported inside it, and a C extension
    such as numpy's cannot be loaded twice in one process, so a later test importing it would fail. A whole
    run has imported torch while collecting; a run of a few files that do not import it at the top may not.
    """
    if any("pytester" in getattr(item, "fixturenames", ()) for item in session.items):
        from sprite_testing import start_warm_python

        with contextlib.suppress(ImportError):
            import torch  # noqa: F401

        start_warm_python()
