"""What each event of a running ranks test does to its run, and how the harness ends its ranks.

The controller's event loop routes every event an agent sends about a test's rank to the ``on_<event>``
handler here (the frames are :mod:`pytest_sprite.plumbing.protocol`'s); the loop's deadline check ends a
test's live ranks when its timeout or the grace after a failed rank runs out: every agent first takes
its child's stacks, and only once all have (or an agent does not answer in time) are they killed.
"""

from __future__ import annotations

from typing import Final

import pytest

from ..errors import LeftoverProcessWarning
from ..glue.collected import store_collected
from ..glue.options import Settings
from ..glue.recorded_results import progress_line, write_progress
from ..plumbing.protocol import (
    AgentError,
    AgentLost,
    ChildExited,
    Collected,
    CollectivesCalled,
    EndedBy,
    Interrupted,
    Output,
    Progress,
    Report,
    StacksTaken,
    Warning_,
)
from ..plumbing.ranges import fold_ranks
from ..plumbing.stacks import STACK_WAIT
from ..plumbing.timing import monotonic
from .item_runs import _Run
from .pool import AgentPool
from .rank_end import RankEnd

__all__ = ["RunEvents"]

_STACKS_LIMIT: Final = STACK_WAIT + 5.0
"""Seconds the kill of an abort waits for every agent's ``stacks_taken``: one that never answers holds no one."""
_ABORT_LIMIT: Final = STACK_WAIT + 20.0
"""Seconds an agent has to end its child after an abort: the wait for its stacks, then the kill and the leftovers."""


