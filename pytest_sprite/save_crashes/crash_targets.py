"""The crash targets users build: a training function, a command, a recipe's fit, HF Trainer.

Each constructor checks its arguments where the test builds the target (in a ranks test: on every rank, with
the test's world) and returns a :class:`MatrixTarget`, the
:class:`~pytest_sprite.assertions.crash_consistency.CrashTarget` that ``assert_crash_consistent`` crashes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_sprite.assertions.crash_consistency import CrashMatrix, MatrixSettings
from pytest_sprite.errors import SpriteUsageError

__all__ = [
    "MatrixTarget",
    "crash_command",
    "crash_fn",
    "crash_hf_trainer",
    "crash_recipe",
    "ranks_world",
    "resolve_target",
]


@dataclass(frozen=True)
class MatrixTarget:
    """A runnable target (:class:`~pytest_sprite.save_crashes.targets.Target`) as the assertion crashes it."""

    target: Any
    world: Any = None
    """The ranks test's World when built in one (every rank runs the matrix in lockstep), else None."""

    @property
    def label(self) -> str:
        return str(self.target.label)

    def crash_matrix(self, out_dir: str | os.PathLike[str], settings: MatrixSettings) -> CrashMatrix:
        """Create ``out_dir`` (rank 0 of a ranks test), run the matrix there and judge it; rank 0 stores it."""
        from pytest_sprite.save_crashes.matrix import prepare_out_dir, run_matrix

        world = self.world
        out = prepare_out_dir(out_dir) if world is None else world.run_on_rank(0, prepare_out_dir, out_dir)
        target = self.target
        if hasattr(target, "prepare"):
            target = target.prepare(out / "inject")
        return run_matrix(target, out, settings, write=world is None or world.rank == 0)


def crash_fn(
    fn: Callable[..., Any], *, ranks: int | None = None, env: Mapping[str, str] | None = None
) -> MatrixTarget:
    """``fn(train_dir)`` trains to the end, resuming from what it finds there, and returns its final weights.

    In a plain test each run is ``ranks`` forks of the test process (1 by default; with more, each has
    torchrun's variables and ``fn`` starts its process group; ``env`` is added to theirs). In a ranks test each
    run is a sub-world of ``ranks`` of the test's ranks (default: all) with its process group started, and
    ``fn`` must be module-level.
    """
    if not callable(fn) or isinstance(fn, (list, tuple)):
        raise SpriteUsageError(f"crash_fn needs a training function fn(train_dir), got a {type(fn).__name__}")
    return _build(fn, ranks=ranks, env=env)


def crash_command(
    argv: Sequence[str],
    *,
    result_file: str | None = None,
    resume_cmd: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> MatrixTarget:
    """An unmodified script, ``{out}`` where it takes its output directory; one interpreter per run.

    ``result_file`` (``"{out}/final.pt"``) is where it leaves its final weights; ``resume_cmd`` resumes it
    (default: the same command). Plain tests only.
    """
    return _build(list(argv), result_file=result_file, resume_cmd=resume_cmd, env=env)


def crash_recipe(recipe: Any, *, strategy: str, ranks: int | None = None) -> MatrixTarget:
    """The ``lora_qwen`` fixture's recipe, or a project's ``Recipe``: its Lightning fit under ``strategy``.

    ``strategy`` is single, ddp, fsdp or fsdp_file; the fit resumes with ``ckpt_path="last"``.
    """
    if type(recipe).__name__ not in ("LoraQwen", "Recipe"):
        raise SpriteUsageError(
            f"crash_recipe needs the lora_qwen fixture or a Recipe, got a {type(recipe).__name__}"
        )
    return _build(recipe, ranks=ranks, strategy=strategy)


def crash_hf_trainer(*, ranks: int = 1) -> MatrixTarget:
    """Hugging Face ``Trainer`` on a tiny in-memory GPT-2, saving every 5 steps (plain tests only)."""
    from pytest_sprite.save_crashes.hf import HFTrainerTarget

    return _build(HFTrainerTarget(ranks=ranks))


def _build(target: Any, **options: Any) -> MatrixTarget:
    world = ranks_world()
    defaults: dict[str, Any] = dict(ranks=None, strategy=None, result_file=None, resume_cmd=None, env=None)
    return MatrixTarget(resolve_target(target, world=world, **{**defaults, **options}), world)


def ranks_world() -> Any:
    """The World of the ranks test calling the assertion, None in a plain test (or a ranks test of one)."""
    from pytest_sprite.world import current_world

    world = current_world()
    return world if world is not None and world.distributed else None


def resolve_target(
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
    from pytest_sprite.save_crashes.targets import FunctionTarget, SubworldTarget

    if ranks is None:
        ranks = 1 if world is None else int(world.size)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise SpriteUsageError(f"ranks must be a positive int (processes per run), got {ranks!r}")
    if world is not None and ranks > world.size:
        raise SpriteUsageError(
            f"ranks={ranks} is more than this ranks test's {world.size} ranks; a run's sub-world is at most the test's"
        )
    # The lora_qwen fixture, or a project's Recipe: the same Lightning fit on its model, rows and loss.
    if type(target).__name__ in ("LoraQwen", "Recipe"):
        return _recipe_target(target, strategy=strategy, ranks=ranks, world=world)
    if strategy is not None:
        raise SpriteUsageError(
            f"strategy= applies to the lora_qwen recipe or a Recipe, not to a {type(target).__name__}"
        )
    if isinstance(target, (list, tuple)):
        return _command_target(
            target, ranks=ranks, world=world, result_file=result_file, resume_cmd=resume_cmd, env=env
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
        "a command list with '{out}', the lora_qwen recipe or a Recipe with strategy=, or a target from "
        "pytest_sprite.save_crashes.targets"
    )


def _recipe_target(target: Any, *, strategy: str | None, ranks: int, world: Any) -> Any:
    """The recipe's Lightning fit under ``strategy``: forks in a plain test, sub-worlds in a ranks test."""
    from pytest_sprite.save_crashes.lora import LORA_STRATEGIES, LoraQwenTarget, train_in_subworld
    from pytest_sprite.save_crashes.targets import SubworldTarget

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


def _command_target(
    argv: Sequence[Any],
    *,
    ranks: int,
    world: Any,
    result_file: str | None,
    resume_cmd: Sequence[str] | None,
    env: Mapping[str, str] | None,
) -> Any:
    """An unmodified script run as one interpreter per run (plain tests only)."""
    from pytest_sprite.save_crashes.targets import CommandTarget

    if world is not None:
        raise SpriteUsageError(
            "a command target starts its own interpreters: call it from a plain test, not a ranks test"
        )
    if ranks != 1:
        raise SpriteUsageError("a command target runs as one process (its own launcher, if any): ranks=1")
    if result_file is None:
        raise SpriteUsageError(
            "a command target needs result_file=: where the script leaves its final weights, "
            "e.g. crash_command(['python', 'train.py', '--out', '{out}'], result_file='{out}/final.pt')"
        )
    return CommandTarget(
        argv=tuple(str(a) for a in argv),
        result_file=result_file,
        resume_argv=None if resume_cmd is None else tuple(str(a) for a in resume_cmd),
        env=dict(env or {}),
    )
