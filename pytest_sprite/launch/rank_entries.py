"""Each rank's entry in the reports: its outcome, duration, host, device and captured output.

pytest keeps what a test printed or logged as report sections (``Captured stdout call`` and so on); the
merged report shows them per rank (``Captured stdout call [rank 1]``) in the terminal, JUnit and
pytest-html. The JSON report carries them as data, one entry per rank, so the output of every rank
survives in CI, not only rank 0's. Each text is bounded: a runaway print loop on 96 ranks must not make
a report nobody can open; the cut keeps the start and the end and says where it cut and how much.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from pytest import TestReport

from ..glue.recorded_results import DEVICE_ATTR
from .rank_end import RankEnd, held_until_end, signal_name

__all__ = ["OUTPUT_LIMIT", "STREAMS", "bounded", "phase_output", "rank_outcomes"]

OUTPUT_LIMIT: Final = 64 * 1024
"""Characters kept of one stream of one phase of one rank (the first quarter and the last three)."""

STREAMS: Final = {"Captured stdout": "stdout", "Captured stderr": "stderr", "Captured log": "log"}
"""pytest's section prefixes and the stream each names in the report."""


def bounded(text: str, limit: int = OUTPUT_LIMIT) -> str:
    """``text`` whole when it fits in ``limit`` characters, else its start and end around a line naming the cut."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    cut = len(text) - head - tail
    return (
        f"{text[:head]}\n[pytest-sprite: {cut} characters cut here; the first {head} and the last {tail} "
        f"of {len(text)} are kept]\n{text[-tail:]}"
    )


def phase_output(reports: Sequence[TestReport]) -> dict[str, dict[str, str]]:
    """Phase -> stream -> the text one rank's reports captured (streams with nothing captured are left out).

    A report repeats the sections of the phases before it (``Captured stdout call`` is on the teardown
    report too): each section is taken once, by its name, which says its phase.
    """
    sections: dict[str, str] = {}
    for report in reports:
        sections.update((name, content) for name, content in report.sections if content)
    out: dict[str, dict[str, str]] = {}
    for name, content in sections.items():
        prefix, _, phase = name.rpartition(" ")
        stream = STREAMS.get(prefix)
        if stream is not None:
            out.setdefault(phase, {})[stream] = bounded(content)
    return out


_ENDED_BY_OUTCOME = {
    "timeout": "timeout",
    "peer_failed": "ended",
    "agent_lost": "lost",
    "agent_error": "lost",
}


def rank_outcomes(
    *,
    per_rank: dict[int, list[TestReport]],
    ends: dict[int, RankEnd],
    world_size: int,
    hosts: dict[int, str],
    started_at: float | None = None,
) -> list[dict[str, Any]]:
    """One entry per rank: outcome, exit code or signal, duration, host, device, and what it printed.

    The outcome is the rank's own: ``failed`` / ``skipped`` / ``passed`` from its reports when its child
    ran to its end; ``interrupted`` (it called ``pytest.exit`` or got KeyboardInterrupt), ``crashed`` (it
    died by a signal or exited early), ``timeout``, ``ended`` (ended after a peer failed) or ``lost`` (its
    agent was lost or could not run it) otherwise. The duration is the
    wall time the rank was held, the phase it never finished included (until its end was known).
    ``output`` is each phase's captured stdout, stderr and log; ``last_output``, for a rank that did not
    end cleanly, the last lines its process wrote; ``stacks``, for a rank whose stacks were taken (or
    asked for and missing), its threads of frames as records, the same the terminal shows as text.
    """
    out = []
    for rank in range(world_size):
        reports = per_rank.get(rank, [])
        end = ends.get(rank, RankEnd(rank=rank, ended_by="agent_lost", detail="no exit status received"))
        finished = bool(reports) and reports[-1].when == "teardown"
        if end.ended_by is not None:
            outcome = _ENDED_BY_OUTCOME[end.ended_by]
        elif end.interrupted:
            outcome = "interrupted"
        elif not finished or end.signal is not None:
            outcome = "crashed"
        elif any(r.failed for r in reports):
            outcome = "failed"
        elif any(r.skipped for r in reports):
            outcome = "skipped"
        else:
            outcome = "passed"
        device = next((getattr(r, DEVICE_ATTR) for r in reports if getattr(r, DEVICE_ATTR, None)), None)
        duration: float | None = sum(r.duration for r in reports) if reports else None
        if not finished and (reports or started_at):
            start, stop = held_until_end(reports, end, started_at)
            duration = (duration or 0.0) + (stop - start)
        entry: dict[str, Any] = {
            "rank": rank,
            "outcome": outcome,
            "exit_code": end.exitcode,
            "signal": end.signal,
            "signal_name": signal_name(end.signal) if end.signal is not None else None,
            "ended_by": end.ended_by,
            "duration": duration,
            "host": hosts.get(rank),
            "device": device,
            "output": phase_output(reports),
        }
        if not end.clean and end.output_tail.strip():
            entry["last_output"] = bounded(end.output_tail)
        if end.stacks.present:
            entry["stacks"] = end.stacks.to_dict()
        out.append(entry)
    return out
