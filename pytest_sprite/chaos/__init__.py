"""Crash consistency of checkpoint saves: kill a run at every file event, tear written files, resume, judge.

What the ckpt-chaos seed describes, inside the plugin: ``events`` (the log format), ``inject`` (the recorder
and crash trigger inside a run), ``runner`` (forked runs), ``targets`` (a function, a command), ``matrix``
(building it), ``protocols`` (planted save protocols), ``hf`` (Hugging Face Trainer on a tiny in-memory
GPT-2) and ``lora`` (the lora_qwen recipe's Lightning fit under each shipped strategy). The assertion is
:func:`pytest_sprite.assert_crash_consistent` (here in ``api``); the verdict rules, the matrix and
``judge_crash_matrix`` are :mod:`pytest_sprite.assertions.crash_consistency` (pure).

A training function calls :func:`note_save_complete` and :func:`note_resumed_from` to make LOST_WORK
judgeable; both are no-ops outside a crash matrix. Importing this package imports no torch (and, since
the command form's ``sitecustomize`` imports it into every interpreter it starts, nothing but the stdlib).
"""

from __future__ import annotations

from pytest_sprite.chaos.inject import note_resumed_from, note_save_complete

__all__ = ["note_resumed_from", "note_save_complete"]
