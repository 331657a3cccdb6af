"""Checkpoint resume, bit for bit: the lightning-sprite procedure's "Checkpoints" rule as an assertion.

Required, bit for bit, on every rank: the state a resume restores equals the state captured inside the save
(trainable tensors, AdamW state and its devices, param groups, LR scheduler, digests of every frozen tensor,
the loop position); the first resumed step's loss equals the killed fit's loss for that step; the LR of every
step matches the uninterrupted fit; the same rows are trained at every step. The reload of the checkpoint
the resume wrote, the resume at half the world (FSDP2) and the resume on one device (DDP, full-state FSDP2)
must restore exactly too, and train the same LRs and rows.

Reported, never required: continuation gaps against the uninterrupted fit (loss and pre-clip norm over the
resumed steps, each trainable's final update, Adam's moments; DDP rebuilds its buckets on a process's second
iteration, so a correct resume reduces in another order), whether the twin fit reproduced the fit at all,
and whether the resumed run's RNG streams match (Lightning does not checkpoint RNG state).

The comparison is pure: it reads a :class:`~pytest_sprite.records.ResumeRun` and imports torch only to
compare tensors. :func:`assert_resume_bitexact` runs the roles (in sub-worlds; the recipe stores the run as
``resume-run.pt``, under ``--sprite-artifacts`` or beside the checkpoints), judges them, and leaves a
manifest beside the stored run, so ``python -m pytest_sprite judge DIR`` judges it again offline.

One module per concern: ``results`` (checks, figures, tables), ``checks`` (the comparisons) and ``judge``
(judging a run, and the assertion).
"""

from __future__ import annotations

from pytest_sprite.assertions.resume.checks import restore_problems as _restore_problems
from pytest_sprite.assertions.resume.judging import assert_resume_bitexact, judge_resume
from pytest_sprite.assertions.resume.results import (
    RESTORE_CHECKS,
    RESUME_CHECKS,
    RESUME_GAPS,
    RESUME_HEADERS,
    RESUME_KIND,
    ResumeArm,
    ResumeError,
    ResumeGaps,
    ResumeResult,
    resume_rows,
)

__all__ = [
    "RESTORE_CHECKS",
    "RESUME_CHECKS",
    "ResumeArm",
    "ResumeError",
    "ResumeGaps",
    "ResumeResult",
    "assert_resume_bitexact",
    "judge_resume",
]
# Also importable from here: the terminal's table (RESUME_GAPS, RESUME_HEADERS, RESUME_KIND, resume_rows) and
# _restore_problems, which tests call directly.
_EXTRA = (RESUME_GAPS, RESUME_HEADERS, RESUME_KIND, resume_rows, _restore_problems)
