"""``assert_crash_consistent``: kill a training job at every file event of its saves, resume it, judge the result.

The ckpt-chaos seed's method inside a test. A fault-free run records every file event under the training
directory; then, for every event, a fresh run dies there (and, for each file write, a second run dies with the
file cut to half its size), the job is resumed by running the target again on what the crash left, and its
final weights are compared with the fault-free run's. Verdicts and the rules that make the matrix fail are in
:mod:`pytest_sprite.assertions.crash_consistency`. It emulates a process kill (``os._exit``), not power loss: the page cache
survives and writes are not reordered.

Targets: a training function (``fn(train_dir) -> final weights``), run in forks of the test process; or a
command list with ``{out}`` (an unmodified script, one interpreter per run, ``result_file=`` names its final
weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_sprite._results import record_assertion
from pytest_sprite.assertions.crash_consistency import MATRIX_FILE, CrashMatrix, check_crash_matrix
from pytest_sprite.chaos.events import FileEvent
from pytest_sprite.errors import SpriteUsageError

__all__ = ["assert_crash_consistent"]


def assert_crash_consistent(
    target: Callable[[Path], Any] | Sequence[str] | Any,
    *,
    out_dir: str | os.PathLike[str],
    ranks: int | None = None,
    strategy: str | None = None,
    flake: int = 0,
    allow_lost_work: bool = True,
    atol: float = 0.0,
    result_file: str | None = None,
    resume_cmd: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    grace: float = 5.0,
    max_points: int | None = None,
    select: Callable[[FileEvent], bool] | None = None,
    tear: str = "all",
) -> CrashMatrix:
    """Crash ``target`` at every file event of its run, resume each crash, and require every resume to be sound.

    ``target`` is a training function ``fn(train_dir)`` that trains to the end, resuming from whatever it finds in
    ``train_dir``, and returns its final weights (a mapping of tensors, or a module), run as ``ranks`` forked
    processes (with torchrun's variables when more than one; the function starts its process group); in a
    ranks test, call it on every rank: each run is then a sub-world of the test's ranks (``run_subworld``,
    with its process group started), and the function must be module-level; or the
    ``lora_qwen`` fixture's recipe with ``strategy=`` (single, ddp, fsdp, fsdp_file; a Lightning fit resumed
    with ``ckpt_path="last"``); or a command (a list of
    strings with ``{out}`` where the script takes its output directory) with ``result_file=`` (``"{out}/final.pt"``)
    and optionally ``resume_cmd=``; or a ready-made target object (see :mod:`pytest_sprite.chaos.targets`).

    Raises :class:`~pytest_sprite.assertions.crash_consistency.CrashConsistencyError` (an ``AssertionError`` carrying the matrix) on any HARD_FAIL or
    SILENT_DIVERGENCE row, on LOST_WORK when ``allow_lost_work=False``, when two fault-free runs differ (the
    target is not deterministic, so divergence verdicts would mean nothing), when any of ``flake`` extra fault-free
    runs fails, or when the control run (no crash) does not pass. Returns the matrix otherwise.

    Writes only inside ``out_dir``, which it creates and refuses if it exists; the matrix is stored there as
    ``matrix.json`` for ``judge_crash_matrix``. ``atol`` is the weight difference still counted as equal (0: bit
    for bit); ``timeout`` bounds each run (seconds); ``max_points`` samples that many crash points evenly.
    """
    from pytest_sprite.chaos.matrix import TEAR_CHOICES, prepare_out_dir, run_matrix

    for name, value in (("flake", flake),):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SpriteUsageError(
                f"{name} must be a non-negative int (extra fault-free runs), got {value!r}"
            )
    if not atol >= 0:
        raise SpriteUsageError(f"atol must be >= 0, got {atol!r}")
    if not timeout > 0:
        raise SpriteUsageError(f"timeout must be positive seconds, got {timeout!r}")
    if max_points is not None and (not isinstance(max_points, int) or max_points < 1):
        raise SpriteUsageError(f"max_points must be a positive int or None, got {max_points!r}")
    if tear not in TEAR_CHOICES:
        raise SpriteUsageError(f"tear={tear!r} is not one of {', '.join(map(repr, TEAR_CHOICES))}")
    world = _test_world()
    resolved = _target(
        target,
        ranks=ranks,
        strategy=strategy,
        result_file=result_file,
        resume_cmd=resume_cmd,
        env=env,
        world=world,
    )
    # in a ranks test every rank runs this same matrix in lockstep (each run is a collective sub-world);
    # rank 0 alone creates out_dir and writes the matrix into it
    out = prepare_out_dir(out_dir) if world is None else world.run_on_rank(0, prepare_out_dir, out_dir)
    if hasattr(resolved, "prepare"):
        resolved = resolved.prepare(out / "inject")
    matrix = run_matrix(
        resolved,
        out,
        flake=flake,
        atol=float(atol),
        allow_lost_work=allow_lost_work,
        timeout=float(timeout),
        grace=float(grace),
        max_points=max_points,
        select=select,
        tear=tear,  # type: ignore[arg-type]
        write=world is None or world.rank == 0,
    )
    record_assertion(matrix, inputs=[out / MATRIX_FILE])  # rank 0 wrote it: a manifest for `judge`
    return check_crash_matrix(matrix)


def _test_world() -> Any:
    """The World of the ranks test calling the assertion, None in a plain test (or a ranks test of one)."""
    from pytest_sprite.world import current_world

    world = current_world()
    return world if world is not None and world.distributed else None


def _target(
    target: Any,
    *,
    ranks: int | None,
    strategy: str | None,
    world: Any,
    result_file: str | None,
    resume_cmd: Sequence[str] | None,
    env: Mapping[str, str] | None,
) -> Any:
    """The target object for what the user passed, or a SpriteUsageError saying what is accepted."""
    from pytest_sprite.chaos.targets import CommandTarget, FunctionTarget, SubworldTarget

    if ranks is None:
        ranks = 1 if world is None else int(world.size)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise SpriteUsageError(f"ranks must be a positive int (processes per run), got {ranks!r}")
    if world is not None and ranks > world.size:
        raise SpriteUsageError(
            f"ranks={ranks} is more than this ranks test's {world.size} ranks; a run's sub-world is at most the test's"
        )
    # The lora_qwen fixture, or a project's Recipe (issue 15): the same Lightning fit on its model, rows and loss.
    if type(target).__name__ in ("LoraQwen", "Recipe"):
        from pytest_sprite.chaos.lora import LORA_STRATEGIES, LoraQwenTarget, train_in_subworld

        source = target if type(target).__name__ == "Recipe" else None
        name = target.name if source is not None else "lora_qwen"
        if strategy is None:
            raise SpriteUsageError(
                f"crashing the {name} recipe needs strategy=, one of {', '.join(LORA_STRATEGIES)}"
            )
        size = 1 if strategy == "single" else ranks
        if world is not None:
            LoraQwenTarget(strategy=strategy, ranks=size, source=source)  # validates
            return SubworldTarget(
                fn=train_in_subworld, args=(strategy, source), ranks=size, name=f"{name} {strategy}"
            )
        return LoraQwenTarget(strategy=strategy, ranks=size, source=source)
    if strategy is not None:
        raise SpriteUsageError(
            f"strategy= applies to the lora_qwen recipe or a Recipe, not to a {type(target).__name__}"
        )
    if isinstance(target, (list, tuple)):
        if world is not None:
            raise SpriteUsageError(
                "a command target starts its own interpreters: call it from a plain test, not a ranks test"
            )
        if ranks != 1:
            raise SpriteUsageError("a command target runs as one process (its own launcher, if any): ranks=1")
        if result_file is None:
            raise SpriteUsageError(
                "a command target needs result_file=: where the script leaves its final weights, "
                "e.g. assert_crash_consistent(['python', 'train.py', '--out', '{out}'], "
                "result_file='{out}/final.pt', out_dir=...)"
            )
        return CommandTarget(
            argv=tuple(str(a) for a in target),
            result_file=result_file,
            resume_argv=None if resume_cmd is None else tuple(str(a) for a in resume_cmd),
            env=dict(env or {}),
        )
    if result_file is not None or resume_cmd is not None:
        raise SpriteUsageError(
            "result_file= and resume_cmd= apply to a command target (a list of strings); "
            f"got a {type(target).__name__}"
        )
    if hasattr(target, "run") and hasattr(target, "ranks") and hasattr(target, "label"):
        if world is not None and not isinstance(target, SubworldTarget):
            raise SpriteUsageError(
                f"a {type(target).__name__} forks its own processes: call it from a plain test; in a ranks test "
                "pass a module-level training function or the lora_qwen recipe"
            )
        return target
    if callable(target):
        if world is not None:
            if env:
                raise SpriteUsageError(
                    "env= is not supported in a ranks test (sub-worlds inherit the test's)"
                )
            return SubworldTarget(fn=target, ranks=ranks)
        return FunctionTarget(fn=target, env=dict(env or {}), ranks=ranks)
    raise SpriteUsageError(
        f"cannot crash a {type(target).__name__}: pass a training function fn(train_dir) -> final weights, "
        "a command list with '{out}', or a target from pytest_sprite.chaos.targets"
    )
