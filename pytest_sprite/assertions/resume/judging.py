"""Judging a resume run (pure) and the assertion that runs the roles and judges them."""

from __future__ import annotations

import os
from typing import Any

from pytest_sprite.assertions.evidence import FailedCheck
from pytest_sprite.assertions.resume.checks import (
    continuation,
    continuation_gaps,
    first_departure,
    fold,
    restore_problems,
    rng,
    twin,
)
from pytest_sprite.assertions.resume.results import RESTORE_CHECKS, ResumeArm, ResumeError, ResumeResult
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.recorded_results import record_assertion
from pytest_sprite.plumbing.phases import phase
from pytest_sprite.records import FP32_PRECISION, ResumeRun

__all__ = ["assert_resume_bitexact", "judge_resume"]

# -------------------------------------------------------------------------------------------------------
# judging a run


def _arm_label(strategy: str, role: str, ranks: int, from_ranks: int, fault: str | None) -> str:
    label = {
        "resume": f"{strategy} resume",
        "reload": f"{strategy} reload",
        "reshard": f"{strategy} reshard {from_ranks}->{ranks}",
        "export": f"{strategy} export",
    }[role]
    return f"{label} (fault {fault})" if fault else label


@phase("judging")
def judge_resume(run: ResumeRun, *, run_label: str | None = None) -> ResumeResult:
    """Every required check and reported figure of ``run``; pure (no processes, no assertion)."""
    for needed in ("fit", "twin", "killed", "resume", "reload"):
        if needed not in run.roles or not run.roles[needed]:
            raise SpriteUsageError(
                f"the resume run has no {needed!r} role (roles: {', '.join(run.roles)}); run every role "
                "with pytest_sprite.recipes.resume_roles.run_resume_roles"
            )
    fit, killed, resume = run.roles["fit"], run.roles["killed"], run.roles["resume"]
    if not killed[0].saves:
        raise SpriteUsageError(
            "the killed fit reported no checkpoint save before it died; it must be killed one step past its "
            "epoch-1 checkpoint"
        )
    arms = [
        _judge_arm(run, role, loads, fault)
        for role, loads, fault in (
            ("resume", "killed fit's epoch-1 checkpoint", run.fault),
            ("reload", "resume's final checkpoint", None),
            ("reshard", "killed fit's epoch-1 checkpoint", None),
            ("export", "killed fit's epoch-1 checkpoint", None),
        )
        if run.roles.get(role)
    ]
    checkpoint = killed[0].saves[0]
    gaps = [continuation_gaps(run.strategy, resume, fit, checkpoint)]
    if run.roles.get("reshard"):
        gaps.append(continuation_gaps(f"{run.strategy}_reshard", run.roles["reshard"], fit, checkpoint))
    if run.roles.get("export"):
        gaps.append(continuation_gaps(f"{run.strategy}_export", run.roles["export"], fit, checkpoint))
    departs = first_departure(resume, fit)
    reshard = run.roles.get("reshard")
    return ResumeResult(
        run=run_label or f"{run.strategy}, {run.precision}",
        strategy=run.strategy,
        precision=run.precision,
        ranks=run.ranks,
        global_batch=run.global_batch,
        reshard_ranks=len(reshard) if reshard else None,
        export=bool(run.roles.get("export")),
        fault=run.fault,
        arms=tuple(arms),
        gaps=tuple(gaps),
        departs=departs,
        twin=twin(fit, run.roles["twin"]),
        rng=rng(resume, fit),
        timings=dict(run.timings),
    )


def _judge_arm(run: ResumeRun, role: str, loads: str, fault: str | None) -> ResumeArm:
    """One restore's required checks: its state against the save it loaded, then (but for the reload) its
    continuation against the uninterrupted fit."""
    records, fit, killed = run.roles[role], run.roles["fit"], run.roles["killed"]
    source = run.roles["resume"] if role == "reload" else killed
    label = _arm_label(run.strategy, role, len(records), len(source), fault)
    failed: list[FailedCheck] = []
    restore: dict[str, list[tuple[int, str]]] = {}
    same_world = len(records) == len(source)
    for rec in records:
        origin = source[rec.rank] if same_world else source[0]
        if not origin.saves:
            restore.setdefault("loop", []).append((rec.rank, f"the {loads} was never saved"))
            continue
        saved = origin.saves[-1] if role == "reload" else origin.saves[0]
        if rec.restored is None:
            restore.setdefault("loop", []).append((rec.rank, "the role reported no restored state"))
            continue
        for check, detail in restore_problems(rec.restored, saved, same_world=same_world).items():
            restore.setdefault(check, []).append((rec.rank, detail))
    for check in RESTORE_CHECKS:
        if check in restore:
            failed.append(FailedCheck(arm=label, check=check, fault=fault, detail=fold(restore[check])))
    if role != "reload":
        problems = continuation(
            records, fit, killed if role == "resume" else None, same_world=same_world and role == "resume"
        )
        for check in ("first_loss", "lr", "rows"):
            if check in problems:
                failed.append(FailedCheck(arm=label, check=check, fault=fault, detail=problems[check]))
    return ResumeArm(
        label=label, role=role, ranks=len(records), loads=loads, fault=fault, failed=tuple(failed)
    )


# -------------------------------------------------------------------------------------------------------
# the assertion


def assert_resume_bitexact(
    recipe: Any,
    *,
    strategy: str = "ddp",
    precision: str = FP32_PRECISION,
    reshard: bool = False,
    export: bool | None = None,
    fault: str | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> ResumeResult:
    """Kill a fit after its epoch-1 checkpoint, resume it in new processes, and require the restore bit for bit.

    ``recipe`` is the ``lora_qwen`` fixture, or any recipe with a ``resume_roles(...)`` method returning a
    :class:`~pytest_sprite.records.ResumeRun`; a ``ResumeRun`` itself is judged as it is (offline). Call it
    on every rank of a ranks test (a plain test runs ``single``): every role runs in a sub-world of the
    test's ranks. ``reshard=True`` (FSDP2) also resumes at half the world; ``export`` (default on for ddp and
    fsdp_file) also loads the checkpoint on one device; ``fault`` plants a resume fault after the restore
    (a negative control for ``expect_fault_rejected``). Checkpoints go to ``directory`` (default: a fresh
    directory of rank 0's, shared with every rank).

    The recipe stores the run it hands back (rank 0 writes ``resume-run.pt``: in a fresh
    ``NN-resume-<strategy>`` directory of the test under ``--sprite-artifacts``, else beside the
    checkpoints in ``directory``); the manifest this assertion leaves beside it lets
    ``python -m pytest_sprite judge`` judge it again. A ``ResumeRun`` read back with
    :func:`~pytest_sprite.recipes.artifacts.load_resume_run` names its file the same way.

    Raises :class:`ResumeError` with the resume check's tables when a required check fails; returns the
    :class:`ResumeResult` otherwise.
    """
    if isinstance(recipe, ResumeRun):
        run = recipe
    else:
        roles = getattr(recipe, "resume_roles", None)
        if not callable(roles):
            raise SpriteUsageError(
                f"assert_resume_bitexact needs the lora_qwen fixture (or a recipe with a resume_roles(...) "
                f"method, or a ResumeRun to judge again), got {type(recipe).__name__}"
            )
        run = roles(
            strategy=strategy,
            precision=precision,
            reshard=reshard,
            export=export,
            fault=fault,
            directory=directory,
        )
    result = record_assertion(judge_resume(run), inputs=[run.source])
    if not result.passed:
        raise ResumeError(result.report(), failed=result.failed, result=result)
    return result
