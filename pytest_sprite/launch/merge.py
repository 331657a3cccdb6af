"""Pure merging of N per-rank results into the one result pytest reports.

A phase fails if any rank failed it; it is skipped only if every rank that reached it skipped it.
Failures are shown per rank, identical ones folded ("ranks 0-3"). A rank that died or was ended
gets a synthesized failed report for the phase it was in. Unit-tested without processes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from pytest import TestReport

from ..glue.pytest_internals import ReprFileLocation, TerminalRepr, TerminalWriter
from ..glue.ranked_report import ranked_report
from ..glue.recorded_results import RANKS_ATTR, REPORT_ATTR
from ..plumbing.collectives import TRANSPORT_ERROR
from ..plumbing.protocol import EndedBy
from ..plumbing.ranges import fold_ranks
from .rank_end import PHASES, RankEnd, describe_end, held_until_end, phase_in_progress
from .rank_entries import rank_outcomes
from .rollcall import (
    Place,
    cause_sentence,
    failure_text,
    is_transport_failure,
    odd_ones,
    rank_places,
    roll_call,
    stacks_sections,
)

__all__ = ["RankFailures", "merge_rank_reports"]

_Report = TypeVar("_Report", bound=TestReport)


@dataclass(eq=False)
class RankFailures(TerminalRepr):
    """Failures of several ranks, each group under a ``rank N`` / ``ranks 0-3`` header."""

    groups: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)
    location: tuple[str, int] = ("", 0)

    def toterminal(self, tw: TerminalWriter) -> None:
        for ranks, longrepr in self.groups:
            tw.sep("-", fold_ranks(ranks), bold=True, red=True)
            if hasattr(longrepr, "toterminal"):
                longrepr.toterminal(tw)
            else:
                tw.line(str(longrepr))

    @property
    def reprcrash(self) -> ReprFileLocation:
        """Short-summary line: the first group's crash message, prefixed with its ranks."""
        ranks, longrepr = self.groups[0]
        crash = getattr(longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(longrepr).strip().splitlines()[0]
        path = crash.path if crash is not None else self.location[0]
        lineno = crash.lineno if crash is not None else self.location[1]
        more = f" (+{len(self.groups) - 1} more)" if len(self.groups) > 1 else ""
        return ReprFileLocation(path=path, lineno=lineno, message=f"[{fold_ranks(ranks)}] {message}{more}")


def _cause_rank(end: RankEnd | None) -> int:
    """Sort key: a rank that crashed by itself is most likely the cause, one the harness ended the least."""
    if end is None:
        return 1
    if end.ended_by is None and not end.clean:
        return 0
    if end.ended_by in ("peer_failed", "agent_lost"):
        return 2
    return 1


def _failure_key(longrepr: Any) -> Any:
    """What makes two ranks' failures "identical": the same exception message raised at the same place.

    Whole tracebacks differ between ranks (argument values such as ``world`` show the rank), so
    they are not compared.
    """
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return (crash.path, crash.lineno, crash.message)
    return str(longrepr)


class _Test(NamedTuple):
    """What every report of the test, merged or made up here, names it by (``TestReport``'s first arguments),
    handed down as one."""

    nodeid: str
    location: tuple[str, int | None, str]
    keywords: dict[str, Any]

    def phase_report(
        self, make: Callable[..., _Report], phase: str, outcome: str, longrepr: Any, **more: Any
    ) -> _Report:
        """A report of the test's ``phase``: the made-up ones (``TestReport``) and the merged ones
        (``ranked_report``) are made the same way."""
        return make(**self._asdict(), outcome=outcome, longrepr=longrepr, when=phase, **more)


def _synthesize(
    template: TestReport | None,
    test: _Test,
    phase: str,
    text: str,
    *,
    timing: tuple[float, float] | None = None,
) -> TestReport:
    """A failed report of ``phase`` saying ``text``; it lasted ``timing`` (start, stop), else as ``template``."""
    if timing is None:
        timing = (template.start, template.stop) if template is not None else (0.0, 0.0)
    start, stop = timing
    held = {"duration": max(0.0, stop - start), "start": start, "stop": stop}
    user_properties = _pairs(template.user_properties) if template else []
    return test.phase_report(
        TestReport, phase, "failed", text, sections=[], user_properties=user_properties, **held
    )


def merge_rank_reports(
    *,
    nodeid: str,
    location: tuple[str, int | None, str],
    keywords: dict[str, Any],
    per_rank: dict[int, list[TestReport]],
    ends: dict[int, RankEnd],
    world_size: int,
    failure_order: Sequence[int] = (),
    hosts: dict[int, str] | None = None,
    stacks_took: float | None = None,
    woken: Collection[int] = (),
    started_at: float | None = None,
) -> list[TestReport]:
    """One report per phase that any rank reached, merged over ranks.

    ``per_rank[r]`` are the reports rank r sent, in order; ``ends[r]`` how its child ended.
    ``failure_order`` lists ranks in the order they failed: the first failure is shown first,
    since it is usually the cause and the others its consequence. A rank that left the test while
    its peers waited in a collective is shown first as the cause, their transport errors as its
    consequences; ranks the harness ended are shown as one roll call, which says how long
    taking their stacks took (``stacks_took``, seconds). The last merged report carries every rank's
    outcome (``sprite_ranks``, see :func:`rank_outcomes`); ``hosts`` names each rank's host. ``started_at``
    (wall clock) is when the test's ranks started: a rank that ended before its first report held its setup
    from then until its end.
    """
    outcomes = rank_outcomes(
        per_rank=per_rank, ends=ends, world_size=world_size, hosts=hosts or {}, started_at=started_at
    )
    test = _Test(nodeid, location, keywords)
    by_phase, synthesized = _reports_by_phase(per_rank, ends, world_size, test, started_at)
    places = rank_places(per_rank=per_rank, ends=ends, world_size=world_size, woken=woken)
    causes = _blame_lost_peers(by_phase, places, test)
    _roll_call(_RollCallRanks(by_phase, synthesized, ends, places, woken), stacks_took, test)
    _no_call_after_a_failed_setup(by_phase)
    merged = []
    for phase in PHASES:
        if by_phase[phase]:
            merged.append(
                _merge_phase(
                    phase,
                    by_phase[phase],
                    test,
                    world_size,
                    failure_order,
                    ends,
                    causes,
                )
            )
    if merged:
        setattr(merged[-1], RANKS_ATTR, outcomes)
    return merged


def _no_call_after_a_failed_setup(by_phase: dict[str, dict[int, TestReport]]) -> None:
    """pytest runs the call only after a passed setup: when any rank's setup did not pass, the test has no
    call phase; ranks that failed their call anyway join the setup failure."""
    setup = by_phase["setup"]
    if any(not rep.passed for rep in setup.values()):
        for rank, rep in by_phase["call"].items():
            if rep.failed:
                setup[rank] = rep
        by_phase["call"] = {}


def _reports_by_phase(
    per_rank: dict[int, list[TestReport]],
    ends: dict[int, RankEnd],
    world_size: int,
    test: _Test,
    started_at: float | None,
) -> tuple[dict[str, dict[int, TestReport]], dict[int, str]]:
    """Each phase's report of each rank, one synthesized where a rank ended without finishing.

    Also returns rank -> the phase it was in when it ended without finishing, where it got that report.
    """
    by_phase: dict[str, dict[int, TestReport]] = {p: {} for p in PHASES}
    synthesized: dict[int, str] = {}
    for rank in range(world_size):
        reports = list(per_rank.get(rank, []))
        for rep in reports:
            by_phase[rep.when][rank] = rep
        end = ends.get(rank, RankEnd(rank=rank, ended_by="agent_lost", detail="no exit status received"))
        if not (reports and reports[-1].when == "teardown"):
            running = phase_in_progress(reports)
            synthesized[rank] = running
            by_phase[running][rank] = _synthesize(
                reports[0] if reports else None,
                test,
                running,
                describe_end(end, running),
                timing=held_until_end(reports, end, started_at),
            )
    return by_phase, synthesized


def _blame_lost_peers(
    by_phase: dict[str, dict[int, TestReport]],
    places: dict[int, Place],
    test: _Test,
) -> list[int]:
    """Name the rank that left the test while its peers waited in a collective; return the causes.

    A rank whose error is a broken transport (``Connection closed by peer`` in a collective, a store
    that reset) after a peer crashed, exited, or returned from the test without the
    collective the others were in lost its peer: its report says which rank, and keeps its
    own error as one line of evidence. The ranks that lost the same peer in one phase share one text,
    so they fold (``ranks 0, 2-3 lost their peer: ...``). A cause whose own test passed gets a failed
    report that says what it did, so the summary names it, not a peer that did the right thing.
    """
    found = cause_sentence(places)
    if found is None:
        return []
    causes, sentence = found
    for phase, reps in by_phase.items():
        lost = sorted(r for r, rep in reps.items() if r not in causes and is_transport_failure(rep))
        if not lost:
            continue
        evidence = next(
            line for line in failure_text(reps[lost[0]].longrepr).splitlines() if TRANSPORT_ERROR.search(line)
        )
        one = len(lost) == 1
        text = (
            f"{fold_ranks(lost)} lost {'its' if one else 'their'} peer: {sentence}; "
            f"{'its own error' if one else 'their own errors'} during {phase} "
            f"{'is a consequence' if one else 'are consequences'}:\n"
            f"    {'' if one else f'(rank {lost[0]}) '}{evidence.strip()[:300]}"
        )
        for rank in lost:
            reps[rank] = _synthesize(reps[rank], test, phase, text)
    for rank in causes:
        call = by_phase["call"].get(rank)
        if call is not None and call.passed:
            text = f"{sentence}: {fold_ranks([rank])} left a collective its peers were in"
            by_phase["call"][rank] = _synthesize(call, test, "call", text)
    return causes


@dataclass(frozen=True)
class _RollCallRanks:
    """What the roll call reads of every rank, handed down as one: its reports by phase (which it rewrites),
    the phase of the report made up for it (``synthesized``, which it moves), how it ended, where it was, and
    the ranks woken to give their stacks."""

    by_phase: dict[str, dict[int, TestReport]]
    synthesized: dict[int, str]
    ends: dict[int, RankEnd]
    places: dict[int, Place]
    woken: Collection[int]


def _roll_call(ranks: _RollCallRanks, stacks_took: float | None, test: _Test) -> None:
    """Ranks the harness ended (a timeout, or a peer that failed) share one report per phase: the roll call.

    Its first line says why they were ended and names the cause or the odd ones; then where every
    rank of the test was, one line per place; then one stack per distinct stack, the ranks whose
    stack could not be taken and why, and their last output, folded. Only the first phase with
    ended ranks carries the roll call; a later one points to it.
    """
    by_phase, synthesized, ends, places = ranks.by_phase, ranks.synthesized, ranks.ends, ranks.places
    ended = sorted(r for r, end in ends.items() if end.ended_by in ("timeout", "peer_failed"))
    if not ended:
        return
    reasons = _roll_call_reasons(ranks, ended)
    cause = cause_sentence(places)
    headline = cause[1] if cause is not None else odd_ones(places)
    shown_in: str | None = None
    for phase in PHASES:
        for reason in ("timeout", "peer_failed"):
            here = [r for r in sorted(reasons) if synthesized.get(r) == phase and reasons[r] == reason]
            if not here:
                continue
            was = "was" if len(here) == 1 else "were"
            detail = ends[ended[0]].detail
            if reason == "timeout":
                head = f"{fold_ranks(here)} {was} still running {detail} (during {phase})"
            else:
                head = f"{fold_ranks(here)} {was} ended during {phase} {detail}"
            lines = [f"{head}: {headline}" if headline else head]
            if shown_in is None:
                shown_in = phase
                lines += _roll_call_body(ends, places, ended, stacks_took)
                broken = sorted(set(reasons) - set(ended))
                if broken:
                    lines.append(
                        f"({fold_ranks(broken)}: no stack, a peer's end broke {'its' if len(broken) == 1 else 'their'} "
                        "collective before it was asked; placed by the traceback of that error)"
                    )
            else:
                lines.append(f"(where each rank was: see the roll call of the {shown_in} failure)")
            text = "\n".join(lines)
            for rank in here:
                by_phase[phase][rank] = _synthesize(by_phase[phase][rank], test, phase, text)


def _roll_call_reasons(ranks: _RollCallRanks, ended: list[int]) -> dict[int, EndedBy | None]:
    """Rank -> why it is in the roll call: the ranks the harness ended, and the woken ranks waiting beside them.

    Moves each such rank's report to the phase of its transport error (``synthesized``).
    """
    by_phase, synthesized, ends, places = ranks.by_phase, ranks.synthesized, ranks.ends, ranks.places
    reasons = {r: ends[r].ended_by for r in ended}
    for rank in ranks.woken:
        if rank not in reasons and places[rank].waiting is not None:
            reasons[rank] = ends[ended[0]].ended_by
            synthesized[rank] = ""  # no report of its own was made up: set to the phase of its error below
    for rank in sorted(reasons):
        # Its stack was taken as it waited; the peer ended before it then broke its collective, and its
        # transport error is the harness's doing, not the test's: it joins the roll call in that phase.
        phase = next(
            (p for p in PHASES if rank in by_phase[p] and is_transport_failure(by_phase[p][rank])), None
        )
        # It may also have finished its test after the error, before its agent killed it (seen at 96 ranks).
        if (
            phase is not None
            and places[rank].waiting is not None
            and (rank in ranks.woken or rank in synthesized)
        ):
            made_up = synthesized.get(rank, "")
            if made_up not in ("", phase) and rank in by_phase[made_up]:
                del by_phase[made_up][rank]
            synthesized[rank] = phase
    return reasons


def _roll_call_body(
    ends: dict[int, RankEnd], places: dict[int, Place], ended: list[int], stacks_took: float | None
) -> list[str]:
    lines = roll_call(places)
    taken = [r for r in ended if ends[r].stacks.present and places[r].no_stack is None]
    if stacks_took is not None:
        lines[0] = (
            f"{lines[0][:-1]} (stacks of {len(taken)} of the {len(ended)} ranks ended, "
            f"taken within {stacks_took:.1f}s):"
        )
    lines += stacks_sections(ends, ended, places)
    tails: dict[str, list[int]] = {}
    for rank in ended:
        if ends[rank].output_tail.strip():
            tails.setdefault(ends[rank].output_tail.rstrip(), []).append(rank)
    for i, (tail, ranks) in enumerate(sorted(tails.items(), key=lambda kv: kv[1][0])):
        if i == _TAILS_SHOWN:
            rest = [r for rs in list(tails.values())[_TAILS_SHOWN:] for r in rs]
            lines.append(f"(the last output of {fold_ranks(rest)} is not shown: it differs from these)")
            break
        lines.append(f"--- last output of {fold_ranks(ranks)} ---\n{tail}")
    return lines


_TAILS_SHOWN = 4
"""Distinct output tails shown under a roll call; identical ones fold."""


def _rank_failures(
    reps: dict[int, TestReport],
    failed: list[int],
    failure_order: Sequence[int],
    causes: Sequence[int],
    ends: dict[int, RankEnd],
    location: Any,
) -> RankFailures:
    """The failed ranks' tracebacks, causes first, then in the order they failed; identical ones fold."""
    position = {r: i for i, r in enumerate(failure_order)}
    failed.sort(
        key=lambda r: (-1 if r in causes else _cause_rank(ends.get(r)), position.get(r, len(position)), r)
    )
    groups: dict[Any, tuple[list[int], Any]] = {}
    for r in failed:
        key = _failure_key(reps[r].longrepr)
        groups.setdefault(key, ([], reps[r].longrepr))[0].append(r)
    return RankFailures(
        groups=[(tuple(rs), lr) for rs, lr in groups.values()],
        location=(str(location[0]), int(location[1] or 0) + 1),
    )


def _held(reps: Collection[TestReport]) -> dict[str, float]:
    """A merged phase's timing: it held its ranks from the first one's start until the last one's end."""
    starts = [rep.start for rep in reps if rep.start]
    stops = [rep.stop for rep in reps if rep.stop]
    return {
        "duration": max(rep.duration for rep in reps),
        "start": min(starts) if starts else 0.0,
        "stop": max(stops) if stops else 0.0,
    }


def _merge_phase(
    phase: str,
    reps: dict[int, TestReport],
    test: _Test,
    world_size: int,
    failure_order: Sequence[int],
    ends: dict[int, RankEnd],
    causes: Sequence[int] = (),
) -> TestReport:
    ranks = sorted(reps)
    base = reps[ranks[0]]
    failed = [r for r in ranks if reps[r].failed]
    skipped = [r for r in ranks if reps[r].skipped]
    sections: list[tuple[str, str]] = []
    for r in ranks:
        sections.extend((f"{name} [rank {r}]", content) for name, content in reps[r].sections)
    user_properties = _pairs(base.user_properties)
    if phase == "call" or (phase == "setup" and len(reps) and all(not rep.passed for rep in reps.values())):
        user_properties.extend((f"sprite.rank{r}", reps[r].outcome) for r in ranks)
        user_properties.append(("sprite.world_size", world_size))
    if failed:
        longrepr: Any = _rank_failures(reps, failed, failure_order, causes, ends, test.location)
        if skipped:
            sections.append(("sprite", f"{fold_ranks(skipped)} skipped this phase"))
        outcome = "failed"
    elif len(skipped) == len(ranks):
        outcome, longrepr = "skipped", base.longrepr
        if isinstance(longrepr, list):  # JSON turned pytest's (path, lineno, reason) into a list
            longrepr = tuple(longrepr)
    else:
        outcome, longrepr = "passed", None
        if skipped:
            sections.append(("sprite", f"{fold_ranks(skipped)} skipped, the others passed"))
    held = _held(reps.values())
    merged = test.phase_report(
        ranked_report, phase, outcome, longrepr, sections=sections, user_properties=user_properties, **held
    )
    # Every rank records the same verdict: keep the lowest rank's results rather than N copies.
    recorded = next(
        (getattr(reps[r], REPORT_ATTR) for r in ranks if getattr(reps[r], REPORT_ATTR, None)), None
    )
    if recorded:
        setattr(merged, REPORT_ATTR, list(recorded))
    xfails = [getattr(reps[r], "wasxfail", None) for r in ranks]
    if not failed and all(x is not None for x in xfails):
        merged.wasxfail = str(xfails[0])
    return merged


def _pairs(properties: list[Any]) -> list[Any]:
    """A rank's user properties as pytest holds them, ``(name, value)`` tuples: the JSON that carried the
    report from the rank made each pair a list (anything else a test put there is kept as it came)."""
    return [tuple(p) if isinstance(p, list) and len(p) == 2 else p for p in properties]
