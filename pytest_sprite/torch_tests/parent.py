"""The parent's side of a torch test, in the controller: ``setUp`` before its ranks start, ``tearDown`` after.

Natively the pytest process is the parent: it runs ``setUpClass`` and ``setUp`` (which spawns the ranks),
waits, then ``tearDown``. Here each test's parent side runs in a fork of the controller made as the test
starts, so tests packed side by side keep apart what their ``setUp`` sets in module globals (torch's
``DistributedTest`` keeps its barrier directory in one, and a neighbour's ``tearDown`` would delete it).
``_spawn_processes`` / ``_start_processes`` do nothing there: the ranks are test children. What the ranks
need (the store file, the environment ``setUp`` changed) goes to the test's directory (``state``); the
fork waits, runs ``tearDown`` once every rank ended, reports how it went, and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import traceback
import unittest
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

import pytest

from ..glue.around import CarriedTest
from ..plumbing.process import die_with_parent, redirect_output
from ..plumbing.timing import monotonic
from .cases import TorchTest
from .exit_codes import apply_verdict
from .state import ParentState, write_state

__all__ = ["ParentSide"]

READY_WAIT: Final = 120.0
"""Seconds ``setUp`` may take before the ranks start without its state (they then fail, naming the log)."""
TEARDOWN_WAIT: Final = 120.0
"""Seconds ``tearDown`` may take once every rank ended."""
STORE_FILE: Final = "filestore"
"""The test's store file in its directory: one per test, the same path on every rank (on every host)."""


