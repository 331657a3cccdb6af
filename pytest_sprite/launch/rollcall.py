"""Where each rank of a failed ranks test was, in a few lines: the roll call, and the rank that caused it.

Pure: from the ranks' reports and how their children ended (with the stacks taken at a timeout or
after a peer failed), each rank gets a place (``waiting in all_reduce (test.py:9)``, ``elsewhere, in
time.sleep (test.py:11)``, ``ended the test (passed)``, ``crashed with signal 9 (SIGKILL) during
call``). Ranks at the same place fold into one line, so 96 ranks read as two lines and the odd one
is named. A rank that left the test on its own (it returned, exited or crashed) while its peers
waited in a collective is the cause; the peers' transport errors are its consequences.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from pytest import TestReport

from ..plumbing.collectives import TRANSPORT_ERROR, Where, called_in, called_name, whereabouts
from ..plumbing.ranges import fold_ranks
from ..plumbing.roll_call import ROLL_CALL_PLACES, place_groups, roll_call_lines
from ..plumbing.stacks import StacksKey

__all__ = [
    "ROLL_CALL_PLACES",
    "Place",
    "cause_sentence",
    "collective_of_failure",
    "failure_text",
    "is_transport_failure",
    "odd_ones",
    "rank_places",
    "roll_call",
    "stacks_sections",
]


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where one rank was when its test ended."""

    rank: int
    text: str
    """One line: ``waiting in all_reduce (test.py:9)``; ranks with the same text fold."""
    waiting: Where | None = None
    """The collective it waited in (from its stack, or from the transport error that woke it)."""
    left: str | None = None
    """How it left the test on its own while it was running (``ended the test (passed)``), else None."""
    crashed: bool = False
    """It died or exited before finishing the test, by itself."""
    no_stack: str | None = None
    """Why its stack could not be taken, when it was asked for and none came."""


def failure_text(longrepr: Any) -> str:
    """A failure's message and its whole representation, as one text to search."""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return f"{crash.message}\n{longrepr}"
    return str(longrepr)


def is_transport_failure(report: TestReport) -> bool:
    """The report failed with a broken transport (a peer went away), not with an error of its own."""
    return report.failed and bool(TRANSPORT_ERROR.search(failure_text(report.longrepr)))


def _signal_name(signum: int) -> str:
    import signal as _signal

    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _entries(longrepr: Any) -> list[tuple[str, int, list[str]]]:
    """(path, line, source lines) of each traceback entry of a failure, outermost first."""
    tb = getattr(longrepr, "reprtraceback", None)
    out = []
    for entry in getattr(tb, "reprentries", None) or []:
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None:
            out.append((str(loc.path), int(loc.lineno), list(getattr(entry, "lines", []) or [])))
    return out


def collective_of_failure(longrepr: Any) -> Where | None:
    """The collective a failed rank was in and the line that called it, from its traceback.

    torch.distributed's frames are hidden from tracebacks (``_output.hide_library_frames``) unless
    ``--tb=long``: the caller is the entry before the first torch.distributed one, else the last.
    """
    entries = _entries(longrepr)
    if not entries:
        return None
    inside = next((i for i, (path, _, _) in enumerate(entries) if "/torch/distributed/" in path), None)
    if inside == 0:
        return None
    path, line, lines = entries[(inside if inside is not None else len(entries)) - 1]
    marked = next((text[1:] for text in lines if text.startswith(">")), "")
    name = called_in(marked) or called_name(path, line)
    if name is None:
        return None
    name = name.rsplit(".", 1)[-1]
    return Where(collective=name, path=path, line=line, callee=name)


def _own_outcome(reports: Sequence[TestReport]) -> str:
    if any(r.failed for r in reports):
        failed = next(r for r in reports if r.failed)
        return f"its {failed.when} failed"
    if reports and all(r.skipped for r in reports if r.when == "call") and any(r.skipped for r in reports):
        return "skipped"
    return "passed"


def _place_ended_by_harness(
    rank: int,
    reports: Sequence[TestReport],
    end: Any,
    woken: bool,
    finished: bool,
    transport: TestReport | None,
) -> Place:
    """Where a rank was that the harness ended (its timeout, or a peer that failed)."""
    if finished and transport is not None:  # it failed as its peer left, and then waited for the others
        where = collective_of_failure(transport.longrepr)
        if where is None and end.stacks.missing is None:
            found = whereabouts(end.stacks)
            where = found if found is not None and found.collective is not None else None
        if woken and where is not None:
            return Place(rank=rank, text=where.text(), waiting=where)
        text = f"lost its peer in {where.collective} ({where.at})" if where else "lost its peer"
        return Place(rank=rank, text=text, waiting=where)
    if finished:
        left = f"ended the test ({_own_outcome(reports)})"
        return Place(rank=rank, text=f"{left}; its process waited for the others", left=left)
    reason = end.stacks.missing
    if reason is not None or not end.stacks.threads:
        return Place(rank=rank, text="no stack (see below)", no_stack=reason or "none was taken")
    where = whereabouts(end.stacks)
    if where is None:
        return Place(rank=rank, text="no frame of its own in its stack")
    own = [r for r in reports if r.failed and not (woken and is_transport_failure(r))]
    after = f", after {_own_outcome(own)}" if own else ""
    return Place(
        rank=rank,
        text=where.text() + after,
        waiting=where if where.collective is not None else None,
    )


