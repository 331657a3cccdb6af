"""Run the roles of one checkpoint-resume check, each in its own sub-world, and collect their records.

The order is the lightning-sprite procedure's: an uninterrupted fit and its twin; a fit killed one step past its epoch-1
checkpoint; a resume of that checkpoint in fresh processes (with a fault planted after the restore, for a
negative control); a reload of the checkpoint the resume wrote at its end; for FSDP2 a resume at half the
world (``reshard``); for DDP and full-state FSDP2 a resume on one device (``export``). Importing this module
imports no torch; the roles load it in their own processes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.clean_references import count_runs
from pytest_sprite.recipes.resume_spec import RESUME_FAULTS, STRATEGIES, ResumeRecipe, RoleSpec
from pytest_sprite.records import ResumeRun, RoleRecord, StateCapture, StepRecord
from pytest_sprite.subworld import KillAt, SubworldError, SubworldResult, run_subworld
from pytest_sprite.world import World

if TYPE_CHECKING:
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.recipes.spec import RecipeSpec

T = TypeVar("T")

__all__ = ["EXPORTED", "PRECISIONS", "RESHARDED", "records_from_events", "resume_roles", "run_resume_roles"]

RESHARDED: tuple[str, ...] = ("fsdp",)
"""Strategies whose checkpoint also resumes at half the world size (torch.distributed.checkpoint reshards)."""
EXPORTED: tuple[str, ...] = ("ddp", "fsdp_file")
"""Strategies whose checkpoint is one full-state file that also loads on one device."""
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed")
"""The lightning-sprite procedure's checkpoint cells: FP32 and BF16 autocast."""


def _records(result: SubworldResult, *, killed: bool, directory: Path) -> tuple[RoleRecord, ...]:
    written = tuple(sorted(p.name for p in directory.glob("*.ckpt"))) if directory.is_dir() else ()
    return tuple(
        records_from_events(list(o.events), killed=killed and o.status == "killed", checkpoints=written)
        for o in result.outcomes
    )


