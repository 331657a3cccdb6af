"""The keyword form of ``assert_crash_consistent`` from before its targets were built by constructors.

``pytest_sprite.assert_crash_consistent`` takes a target built by ``crash_fn``, ``crash_command``,
``crash_recipe`` or ``crash_hf_trainer``. This form, still importable as
``pytest_sprite.save_crashes.assert_crash_consistent``, takes what those constructors take as keywords, builds the
target and calls it; the two give the same matrix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_sprite.assertions import crash_consistency
from pytest_sprite.assertions.crash_consistency import CrashMatrix, MatrixSettings
from pytest_sprite.save_crashes.crash_targets import MatrixTarget, ranks_world, resolve_target
from pytest_sprite.save_crashes.events import FileEvent

__all__ = ["assert_crash_consistent"]


def assert_crash_consistent(
    target: Callable[[Path], Any] | Sequence[str] | Any,
    *,
    out_dir: str | os.PathLike[str],
    ranks: int | None = None,
    strategy: str | None = None,
    result_file: str | None = None,
    resume_cmd: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    select: Callable[[FileEvent], bool] | None = None,
    **settings: Any,
) -> CrashMatrix:
    """``pytest_sprite.assert_crash_consistent`` on the target that ``target`` and these keywords describe.

    ``target`` is a training function, a command list with ``{out}`` (with ``result_file=`` and optionally
    ``resume_cmd=``), the ``lora_qwen`` recipe or a ``Recipe`` (with ``strategy=``), a built target, or a target
    object of :mod:`pytest_sprite.save_crashes.targets`; ``settings`` are those of
    :class:`~pytest_sprite.assertions.crash_consistency.MatrixSettings`.
    """
    MatrixSettings(select=select, **settings)  # bad settings are refused before anything is built
    if not isinstance(target, MatrixTarget):
        world = ranks_world()
        target = MatrixTarget(
            resolve_target(
                target,
                ranks=ranks,
                strategy=strategy,
                result_file=result_file,
                resume_cmd=resume_cmd,
                env=env,
                world=world,
            ),
            world,
        )
    return crash_consistency.assert_crash_consistent(target, out_dir=out_dir, select=select, **settings)