class ParentSide:
    """One torch test's parent side (an ``AroundRanks``)."""

    def __init__(self, test: TorchTest) -> None:
        self.test = test
        self.pid: int | None = None
        self.to_parent: int | None = None
        self.from_parent: int | None = None
        self.test_dir: Path | None = None
        self.checks: dict[str, Any] = {}
        """What the fork said about torch's exit-code checks for this method (``skip_checks``, ``expected``)."""

    def before(self, test_dir: Path) -> None:
        """Fork the parent's side, let it run ``setUp`` and write the ranks' state; wait until it has."""
        self.test_dir = test_dir
        go_read, go_write = os.pipe()
        back_read, back_write = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns when a process with threads forks (the pool's reader threads): the
            # parent's side touches none of what they guard, and ends with os._exit.
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the fork ends in os._exit
            os.close(go_write)
            os.close(back_read)
            _parent_main(self.test, test_dir, go_read, back_write)
        os.close(go_read)
        os.close(back_write)
        self.pid, self.to_parent, self.from_parent = pid, go_write, back_read
        message = _read_line(back_read, READY_WAIT)
        if message is not None:
            self.checks = message
        else:  # the ranks find no state and fail naming parent.log; tearDown cannot run
            self._end()

    def after(self, reports: Mapping[int, list[pytest.TestReport]], ends: Mapping[int, Any]) -> None:
        """Every rank ended: run ``tearDown`` in the fork, then decide the outcome by torch's exit codes."""
        teardown_error = None
        if self.pid is not None and self.to_parent is not None and self.from_parent is not None:
            try:
                os.write(self.to_parent, b"teardown\n")
            except OSError:
                pass
            message = _read_line(self.from_parent, TEARDOWN_WAIT)
            if message is None:
                teardown_error = f"the parent's side ended or hung in tearDown; see {self._log()}"
            else:
                teardown_error = message.get("error")
            self._end()
        apply_verdict(
            reports,
            ends,
            skip_checks=bool(self.checks.get("skip_checks", False)),
            expected=int(self.checks.get("expected", 0)),
            teardown_error=teardown_error,
        )

    def carried(self) -> Sequence[CarriedTest]:
        """A ``MultiProcessTestCase`` test carries no other: each has a world of its own."""
        return ()

    def _log(self) -> Path | None:
        return None if self.test_dir is None else self.test_dir / "parent.log"

    def _end(self) -> None:
        """Close the pipes and reap the fork (killed when it does not end by itself)."""
        for fd in (self.to_parent, self.from_parent):
            if fd is not None:
                os.close(fd)
        self.to_parent = self.from_parent = None
        pid, self.pid = self.pid, None
        if pid is None:
            return
        deadline = monotonic() + 5.0
        while monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
            select.select([], [], [], 0.01)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _read_line(fd: int, timeout: float) -> dict[str, Any] | None:
    """One JSON line from ``fd`` within ``timeout`` seconds; None on EOF or timeout."""
    data = b""
    deadline = monotonic() + timeout
    while not data.endswith(b"\n"):
        left = deadline - monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
    value = json.loads(data)
    return value if isinstance(value, dict) else None


def _send(fd: int, payload: dict[str, Any]) -> None:
    os.write(fd, json.dumps(payload).encode() + b"\n")


def _parent_main(test: TorchTest, test_dir: Path, go: int, back: int) -> NoReturn:
    """Body of the fork: ``setUp``, the ranks' state, wait, ``tearDown``; never returns."""
    try:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        redirect_output(test_dir / "parent.log", stdin_devnull=True)
        instance, state, checks = _set_up(test, test_dir)
        write_state(test_dir, state)
        _send(back, checks)
        os.read(go, 64)  # "teardown", or EOF when the controller gave up on this test
        _send(back, {"error": _tear_down(test, instance, set_up=state.error is None and not state.skipped)})
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(0)


def _set_up(test: TorchTest, test_dir: Path) -> tuple[Any, ParentState, dict[str, Any]]:
    """``setUpClass`` and ``setUp`` with the spawn left out; the state for the ranks, and torch's checks."""
    before = dict(os.environ)
    instance: Any = None
    skipped = error = None
    try:
        instance = test.cls(test.name)
        # the ranks are test children: torch's spawn (called by setUp in most subclasses) does nothing here
        instance._spawn_processes = lambda *args, **kwargs: None
        instance._start_processes = lambda *args, **kwargs: None
        test.cls.setUpClass()
        instance.setUp()
    except unittest.SkipTest as exc:
        skipped = str(exc) or "skipped in setUp"
    except Exception:
        error = traceback.format_exc()
    store = test_dir / STORE_FILE
    store.touch()
    made = getattr(instance, "file_name", None)
    if isinstance(made, str) and made != str(store):
        # setUp made the store file in /tmp, which other hosts do not see: the test's directory stands in
        if os.path.isfile(made) and os.path.getsize(made) == 0:
            os.unlink(made)
        instance.file_name = str(store)
    after = dict(os.environ)
    state = ParentState(
        file_name=str(store),
        env_set={k: v for k, v in after.items() if before.get(k) != v},
        env_unset=[k for k in before if k not in after],
        fake_pg=bool(getattr(instance, "fake_pg", False)),
        skipped=skipped,
        error=error,
    )
    return instance, state, _checks(instance, test.name)


def _checks(instance: Any, name: str) -> dict[str, Any]:
    """``skip_return_code_checks`` / ``special_return_code_checks`` for this method, as ``setUp`` left them.

    torch compares them with the method before ``join_or_run`` wrapped it (``__wrapped__``).
    """
    method = getattr(getattr(instance, name, None), "__wrapped__", None)
    skip = getattr(instance, "skip_return_code_checks", None) or []
    special = getattr(instance, "special_return_code_checks", None) or {}
    expected = special.get(method, 0) if method is not None else 0
    return {"skip_checks": method is not None and method in skip, "expected": int(expected)}


def _tear_down(test: TorchTest, instance: Any, *, set_up: bool) -> str | None:
    """``tearDown`` (when ``setUp`` passed), the cleanups and ``tearDownClass``; the first traceback, or None."""
    errors: list[str] = []
    for step in (
        (instance.tearDown if set_up and instance is not None else None),
        (instance.doCleanups if instance is not None else None),
        test.cls.tearDownClass,
        getattr(test.cls, "doClassCleanups", None),
    ):
        if step is None:
            continue
        try:
            step()
        except Exception:
            errors.append(traceback.format_exc())
    return errors[0] if errors else None
