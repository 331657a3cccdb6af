"""SIGTERM in the controller ends the session as Ctrl-C does: agents shut down, reports written.

A batch system ends a job with SIGTERM, then SIGKILL some seconds later (Slurm's ``scancel`` and time limit,
after its ``KillWait``, 30 s by default; PBS's ``qdel`` and walltime alike). Python's default for SIGTERM ends the
process on the spot: no JUnit file, no ``--sprite-report``, and the tests that had finished are lost with the
session. The handler raises :class:`Terminated` (a KeyboardInterrupt, so pytest and the controller take their
interrupt paths: the launch is ended, ``pytest_sessionfinish`` writes every report) and names the signal and its
usual sender. Only the first SIGTERM raises; the handler before the session comes back at its end.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import pytest

__all__ = ["Terminated", "TerminationPlugin"]

MESSAGE = (
    "pytest-sprite: the session got SIGTERM (a batch system ending the job: Slurm's scancel, time limit or "
    "node failure, PBS's qdel or walltime) and stopped; the reports hold the tests that finished"
)


class Terminated(KeyboardInterrupt):
    """The session was ended by SIGTERM."""


class TerminationPlugin:
    """Turns the controller's first SIGTERM into :class:`Terminated` for the length of the session."""

    def __init__(self) -> None:
        self.previous: Any = None
        self.installed = False
        self.received = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # the session is already stopping; let it finish its reports
            return
        self.received = True
        raise Terminated(MESSAGE)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # pytest.main in a thread of another program: its signals are that program's
        self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.installed = True

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous)
            self.installed = False