def run_resume_roles(
    recipe: ResumeRecipe,
    *,
    strategy: str,
    precision: str,
    ranks: int,
    directory: str | os.PathLike[str],
    reshard: bool = False,
    export: bool | None = None,
    fault: str | None = None,
    timeout: float = 300.0,
    world: World | None = None,
) -> ResumeRun:
    """Run every role of one check in sub-worlds of ``ranks`` processes; call it on every rank of the test.

    ``recipe`` is a :class:`~pytest_sprite.recipes.resume_spec.ResumeRecipe`. Checkpoints go under
    ``directory`` (one subdirectory per role), which every rank must see. ``export`` defaults to True for
    the strategies whose checkpoint is one file (ddp, fsdp_file). With the test's ``world`` the roles
    before the restore (fit, twin, killed: no fault reaches them) come from the session store when an
    earlier test computed them (:mod:`pytest_sprite.recipes.clean_references`); only the roles after it run here.
    """
    export, n = _check_plan(strategy, ranks=ranks, reshard=reshard, export=export)
    roles = _Roles(
        recipe=recipe, strategy=strategy, precision=precision, root=Path(directory), timeout=timeout
    )
    before = _before_restore(roles, n, world=world)
    roles.records.update(before.records)
    roles.timings.update(before.wall_s)
    checkpoint = str(Path(before.source) / "killed" / "epoch=0.ckpt")
    roles.run("resume", n, resume_from=checkpoint, fault=fault)
    final = str(roles.root / "resume" / f"epoch={recipe.epochs - 1}.ckpt")
    roles.run("reload", n, resume_from=final, max_epochs=recipe.epochs + 1, stop_after_restore=True)
    if reshard:
        roles.run("reshard", n // 2, resume_from=checkpoint)
    if export:
        roles.run("export", 1, strategy="single", resume_from=checkpoint)
    after = [r for r in roles.records if r not in BEFORE_RESTORE]
    count_runs(world, f"roles {', '.join(after)} of {strategy}, {precision}", unit="role", units=len(after))
    return ResumeRun(
        strategy=strategy,
        precision=precision,
        ranks=n,
        global_batch=recipe.global_batch,
        steps_per_epoch=recipe.steps_per_epoch,
        epochs=recipe.epochs,
        fault=fault,
        roles=roles.records,
        timings=roles.timings,
        device_type=_device_type(roles.records["fit"][0]),
        directory=str(roles.root),
    )


@dataclass(frozen=True)
class _BeforeRestore:
    """The roles before the restore: the uninterrupted fit, its twin, the killed fit (and its saves)."""

    records: dict[str, tuple[RoleRecord, ...]]
    wall_s: dict[str, tuple[float, float]]
    """Each role's wall time and start (not part of what is compared)."""
    source: str
    """The directory the roles wrote their checkpoints under (``killed/epoch=0.ckpt`` is resumed)."""


BEFORE_RESTORE: tuple[str, ...] = ("fit", "twin", "killed")


def _before_restore(roles: _Roles, n: int, *, world: World | None) -> _BeforeRestore:
    """The fault-free roles, from the session store or run here; a fault is planted only after the restore."""
    from pytest_sprite.recipes.clean_references import keep_files, obtain, resume_key

    def key() -> str:
        assert world is not None
        return resume_key(
            roles.recipe, strategy=roles.strategy, precision=roles.precision, ranks=n, world=world
        )

    def compute() -> _BeforeRestore:
        roles.run("fit", n)
        roles.run("twin", n)
        kill_step = roles.recipe.steps_per_epoch + 1
        killed = roles.run("killed", n, kill=KillAt(event="step", at=kill_step))
        if killed.killed() != list(range(n)):
            raise SubworldError(
                f"the killed role should have died at step {kill_step} on every rank, one step past its "
                f"epoch-1 checkpoint:\n{killed.report()}",
                killed,
            )
        source = str(roles.root)
        if world is not None:
            # The killed fit's checkpoint outlives this test's tmp_path (which its retention policy may
            # delete): later tests resume from the store's copy.
            source = world.run_on_rank(0, keep_files, roles.root, "killed", key()) or source
        return _BeforeRestore(
            records={r: roles.records[r] for r in BEFORE_RESTORE},
            wall_s={r: roles.timings[r] for r in BEFORE_RESTORE},
            source=source,
        )

    what = f"roles {', '.join(BEFORE_RESTORE)} of {roles.strategy}, {roles.precision}"
    if world is None:
        return compute()

    before, _ = obtain(what, compute, world=world, key=key, unit="role", units=len(BEFORE_RESTORE))
    return before


def _check_plan(strategy: str, *, ranks: int, reshard: bool, export: bool | None) -> tuple[bool, int]:
    """Refuse a reshard or export the strategy's checkpoint cannot do; return ``export`` and the role size."""
    if reshard and strategy not in RESHARDED:
        raise SpriteUsageError(
            f"reshard=True resumes a sharded checkpoint at half the world; strategy {strategy!r} writes no "
            f"sharded checkpoint (reshard runs for: {', '.join(RESHARDED)})"
        )
    if export is None:
        export = strategy in EXPORTED
    if export and strategy not in EXPORTED:
        raise SpriteUsageError(
            f"export=True loads a full-state checkpoint on one device; strategy {strategy!r} does not write "
            f"one (export runs for: {', '.join(EXPORTED)})"
        )
    n = 1 if strategy == "single" else ranks
    if reshard and (n < 2 or n % 2):
        raise SpriteUsageError(
            f"reshard=True resumes at half the world: {n} ranks do not halve; run the test on an even number"
        )
    return export, n


@dataclass(kw_only=True)
class _Roles:
    """The roles of one check run so far: each in its own sub-world, under ``root / <role>``."""

    recipe: ResumeRecipe
    strategy: str
    precision: str
    root: Path
    timeout: float
    records: dict[str, tuple[RoleRecord, ...]] = field(default_factory=dict)
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)

    def run(self, role: str, size: int, *, kill: KillAt | None = None, **spec_fields: Any) -> SubworldResult:
        """Run ``role`` on ``size`` ranks (killed at ``kill``); a role that must finish and does not fails."""
        from pytest_sprite.recipes._resume import run_role

        spec = RoleSpec(
            role=role,
            strategy=spec_fields.pop("strategy", self.strategy),
            precision=self.precision,
            recipe=self.recipe,
            directory=str(self.root / role),
            **spec_fields,
        )
        result = run_subworld(run_role, args=(spec,), ranks=size, kill=kill, timeout=self.timeout)
        self.timings[role] = (result.wall_s, result.start_s)
        if kill is None and not result.ok:
            raise SubworldError(
                f"the {role} role of the resume check did not finish:\n{result.report()}", result
            )
        self.records[role] = _records(result, killed=kill is not None, directory=self.root / role)
        return result


def _device_type(record: RoleRecord) -> str:
    devices = record.saves[0].param_devices if record.saves else {}
    return next(iter(devices.values()), "cpu").split(":")[0]