def _place(rank: int, reports: Sequence[TestReport], end: Any, woken: bool) -> Place:
    finished = bool(reports) and reports[-1].when == "teardown"
    if not reports:
        running = "setup"
    elif reports[-1].when == "setup" and reports[-1].passed:
        running = "call"
    else:
        running = "teardown"
    transport = next((r for r in reports if is_transport_failure(r)), None)
    if end is None:
        return Place(rank=rank, text="no exit status received (its agent was lost)")
    if woken and transport is not None:  # it waited there when the harness ended a peer, which broke the wait
        where = collective_of_failure(transport.longrepr)
        if where is not None:
            return Place(rank=rank, text=where.text(), waiting=where)
    if end.ended_by in ("timeout", "peer_failed"):
        return _place_ended_by_harness(rank, reports, end, woken, finished, transport)
    if end.ended_by == "agent_lost":
        return Place(rank=rank, text="lost with its rank agent")
    if end.ended_by == "agent_error":
        return Place(rank=rank, text="its rank agent could not run the test")
    if (
        end.interrupted
    ):  # pytest.exit or Ctrl-C: its own doing, read as "rank 1 was stopping the session: ..."
        left = f"stopping the session: it {end.interrupted} during {running}"
        return Place(rank=rank, text=left, left=left, crashed=True)
    if end.signal is not None or end.exitcode != 0 or not finished:
        how = (
            f"crashed with signal {end.signal} ({_signal_name(end.signal)})"
            if end.signal is not None
            else f"exited with code {end.exitcode}"
        )
        left = f"{how} during {running}"
        return Place(rank=rank, text=left, left=left, crashed=True)
    if transport is not None:
        where = collective_of_failure(transport.longrepr)
        text = f"lost its peer in {where.collective} ({where.at})" if where else "lost its peer"
        return Place(rank=rank, text=text, waiting=where)
    left = f"ended the test ({_own_outcome(reports)})"
    return Place(rank=rank, text=left, left=left)


def rank_places(
    *,
    per_rank: dict[int, list[TestReport]],
    ends: dict[int, Any],
    world_size: int,
    woken: Collection[int] = (),
) -> dict[int, Place]:
    """Every rank's place, from its reports and how its child ended.

    ``woken``: ranks whose transport error came after the harness began ending the test, when the
    kill of a peer broke the collective they waited in; they are placed where they waited.
    """
    return {r: _place(r, per_rank.get(r, []), ends.get(r), r in woken) for r in range(world_size)}


def _groups(places: dict[int, Place]) -> list[tuple[list[int], str]]:
    return place_groups({r: p.text for r, p in places.items()})


def _was(ranks: Sequence[int]) -> str:
    return "was" if len(ranks) == 1 else "were"


def cause_sentence(places: dict[int, Place]) -> tuple[list[int], str] | None:
    """The ranks that left the test while their peers waited in a collective, and the sentence naming them.

    ``rank 1 ended the test (passed) while ranks 0, 2-3 waited in all_reduce (test.py:9)``. A rank that
    crashed is the cause before one that only returned. None when nobody left or nobody waited.
    """
    crashed = [r for r, p in places.items() if p.crashed]
    leavers = crashed or [r for r, p in places.items() if p.left is not None]
    waiters = [r for r, p in places.items() if p.waiting is not None and r not in leavers]
    lost = [r for r, p in places.items() if p.text.startswith("lost its peer") and r not in leavers]
    if not leavers or not (waiters or lost):
        return None
    hows = {places[r].left for r in leavers}
    how = hows.pop() if len(hows) == 1 else "ended the test"
    sentence = f"{fold_ranks(leavers)} {how}"
    if waiters:
        at: dict[tuple[str | None, str], list[int]] = {}
        for r in waiters:
            where = places[r].waiting
            assert where is not None
            at.setdefault((where.collective, where.at), []).append(r)
        (collective, line), _ = max(at.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
        sentence += f" while {fold_ranks(waiters)} waited in {collective} ({line})"
    return sorted(leavers), sentence


def roll_call(places: dict[int, Place]) -> list[str]:
    """``where the N ranks were:`` and one line per place, ranks folded, the odd ones marked; at most 9 lines."""
    return roll_call_lines({r: p.text for r, p in places.items()})


def odd_ones(places: dict[int, Place]) -> str:
    """The places other than the most common one, for a headline (``rank 1 was elsewhere, in ...``)."""
    groups = _groups(places)
    if len(groups) < 2:
        return ""
    largest = max(groups, key=lambda g: len(g[0]))
    others = [g for g in groups if g is not largest][:2]
    return "; ".join(f"{fold_ranks(ranks)} {_was(ranks)} {text}" for ranks, text in others)


def stacks_sections(
    ends: dict[int, Any], ranks: Sequence[int], places: dict[int, Place] | None = None
) -> list[str]:
    """One ``--- stacks of ranks 0, 2-3 ---`` section per distinct stack, then the ranks without one and why."""
    by_stack: dict[StacksKey, tuple[list[int], str]] = {}
    missing: list[tuple[int, str]] = []
    for rank in sorted(ranks):
        end = ends.get(rank)
        if end is None or not end.stacks.present or (places is not None and places[rank].left is not None):
            continue  # a rank that had ended the test waited in the harness: its stack says nothing
        if end.stacks.missing is not None:
            missing.append((rank, end.stacks.missing))
            continue
        by_stack.setdefault(end.stacks.key(), ([], end.stacks.text().rstrip()))[0].append(rank)
    out = [
        f"--- stacks of {fold_ranks(rs)} (most recent call first) ---\n{text}"
        for rs, text in sorted(by_stack.values(), key=lambda g: g[0][0])
    ]
    if missing:
        out.append(
            f"--- {fold_ranks([r for r, _ in missing])}: no stack ---\n"
            + "\n".join(f"rank {r}: {reason}" for r, reason in missing)
        )
    return out
