"""Coverage from every rank: the lines a test child, a sub-world rank or a launched agent runs count in the session.

A session measured by pytest-cov (``--cov``) or by ``coverage run`` needs no option of ours. coverage's tracer
survives a fork, so a forked process (rank agent, test child, zygote, sub-world rank) goes on measuring into
the Coverage it inherited, which names a data file of its own after a fork when it writes one file per
process (pytest-cov always does; ``coverage run`` with ``parallel = True``). What coverage cannot do by itself:

- a rank ends with ``os._exit`` (see ``rank/child.py``), which skips coverage's save at exit: ranks save here,
  before they say they are done, so the data is on disk before the controller counts the test finished;
- a forked process also writes what its Coverage held unsaved at the fork: a rank agent writes that once,
  before it forks ranks, so each rank's file holds only the lines it ran;
- a session measured into one data file (``coverage run`` without ``parallel``) must not have every rank
  writing that file: each rank measures into its own file in a folder beside it, and the controller
  combines that folder into its own data at the end of the session;
- a launched agent is a new interpreter: under pytest-cov it measures through its own pytest-cov (the same
  ``--cov`` arguments), told ``--cov-append`` so that it never erases what ranks already saved; under
  ``coverage run`` it starts measuring from ``COVERAGE_PROCESS_CONFIG`` (coverage's own subprocess hook).

Each rank labels the dynamic contexts switched to in it with its rank (``tests/x.py::test_a|run|rank1``
under ``--cov-context=test``; a sub-world rank adds ``|subworld-rank0``). Nothing here imports coverage: a
process that coverage does not measure has not loaded it, and every function returns at once.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import warnings
from typing import Any

__all__ = [
    "agent_launch",
    "agent_started",
    "combine_rank_data",
    "current_context",
    "rank_started",
    "save_rank_data",
    "session_started",
]

RANK_DIR_PREFIX = ".sprite-coverage-"
"""The folder, beside the session's data file, where ranks of a one-file session write theirs."""

_rank_dir: str | None = None
"""Set in the controller of a one-file session (and inherited by every fork): where its ranks write."""
_rank_coverage: Any = None
"""The Coverage this rank measures with, once :func:`rank_started` found one."""
_context: str | None = None
"""The (labelled) dynamic context this rank last switched to; None until one is switched to."""


def _measuring() -> Any:
    """The Coverage measuring this process, None when there is none; never imports coverage."""
    module = sys.modules.get("coverage")
    if module is None:
        return None
    return module.Coverage.current()


def _one_file(cov: Any) -> bool:
    """True when ``cov`` writes one data file for every process (``coverage run`` without ``parallel``)."""
    return not cov.config.parallel


def session_started() -> None:
    """In the controller, before any agent or rank is forked: where a one-file session's ranks write."""
    global _rank_dir
    cov = _measuring()
    if cov is None or not _one_file(cov):
        return
    folder = os.path.dirname(os.path.abspath(cov.config.data_file))
    _rank_dir = os.path.join(folder, f"{RANK_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")


def agent_launch(options: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """The arguments and environment that make launched agents measure as the controller does.

    ``options``: the controller's parsed pytest options (``config.option``). Under pytest-cov the agents get
    the same ``--cov`` arguments, so their pytest-cov measures them; ``--cov-append`` keeps it from erasing
    the data files ranks saved before a slow agent started. Under ``coverage run`` alone, the controller's
    configuration goes in ``COVERAGE_PROCESS_CONFIG``, which coverage reads as a new interpreter starts.
    """
    if getattr(options, "cov_source", None) and not getattr(options, "no_cov", False):
        return ("--cov-append",), {}
    cov = _measuring()
    if cov is None:
        return (), {}
    from .dependency_internals import coverage_config_data

    data_file = os.path.abspath(cov.config.data_file)
    if _rank_dir is not None:
        data_file = os.path.join(_rank_dir, os.path.basename(data_file))
    data = coverage_config_data(cov, data_file=data_file)
    if data is None:
        _say("this coverage cannot hand its configuration to launched agents (7.10.4 or newer can)")
        return (), {}
    return (), {"COVERAGE_PROCESS_CONFIG": data}


def agent_started() -> None:
    """In a rank agent, before it forks any rank: write once what it measured or inherited so far.

    A forked process writes what its Coverage held unsaved at the fork as well as its own lines: without
    this, every rank would write again the lines the agent's collection ran (or the controller's, for a
    forked agent), a cost on every test that grows with the code measured. Not in a one-file session, whose
    ranks measure afresh (:func:`rank_started`).
    """
    cov = _measuring()
    if cov is None or _one_file(cov):
        return
    _save(cov)


def rank_started(label: str, *, context: str | None = None) -> None:
    """In a forked rank (test child, sub-world rank), before it runs user code: measure it on its own.

    ``label`` names the rank in the contexts switched to here (``rank1``); ``context``: the context of the
    process that started this one (a sub-world's test), switched to here at once so this rank's lines are
    counted under it.
    """
    global _rank_coverage
    cov = _measuring()
    if cov is None:
        return
    if _one_file(cov):
        cov = _own_file(cov)
        if cov is None:
            return
    _rank_coverage = cov
    _label_contexts(cov, label)
    if context:
        cov.switch_context(context)


def _own_file(inherited: Any) -> Any:
    """A one-file session's rank: stop the Coverage it inherited and measure the same way into a file of its own."""
    from .dependency_internals import coverage_config_data, coverage_from_config_data

    if _rank_dir is None:
        return None
    data = coverage_config_data(
        inherited, data_file=os.path.join(_rank_dir, os.path.basename(inherited.config.data_file))
    )
    inherited.stop()
    if data is None:
        _say("this coverage cannot measure a rank of a one-file session: set parallel = True or use 7.10.4+")
        return None
    cov = coverage_from_config_data(data)
    cov.start()
    return cov


def _label_contexts(cov: Any, label: str) -> None:
    """Every dynamic context switched to in this rank (pytest-cov's ``--cov-context=test``) names the rank."""
    switch = cov.switch_context

    def switch_in_rank(new_context: str) -> Any:
        global _context
        _context = f"{new_context}|{label}" if new_context else label
        return switch(_context)

    cov.switch_context = switch_in_rank


def current_context() -> str | None:
    """The context this rank measures under, for a sub-world it starts; None when no context was switched to."""
    return _context


def save_rank_data() -> None:
    """Write what this rank measured, now: it ends with ``os._exit``, which skips coverage's save at exit.

    Called before the rank says it is done, so the file is written before the session can end. A failure
    to save is printed to the rank's output and never fails its test. coverage's warnings about what one
    rank did not run ("No data was collected") are left to the session's report, which sees every rank.
    """
    if _rank_coverage is not None:
        _save(_rank_coverage)


def _save(cov: Any) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cov.save()
    except Exception as exc:  # coverage's own errors: the test's outcome is not coverage's to change
        _say(f"the coverage data of process {os.getpid()} could not be saved ({type(exc).__name__}: {exc})")


def combine_rank_data() -> None:
    """In the controller of a one-file session, at its end: add its ranks' data files to its own data."""
    if _rank_dir is None or not os.path.isdir(_rank_dir):
        return
    try:
        cov = _measuring()
        if cov is not None:
            cov.combine(data_paths=[_rank_dir], keep=False)
    finally:
        shutil.rmtree(_rank_dir, ignore_errors=True)


def _say(message: str) -> None:
    print(f"pytest-sprite coverage: {message}", file=sys.stderr, flush=True)