def resume_roles(
    recipe: RecipeSpec,
    *,
    strategy: str,
    precision: str,
    reshard: bool,
    export: bool | None,
    fault: str | None,
    directory: str | os.PathLike[str] | None,
    world: World | None,
    artifacts: ArtifactDir | None = None,
) -> ResumeRun:
    """``Recipe.resume_roles`` (``lora_qwen``'s too): check the arguments, share a checkpoint directory, run
    every role on the recipe's model, rows, loss and sharding, store the run.

    Rank 0 stores the run as ``resume-run.pt`` (what ``assert_resume_bitexact`` lists in its manifest, so
    ``python -m pytest_sprite judge`` judges it again): with ``artifacts`` in a fresh
    ``NN-resume-<strategy>[-<fault>]`` directory claimed before any role runs (an existing one is refused,
    as an arm's is), else beside the checkpoints. The run comes back with ``source`` naming the file.
    """
    if strategy not in STRATEGIES:
        raise SpriteUsageError(
            f"assert_resume_bitexact(strategy={strategy!r}): use one of {', '.join(STRATEGIES)}"
        )
    if precision not in PRECISIONS:
        raise SpriteUsageError(
            f"assert_resume_bitexact(precision={precision!r}): use one of {', '.join(PRECISIONS)} (the hardware cells)"
        )
    if fault is not None and fault not in RESUME_FAULTS:
        raise SpriteUsageError(
            f"assert_resume_bitexact(fault={fault!r}): the faults planted after a restore are "
            f"{', '.join(RESUME_FAULTS)}"
        )
    size = world.size if world is not None else 1
    if strategy != "single" and (world is None or not world.distributed or size < 2):
        raise SpriteUsageError(
            f"assert_resume_bitexact(strategy={strategy!r}) needs the ranks of a test marked "
            "@pytest.mark.ranks(n) with n >= 2; this test runs on one process"
        )
    resume_recipe = ResumeRecipe(source=recipe, seed=int(getattr(recipe, "seed", 0)), global_batch=2 * size)
    from pytest_sprite.recipes.artifacts import write_resume_run

    target = None
    if artifacts is not None:
        target = _on_rank0(world, artifacts.next_resume_dir, strategy=strategy, fault=fault)
    run = run_resume_roles(
        resume_recipe,
        strategy=strategy,
        precision=precision,
        ranks=size,
        directory=_shared_directory(directory, world),
        reshard=reshard,
        export=export,
        fault=fault,
        world=world,
    )
    folder = target if target is not None else run.directory
    stored = _on_rank0(world, write_resume_run, run, folder, fresh=target is not None)
    return dataclasses.replace(run, source=str(stored))


def _on_rank0(world: World | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` run by rank 0 only, the others waiting for its value (a file written once, on the shared disk)."""
    if world is None:
        return fn(*args, **kwargs)
    return world.run_on_rank(0, fn, *args, **kwargs)


def _shared_directory(directory: str | os.PathLike[str] | None, world: World | None) -> str:
    """A fresh directory every rank uses: made by rank 0 and broadcast (the ranks share its filesystem).

    In a ranks test it is in the test's ``tmp_path``, which every node sees; the system's temporary
    directory is each node's own (ranks on another node wrote their shards where rank 0 never
    looked).
    """
    import tempfile

    if directory is not None:
        path = os.fspath(directory)
    elif world is None or world.rank == 0:
        try:
            base: str | None = str(world.rank_path()) if world is not None and world.distributed else None
        except RuntimeError:  # a world without a test directory: one host
            base = None
        path = tempfile.mkdtemp(prefix="sprite-resume-", dir=base)
    else:
        path = ""
    if world is not None and world.distributed:
        path = world.broadcast_object(path)
    os.makedirs(path, exist_ok=True)
    return path


def records_from_events(
    events: list[tuple[str, Any]], *, killed: bool, checkpoints: tuple[str, ...] = ()
) -> RoleRecord:
    """Rebuild one rank's :class:`RoleRecord` from what its role emitted (works for a killed role too)."""
    meta: dict[str, Any] | None = None
    steps: list[StepRecord] = []
    saves: list[StateCapture] = []
    restored: StateCapture | None = None
    for name, value in events:
        if name == "meta":
            meta = value
        elif name == "step":
            steps.append(value)
        elif name == "save":
            saves.append(value)
        elif name == "restored":
            restored = value
    if meta is None:
        raise RuntimeError(
            "the role ended before it said what it was (no 'meta' event): it failed at start-up"
        )
    return RoleRecord(
        role=meta["role"],
        strategy=meta["strategy"],
        precision=meta["precision"],
        rank=meta["rank"],
        world_size=meta["world_size"],
        global_batch=meta["global_batch"],
        fault=meta["fault"],
        steps=tuple(steps),
        saves=tuple(saves),
        restored=restored,
        checkpoints=checkpoints,
        killed=killed,
    )
