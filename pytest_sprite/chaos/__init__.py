"""Crash consistency of checkpoint saves: kill a run at every file event, tear written files, resume, judge.

What the ckpt-chaos seed describes, inside the plugin: ``events`` (the log format), ``inject`` (the recorder
and crash trigger inside a run), ``runner`` (forked runs), ``targets`` (what can be crashed), ``matrix``
(building it), ``verdicts`` (the pure rules and the result), ``protocols`` (planted save protocols) and
``hf`` (Hugging Face Trainer on a tiny in-memory GPT-2). The assertion is
:func:`pytest_sprite.assertions.crash_consistency.assert_crash_consistent`.

A training function calls :func:`note_save_complete` and :func:`note_resumed_from` to make LOST_WORK
judgeable; both are no-ops outside a crash matrix. Importing this package imports no torch (and, since
the command form's ``sitecustomize`` imports it into every interpreter it starts, nothing but the stdlib).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pytest_sprite.chaos.events import SCRATCH
from pytest_sprite.chaos.inject import note_resumed_from, note_save_complete

if TYPE_CHECKING:
    from pytest_sprite.chaos.verdicts import VERDICTS, CrashMatrix, CrashRow, judge_crash_matrix

__all__ = [
    "SCRATCH",
    "VERDICTS",
    "CrashMatrix",
    "CrashRow",
    "judge_crash_matrix",
    "note_resumed_from",
    "note_save_complete",
]

_LAZY = {"VERDICTS", "CrashMatrix", "CrashRow", "judge_crash_matrix"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pytest_sprite.chaos' has no attribute {name!r}")
    return getattr(importlib.import_module("pytest_sprite.chaos.verdicts"), name)
