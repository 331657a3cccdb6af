"""Helpers shared by the project's own tests: one way to run a pytester session, one fnmatch escape, one way to
look like a process no launcher started."""

from __future__ import annotations

from collections.abc import Sequence

import pytest


def fnescape(text: str) -> str:
    """``text`` as a literal fnmatch pattern (pytester's fnmatch_lines treats [] * ? as wildcards)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)


def run_pytest(
    pytester: pytest.Pytester, *args: str, timeout: float, flags: Sequence[str] = ()
) -> pytest.RunResult:
    """A pytest session in a subprocess of the pytester folder (a ranks session needs its own process).

    The cache provider stays off: it would write ``.pytest_cache`` into the folder the assertions read.
    ``flags`` come before ``args`` (a file's usual ``-v``), so a test's own arguments win.
    """
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *flags, *args, timeout=timeout)


def clear_rank_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every launcher's rank variables (and a job's Slurm and PBS ones): a process no launcher started."""
    from pytest_sprite.env.rank_variables import LAUNCHER_VARIABLES

    for names in LAUNCHER_VARIABLES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "PBS_NODEFILE", "PBS_JOBID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
