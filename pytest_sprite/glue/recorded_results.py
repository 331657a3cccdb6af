"""The one place assertions record their results, and the progress lines of long assertions.

``record_assertion(result)`` is called by every assertion (parity, criterion v2, resume, crash
consistency) with its frozen result. The result's ``to_dict()`` (which names its ``kind``) is kept
with the running test's item, and when the phase ends it is put on that phase's report as the
attribute ``sprite_assertions``. Reports cross processes only through pytest's own serialization,
which keeps such attributes, so the same path serves every place a test runs:

- an ordinary test in the controller: the report is made here;
- a ranks test: each rank's child makes its reports and sends them to the controller, whose merge
  keeps the list of the lowest rank that recorded any (every rank reaches the same verdict);
- a pytest-xdist worker: the worker's reports reach xdist's controller with the attribute.

Outside a test (offline ``judge``, a script) nothing is kept and the result is returned unchanged.
With ``inputs=`` (the directories of the records judged, under ``--sprite-artifacts``) a manifest is
written beside them, so ``python -m pytest_sprite judge DIR`` can judge the same inputs again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

__all__ = [
    "DEVICE_ATTR",
    "MANIFEST_FORMAT",
    "RANKS_ATTR",
    "REPORT_ATTR",
    "ResultsPlugin",
    "assertion_results",
    "keep_reported",
    "progress",
    "record_assertion",
    "running_item",
    "set_progress_sink",
    "write_progress",
]

REPORT_ATTR = "sprite_assertions"
"""Attribute of a phase's TestReport holding the ``to_dict()`` payloads recorded during that phase."""
RANKS_ATTR = "sprite_ranks"
"""Attribute of a ranks test's last merged report: one dict per rank (rank, outcome, exit_code, signal,
duration, host, device)."""
DEVICE_ATTR = "sprite_device"
"""Attribute of each report a ranks test child makes: the device that rank ran on."""
MANIFEST_FORMAT = 1
"""Format of the ``*.assertion.json`` manifests that ``judge`` reads."""

results_key = pytest.StashKey[list[tuple[str, dict[str, Any]]]]()
"""(phase, payload) of every result recorded during the item, in order."""


class _Result(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=_Result)

_active: tuple[pytest.Item, str] | None = None
"""The item and phase running in this process right now."""
_progress_sink: Callable[[str], None] | None = None
"""Set by a ranks test child: sends a progress line to the controller."""


def record_assertion(result: R, *, inputs: Sequence[str | os.PathLike[str] | None] = ()) -> R:
    """Keep ``result`` with the running test for the reports; return it unchanged.

    ``inputs``: the stored records the assertion judged (their ``--sprite-artifacts`` directories);
    when every one is known, rank 0 writes a manifest beside them for ``python -m pytest_sprite judge``.
    """
    payload = result.to_dict()
    if not isinstance(payload.get("kind"), str):
        raise TypeError(
            f"{type(result).__name__}.to_dict() must name its assertion kind (a 'kind' string), got "
            f"{payload.get('kind')!r}; the reports dispatch on it"
        )
    if _active is None:
        return result
    item, phase = _active
    item.stash.setdefault(results_key, []).append((phase, payload))
    if inputs and all(p is not None for p in inputs) and _rank() == 0:
        write_manifest(payload, [Path(os.fspath(p)) for p in inputs if p is not None])
    return result


def running_item() -> pytest.Item | None:
    """The test item running in this process now (any phase), None outside a test."""
    return None if _active is None else _active[0]


def assertion_results(item: pytest.Item) -> list[dict[str, Any]]:
    """The payloads recorded while ``item`` ran in this process, in order."""
    return [payload for _, payload in item.stash.get(results_key, [])]


def keep_reported(item: pytest.Item, report: pytest.TestReport) -> None:
    """Keep the results a report carries with ``item`` (the controller, for a ranks test's merged reports)."""
    recorded = getattr(report, REPORT_ATTR, None) or []
    item.stash.setdefault(results_key, []).extend((report.when, payload) for payload in recorded)


def progress(message: str) -> None:
    """Show ``message`` as a progress line in the controller's terminal (``[sprite] <test>: message``).

    For long assertions: which arm or crash point is running. In a ranks test only rank 0's lines are
    shown (every rank runs the same assertion); outside a test it does nothing.
    """
    if _rank() != 0:
        return
    if _progress_sink is not None:
        _progress_sink(message)
        return
    if _active is None:
        return
    item = _active[0]
    write_progress(item.config, progress_line(item.nodeid, message))


def write_progress(config: pytest.Config, line: str) -> None:
    """Write one line to the terminal now, past output capture (as pytest's live logging does); only with ``-v``.

    At pytest's default verbosity the line of progress dots is one line per module: a line of ours in
    between would break it in two after every arm, so progress is for ``-v``, where each test has its own
    line anyway.
    """
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or config.get_verbosity() < 1:
        return
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is None:
        reporter.ensure_newline()
        reporter.write_line(line)
        return
    with capman.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)


def progress_line(nodeid: str, message: str) -> str:
    """The one format of a progress line, wherever it was emitted."""
    return f"[sprite] {nodeid}: {message}"


def set_progress_sink(sink: Callable[[str], None] | None) -> None:
    """Route progress lines elsewhere (a ranks test child sends them to its controller)."""
    global _progress_sink
    _progress_sink = sink


def _rank() -> int:
    from ..world import current_world

    world = current_world()
    return 0 if world is None else world.rank


def write_manifest(payload: dict[str, Any], inputs: list[Path]) -> Path:
    """Write ``<kind>-NN.assertion.json`` beside the first input; never overwrite an existing one."""
    folder = inputs[0].parent
    folder.mkdir(parents=True, exist_ok=True)
    document = {
        "format": MANIFEST_FORMAT,
        "kind": payload["kind"],
        "inputs": [os.path.relpath(p, folder) for p in inputs],
        "result": payload,
    }
    n = 1
    while True:
        path = folder / f"{payload['kind']}-{n:02d}.assertion.json"
        try:
            with open(path, "x", encoding="utf-8") as fh:
                json.dump(document, fh, indent=1)
                fh.write("\n")
            return path
        except FileExistsError:
            n += 1


class ResultsPlugin:
    """Tracks the running item and phase, and moves each phase's results onto its report (every process)."""

    def _phase(self, item: pytest.Item, phase: str) -> Generator[None, None, None]:
        global _active
        previous, _active = _active, (item, phase)
        try:
            yield
        finally:
            _active = previous

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        return (yield from self._phase(item, "setup"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        return (yield from self._phase(item, "call"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        return (yield from self._phase(item, "teardown"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        recorded = [payload for phase, payload in item.stash.get(results_key, []) if phase == call.when]
        if recorded:
            setattr(report, REPORT_ATTR, recorded)
        return report
