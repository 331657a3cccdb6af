"""Crash consistency of checkpoint saves: kill a run at every file event, tear written files, resume, judge.

What ckpt-chaos describes, inside the plugin: ``events`` (the log format), ``inject`` (the recorder
inside a run, which makes every file event a sub-world kill point), ``runs`` (one run: a sub-world of forks
whose kill plan is the crash), ``targets`` (a function, a command), ``matrix``
(building it), ``protocols`` (planted save protocols), ``hf`` (Hugging Face Trainer on a tiny in-memory
GPT-2) and ``lora`` (the lora_qwen recipe's Lightning fit under each shipped strategy). The assertion is
:func:`pytest_sprite.assert_crash_consistent` (beside its judge), crashing a target built by ``crash_targets``
(``crash_fn``, ``crash_command``, ``crash_recipe``, ``crash_hf_trainer``); ``api`` keeps the keyword form; the
verdict rules, the matrix and
``judge_crash_matrix`` are :mod:`pytest_sprite.assertions.crash_consistency` (pure).

A training function calls :func:`note_save_complete` and :func:`note_resumed_from` to make LOST_WORK
judgeable; both are no-ops outside a crash matrix. Importing this package imports no torch (and, since
the command form's ``sitecustomize`` imports it into every interpreter it starts, no third-party module but
pytest, which the verdict rules' module imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_sprite.save_crashes.inject import note_resumed_from, note_save_complete

if TYPE_CHECKING:
    from pytest_sprite.save_crashes.api import assert_crash_consistent
    from pytest_sprite.save_crashes.crash_targets import (
        crash_command,
        crash_fn,
        crash_hf_trainer,
        crash_recipe,
    )

__all__ = [
    "assert_crash_consistent",
    "crash_command",
    "crash_fn",
    "crash_hf_trainer",
    "crash_recipe",
    "note_resumed_from",
    "note_save_complete",
]

_LAZY = {
    "assert_crash_consistent": "pytest_sprite.save_crashes.api",
    "crash_command": "pytest_sprite.save_crashes.crash_targets",
    "crash_fn": "pytest_sprite.save_crashes.crash_targets",
    "crash_hf_trainer": "pytest_sprite.save_crashes.crash_targets",
    "crash_recipe": "pytest_sprite.save_crashes.crash_targets",
}
"""Loaded on first use: the sitecustomize of the command form imports this package into every interpreter."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
