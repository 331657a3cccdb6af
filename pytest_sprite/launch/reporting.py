"""The controller's reporting: one finished ranks test logged as pytest logs a test it ran.

Split from :mod:`pytest_sprite.launch.controller`: the merged reports of every phase, the ranks' warnings
folded over ranks into pytest's warnings summary, and the test's shared tmp_path pruned by its outcome. A
test that carried others (``AroundRanks.carried``: torch's class worlds) is followed by each of them, logged
as its own test.
"""

from __future__ import annotations

import warnings

import pytest

from ..errors import LeftoverProcessWarning
from ..glue.around import CarriedTest, around_ranks_key
from ..glue.recorded_results import keep_reported
from ..glue.tmp_path import prune_test_dir
from ..plumbing.ranges import fold_ranks
from .item_runs import _Run
from .merge import merge_rank_reports
from .rank_end import RankEnd

__all__ = ["log_run", "log_warnings", "merge_run"]


def _warning_category(name: str) -> type[Warning]:
    """The warning class a child named: a builtin, pytest-sprite's own, or ``module.QualName`` of a module
    this process has loaded too (pytest's ``PytestReturnNotNoneWarning``, a project's own); else UserWarning."""
    import builtins
    import sys

    if name == LeftoverProcessWarning.__name__:
        return LeftoverProcessWarning
    module, _, qualname = name.rpartition(".")
    found: object = getattr(builtins, name, None)
    if module and module in sys.modules:  # never imports: a module only the rank loaded stays UserWarning
        found = sys.modules[module]
        for part in qualname.split("."):
            found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning


def log_run(config: pytest.Config, run: _Run) -> None:
    """Log ``run``'s merged reports under its own id, as pytest logs a test it ran."""
    item, ihook = run.item, run.item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = merge_run(run)
    for report in reports:
        keep_reported(item, report)
        ihook.pytest_runtest_logreport(report=report)
    log_warnings(config, run)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    for carried in _carried(run):
        if item.session.shouldfail or item.session.shouldstop:
            break  # -x / --maxfail: nothing is logged after the failure that stopped the session
        _log_carried(run, carried)
    if run.test_dir is not None:
        call = [r for r in reports if r.when == "call"]
        prune_test_dir(config, run.test_dir, passed=call[0].passed if call else True)


def log_warnings(config: pytest.Config, run: _Run) -> None:
    """Hand the ranks' warnings to pytest's warnings summary, one per warning, naming its ranks."""
    for (category, message, filename, lineno), ranks in run.warnings.items():
        label = fold_ranks(ranks) if len(ranks) < run.n else f"all {run.n} ranks" if run.n > 1 else "rank 0"
        text = message if message.startswith(("rank ", "ranks ")) else f"[{label}] {message}"
        record = warnings.WarningMessage(
            _warning_category(category)(text), _warning_category(category), filename, lineno
        )
        config.hook.pytest_warning_recorded.call_historic(
            kwargs={
                "warning_message": record,
                "when": "runtest",
                "nodeid": run.item.nodeid,
                "location": None,
            }
        )


def _carried(run: _Run) -> list[CarriedTest]:
    around = run.item.stash.get(around_ranks_key, None)
    return list(around.carried()) if around is not None else []


def _ends(run: _Run, per_rank: dict[int, list[pytest.TestReport]]) -> dict[int, RankEnd]:
    """How each rank ended one test of a run that carried others: a rank whose reports of it end with its
    teardown finished it (its child went on to the next); any other rank's end is its child's."""
    ends = {}
    for rank in range(run.n):
        reports = per_rank.get(rank)
        if reports and reports[-1].when == "teardown":
            ends[rank] = RankEnd(rank=rank, exitcode=0)
        elif rank in run.ends:
            ends[rank] = run.ends[rank]
    return ends


def _merged(
    run: _Run, item: pytest.Item, per_rank: dict[int, list[pytest.TestReport]], ends: dict[int, RankEnd]
) -> list[pytest.TestReport]:
    """``item``'s reports from ``run``'s ranks merged into one per phase."""
    return merge_rank_reports(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        per_rank=per_rank,
        ends=ends,
        world_size=run.n,
        failure_order=run.failed,
        hosts=run.hosts,
        stacks_took=run.stacks_took,
        woken=run.woken,
        started_at=run.started_at or None,
    )


def _log_carried(run: _Run, carried: CarriedTest) -> None:
    """Log one test ``run`` carried, merged over its ranks, as its own test."""
    item, ihook = carried.item, carried.item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in _merged(run, item, carried.reports, _ends(run, carried.reports)):
        keep_reported(item, report)
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def merge_run(run: _Run) -> list[pytest.TestReport]:
    """``run``'s per-rank reports merged into one per phase."""
    return _merged(run, run.item, run.reports, _ends(run, run.reports) if _carried(run) else run.ends)