class RunEvents:
    """The handlers of a running test's events, and its deadlines (one per controller)."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings

    def on_report(self, pool: AgentPool, run: _Run, rank: int, payload: Report) -> None:
        """Emitted by a child for each phase (setup, call, teardown) as soon as it is made."""
        report = self.config.hook.pytest_report_from_serializable(config=self.config, data=payload["report"])
        run.reports.setdefault(rank, []).append(report)
        if report.failed:
            run.note_failure(rank)

    def on_collectives_called(
        self, pool: AgentPool, run: _Run, rank: int, payload: CollectivesCalled
    ) -> None:
        """Emitted by a child under ``--sprite-mutate`` at the end of its test: the ops its collectives called."""
        run.called[rank] = list(payload["ops"])

    def on_collected(self, pool: AgentPool, run: _Run, rank: int, payload: Collected) -> None:
        """Emitted by a child's ``world.collect(name, tensor)`` (a mutant run's tensors are not the test's)."""
        if run.mutant is not None:
            return
        store_collected(run.item, payload["name"], rank, payload["tensor"])

    def on_output(self, pool: AgentPool, run: _Run, rank: int, payload: Output) -> None:
        """Emitted by a child under ``-s``: show what the rank printed, each line marked with its test and rank."""
        if run.mutant is not None:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        reporter.ensure_newline()
        for line in payload["text"].rstrip("\n").splitlines():
            reporter.write_line(f"[{run.item.nodeid} rank {rank}] {line}")

    def on_warning(self, pool: AgentPool, run: _Run, rank: int, payload: Warning_) -> None:
        """Emitted by a child for each warning its test raised; logged folded over ranks with the test."""
        if run.mutant is not None:
            return
        key = (payload["category"], payload["message"], payload["filename"], int(payload["lineno"]))
        run.warnings.setdefault(key, []).append(rank)

    def on_progress(self, pool: AgentPool, run: _Run, rank: int, payload: Progress) -> None:
        """Emitted by rank 0's child through ``pytest_sprite.progress``: show it now."""
        if run.mutant is not None:
            return
        write_progress(self.config, progress_line(run.item.nodeid, payload["message"]))

    def on_interrupted(self, pool: AgentPool, run: _Run, rank: int, payload: Interrupted) -> None:
        """Emitted by a child that got KeyboardInterrupt or called ``pytest.exit``: the session ends after
        this test, so its other ranks are told to stop now rather than waited out (``--rank-grace``)."""
        if run.interrupted is None:  # the first rank's words and code are the session's
            run.interrupted = payload["message"]
            run.exit_code = payload.get("returncode")
        run.interrupted_by[rank] = payload.get("reason", "ended the session")
        run.note_failure(rank)
        self.abort(
            pool, run, "peer_failed", "because the session stops", sparing=rank
        )  # the roll call says why

    def on_agent_error(self, pool: AgentPool, run: _Run, rank: int, payload: AgentError) -> None:
        """Emitted by an agent that could not start the child (e.g. it did not collect the test)."""
        run.ends[rank] = RankEnd(rank=rank, ended_by="agent_error", detail=payload["message"])
        run.note_failure(rank)

    def on_child_exited(self, pool: AgentPool, run: _Run, rank: int, payload: ChildExited) -> None:
        """Emitted by an agent when the child ended, on its own or by ``abort``."""
        run.ends[rank] = RankEnd.of_exit(rank, payload, interrupted=run.interrupted_by.get(rank, ""))
        run.exited[rank] = monotonic()
        if rank in run.taking_stacks:  # it ended before its agent answered: nothing to wait for
            run.taking_stacks.discard(rank)
            self._kill_when_stacks_taken(pool, run)
        if payload.get("leftovers"):
            key = (LeftoverProcessWarning.__name__, payload["leftovers"], str(run.item.path), 0)
            run.warnings.setdefault(key, []).append(rank)
        reported = run.reports.get(rank, [])
        if not (reported and reported[-1].when == "teardown"):
            run.note_failure(rank)

    def on_agent_lost(self, pool: AgentPool, run: _Run, rank: int, payload: AgentLost) -> None:
        """Posted by a reader thread when an agent's connection closed, broke or could not be read.

        Only that rank ends here; the others finish or are ended after the grace period like peers of
        any failed rank, so their own tracebacks and stacks still reach the report. No test starts on
        the pool any more; once the tests in flight have finished it is replaced.
        """
        if rank in run.live:
            agent = run.agents[rank]
            ended = pool.how_agent_ended(agent)
            run.ends[rank] = RankEnd(
                rank=rank,
                ended_by="agent_lost",
                detail=(
                    f"the connection to rank agent {agent} {payload['detail']}"
                    f"{f': the agent {ended}' if ended else ''}; it ran on {run.hosts.get(rank, '?')}"
                ),
                output_tail=pool.output_tail(),
            )
            run.note_failure(rank)

    def check_deadlines(self, pool: AgentPool, run: _Run) -> None:
        now = monotonic()
        if now - run.started - run.held > run.timeout:
            self.abort(
                pool, run, "timeout", f"after the {run.timeout:g}s timeout (from {run.timeout_source})"
            )
        elif run.first_failure is not None and now - run.first_failure > self.settings.grace:
            self.abort(
                pool,
                run,
                "peer_failed",
                f"{self.settings.grace:g}s after {fold_ranks(run.failed)} failed (--rank-grace)",
            )
        if run.taking_stacks and now - min(run.aborted.values()) > _STACKS_LIMIT:
            self._kill_when_stacks_taken(pool, run, now=True)  # an agent that does not answer holds no one
        for rank, when in list(run.aborted.items()):
            if rank in run.live and now - when > _ABORT_LIMIT:
                pool.broken = (
                    f"rank agent {run.agents[rank]} on {run.hosts.get(rank, '?')} did not end its child within "
                    f"{_ABORT_LIMIT:g}s of an abort"
                )
                run.ends[rank] = RankEnd(rank=rank, ended_by="agent_lost", detail=pool.broken)

    def abort(
        self, pool: AgentPool, run: _Run, reason: EndedBy, detail: str, *, sparing: int | None = None
    ) -> None:
        """Phase one of ending the live ranks (but ``sparing``, which is ending by itself): every agent takes
        its child's stacks (see ``Abort``)."""
        for rank in run.live:
            if rank not in run.aborted and rank != sparing:
                run.aborted[rank] = monotonic()
                run.abort_reason = (reason, detail)
                run.taking_stacks.add(rank)
                pool.send(
                    run.agents[rank],
                    "abort",
                    {"run_id": run.run_id, "reason": reason, "detail": detail, "kill": False},
                )

    def on_stacks_taken(self, pool: AgentPool, run: _Run, rank: int, payload: StacksTaken) -> None:
        """Phase two once every aborted rank's stacks are taken: kill them all."""
        run.taking_stacks.discard(rank)
        self._kill_when_stacks_taken(pool, run)

    def _kill_when_stacks_taken(self, pool: AgentPool, run: _Run, *, now: bool = False) -> None:
        if (run.taking_stacks and not now) or run.abort_reason is None:
            return
        reason, detail = run.abort_reason
        for rank in run.aborted:
            if rank not in run.killed:
                run.killed.add(rank)
                pool.send(
                    run.agents[rank],
                    "abort",
                    {"run_id": run.run_id, "reason": reason, "detail": detail, "kill": True},
                )
