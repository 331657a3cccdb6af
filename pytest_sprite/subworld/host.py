"""The host side of a sub-world: check the call, fork the ranks, watch them, collect every rank's outcome.

The process that calls :func:`run_subworld` hosts its sub-world: it holds the rendezvous store (rank 0 of a
ranks test holds it for every rank), forks its ranks (directly in a plain test, through its zygote in a ranks
test), reads their frames, ends them all when one dies or the time is up, and builds the result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import select
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing import phases
from pytest_sprite.plumbing.coverage import current_context
from pytest_sprite.plumbing.mutants import current_run
from pytest_sprite.plumbing.output import tail_of_file
from pytest_sprite.plumbing.placement import place
from pytest_sprite.plumbing.process import wait_status
from pytest_sprite.plumbing.protocol import ObjectReader
from pytest_sprite.plumbing.stacks import Stacks, read_stacks, take_stacks_of
from pytest_sprite.plumbing.timing import monotonic, sleep

from .join import Seat, store_listener, tcp_store
from .messages import Emitted, Killed, Profiled, Raised, RankMessage, Ready, Recorded, Returned
from .plan import KillPlan, KillPoint
from .rank_body import RankSpec, in_subworld
from .result import RankOutcome, SubworldResult
from .zygote import DirectForker, Forker, current_zygote

if TYPE_CHECKING:
    from pytest_sprite.world import World

__all__ = ["DEFAULT_TIMEOUT", "run_plain_world", "run_subworld"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a sub-world may run before its ranks' stacks are taken and they are killed."""

_TAIL = 40
_PEER_KILL_GRACE = 10.0
"""Seconds a live rank gets to reach its own kill when the plan kills it where another rank was just killed."""


@dataclass(kw_only=True)
class _Hosted:
    rank: int
    pid: int
    channel: socket.socket
    events: list[tuple[str, Any]] = field(default_factory=list)
    returned: bool = False
    value: Any = None
    error: str = ""
    killed_at: KillPoint | None = None
    status: int | None = None
    eof: bool = False
    ready_at: float | None = None
    ended: str = ""
    timed_out: bool = False
    no_stack: str = ""
    """Why no stack was taken when the sub-world timed out ("" when one was)."""
    profile: dict[str, float] = field(default_factory=dict)
    """Under ``--sprite-profile``: the rank's seconds by phase."""

    reader: ObjectReader = field(default_factory=ObjectReader)


def _read_channel(h: _Hosted) -> None:
    while True:
        try:
            data = h.channel.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            h.eof = True
            return
        for message in h.reader.feed(data):
            _take(h, message)


def _take(h: _Hosted, message: RankMessage) -> None:
    """One message of rank ``h`` into what the host knows of it."""
    if isinstance(message, Ready):
        h.ready_at = monotonic()
    elif isinstance(message, Emitted):
        h.events.append((message.name, message.value))
    elif isinstance(message, Recorded):
        run = current_run()  # the sub-world rank r runs on test rank r: its record joins this rank's
        if run is not None:
            run.ops.extend(message.ops)
    elif isinstance(message, Profiled):
        h.profile = message.totals
    elif isinstance(message, Returned):
        h.returned, h.value = True, message.value
    elif isinstance(message, Raised):
        h.error = message.error
    elif isinstance(message, Killed):
        h.killed_at = message.at
    else:
        raise TypeError(f"a sub-world rank sent {message!r}, which is no RankMessage")


def _outcome(h: _Hosted, run_dir: Path) -> RankOutcome:
    exitcode, signum = wait_status(h.status if h.status is not None else 0)
    output = tail_of_file(run_dir / f"rank{h.rank}.log", _TAIL)
    common: dict[str, Any] = {
        "rank": h.rank,
        "events": tuple(h.events),
        "signum": signum,
        "exitcode": exitcode,
    }
    if h.returned:
        return RankOutcome(status="returned", value=h.value, **common)
    if h.killed_at is not None:
        return RankOutcome(status="killed", killed_at=h.killed_at, **common)
    if h.timed_out:
        stacks = read_stacks(run_dir / f"rank{h.rank}.stacks").last_lines(_TAIL)
        if not stacks.threads:
            stacks = Stacks(missing=h.no_stack or "the dump was empty")
        shown = f"{output}\n{stacks.text()}".strip()
        return RankOutcome(status="timeout", error=h.ended, output=shown, stacks=stacks, **common)
    if h.error:
        return RankOutcome(status="raised", error=h.error, output=output, **common)
    if h.ended:
        return RankOutcome(status="ended", error=h.ended, **common)
    return RankOutcome(status="crashed", output=output, **common)


def _attribute(outcomes: Sequence[RankOutcome]) -> tuple[RankOutcome, ...]:
    """Peers of a rank that died fail in their next collective: they were ended by that death, not by a bug.

    Their traceback stays in ``output``; the dead rank comes first in the story.
    """
    dead = [o for o in outcomes if o.status in ("killed", "crashed")]
    if not dead:
        return tuple(outcomes)
    why = "; ".join(
        f"rank {o.rank} was killed at {o.killed_at.describe()}"
        if o.killed_at is not None
        else f"rank {o.rank} died before returning"
        for o in dead
    )
    return tuple(
        dataclasses.replace(o, status="ended", error=why, output=f"{o.error}\n{o.output}".strip())
        if o.status == "raised"
        else o
        for o in outcomes
    )


def _check_fn(fn: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    if not callable(fn):
        raise SpriteUsageError(f"run_subworld needs a function, got {type(fn).__name__}")
    try:
        pickle.dumps((fn, args, dict(kwargs)))
    except Exception as exc:
        raise SpriteUsageError(
            f"run_subworld({getattr(fn, '__qualname__', fn)!r}, ...): the function and its arguments must be "
            f"picklable, since every rank gets them in a fresh process ({type(exc).__name__}: {exc}); use a "
            "module-level function (not a lambda or a nested function) and plain, CPU-side arguments"
        ) from exc


def run_subworld(
    fn: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    ranks: int | None = None,
    kill: KillPlan | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> SubworldResult:
    """Run ``fn(world, *args, **kwargs)`` in a sub-world of ``ranks`` fresh processes; every rank's outcome.

    In a ranks test, call it on every rank of the test (like a collective); ranks ``0..ranks-1`` of the test
    each start one rank of the sub-world (default: as many as the test has; fewer is allowed, more is not).
    In a plain test the sub-world is a world of its own of ``ranks`` processes (default 1).
    ``kill`` (e.g. ``KillAt(event="step", at=4)``) kills ranks at their ``kill_point`` calls. The result
    is the same on every rank; ``result.values()`` raises unless every rank returned.
    """
    from pytest_sprite.world import current_world

    if in_subworld():
        raise SpriteUsageError(
            "run_subworld cannot be nested: this process is already a rank of a sub-world. Start every "
            "sub-world from the test itself, one after another"
        )
    kwargs = dict(kwargs or {})
    args = tuple(args)
    _check_fn(fn, args, kwargs)
    if kill is not None and not isinstance(kill, KillPlan):
        raise SpriteUsageError(
            f"kill= must be a kill plan with should_kill(point) (e.g. KillAt(event='step', at=4)), got {kill!r}"
        )
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise SpriteUsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
    world = current_world()
    if world is not None and world.distributed:
        return _run_in_ranks_test(world, fn, args, kwargs, ranks, kill, float(timeout))
    _refuse_initialized_device()
    size = _check_ranks(ranks, None)
    with phases.phase("fork"):
        return run_plain_world(
            fn, args, kwargs, size=size, kill=kill, timeout=float(timeout), forker=DirectForker()
        )


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn))))


def _check_ranks(ranks: object, most: int | None) -> int:
    if ranks is None:
        return most or 1
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise SpriteUsageError(f"run_subworld(ranks={ranks!r}): a positive int")
    if most is not None and ranks > most:
        raise SpriteUsageError(
            f"run_subworld(ranks={ranks}): a sub-world has the same or fewer ranks than the test that starts "
            f"it, which has {most}; mark the test @pytest.mark.ranks({ranks}) or ask for fewer"
        )
    return ranks


def _refuse_initialized_device() -> None:
    """A plain test forks from its own process, which must not hold an initialized CUDA or XPU context."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        initialized = getattr(module, "is_initialized", None)
        if initialized is not None and initialized():
            raise SpriteUsageError(
                f"run_subworld in a test without the ranks marker forks this process, which has already "
                f"initialized {kind}, and a forked {kind} context does not work; mark the test "
                "@pytest.mark.ranks(n) (its sub-worlds fork from a copy made before any device was touched)"
            )


def run_plain_world(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    size: int,
    kill: KillPlan | None,
    timeout: float,
    forker: Forker,
    join: bool = True,
    peer_grace: float = 0.0,
) -> SubworldResult:
    """A plain test's sub-world of ``size`` ranks on this host, started by ``forker`` (arguments checked).

    ``run_subworld`` forks the ranks from this process; ``bench/resume.py`` passes a forker that starts new
    interpreters, to time them against forks. A crash matrix's runs (``save_crashes/target_run.py``) pass ``join=False``
    (the function sets up its ranks itself) and ``peer_grace``: the seconds the other ranks run on after one
    died, as the peers of a killed process would, before they are ended.
    """
    start = monotonic()
    # The ranks fork before the store's server thread starts: a fork taken while that thread is inside the
    # C library's resolver (torch names every peer that connects with getnameinfo) leaves the rank holding
    # the resolver's lock, and its own first lookup waits on it for ever. They connect to the listening
    # socket, bound first, and the store serves them once it starts on it.
    listener = store_listener("127.0.0.1")
    with listener:
        layout = [(0, r) for r in range(size)]  # one node; rank r computes on device r
        seats = [_subworld_place(layout, size, r) for r in range(size)]
        address = ("127.0.0.1", int(listener.getsockname()[1]))
        hosted, run_dir = _start(
            forker,
            fn,
            args,
            kwargs,
            seats,
            address,
            kill,
            timeout,
            "auto",
            join=join,
            host_fds=(listener.fileno(),),
        )
        store = tcp_store(*address, is_master=True, listen_fd=listener.detach())
    _watch(hosted, forker, store, size, timeout, start, kill, run_dir, peer_grace=peer_grace)
    _absorb_profile(hosted)
    outcomes = [_outcome(h, run_dir) for h in hosted]
    _cleanup(run_dir)
    return SubworldResult(
        name=_name(fn),
        outcomes=_attribute(outcomes),
        wall_s=monotonic() - start,
        start_s=_ready(hosted, start),
    )


def _run_in_ranks_test(
    world: World,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ranks: int | None,
    kill: KillPlan | None,
    timeout: float,
) -> SubworldResult:
    size = _check_ranks(ranks, world.size)
    zygote = current_zygote(world.rank)
    if zygote is None:
        raise SpriteUsageError(
            "run_subworld in a ranks test needs the harness's pre-initialized fork of this rank, which this "
            "test child does not have; it runs only inside tests that pytest-sprite started"
        )
    start = monotonic()
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store: Any = None
    if world.rank == 0:
        listener = store_listener("127.0.0.1" if host in ("127.0.0.1", "localhost") else "")
        port = int(listener.getsockname()[1])
        store = tcp_store(host, port, is_master=True, listen_fd=listener.detach())
        port = world.broadcast_object(port)
    else:
        port = world.broadcast_object(0)
        store = tcp_store(host, port, is_master=False)
    layout = _layout(world)
    mine = [_subworld_place(layout, size, world.rank)] if world.rank < size else []
    with phases.phase("fork"):
        hosted, run_dir = _start(
            zygote, fn, args, kwargs, mine, (host, port), kill, timeout, world.device.type
        )
        _watch(hosted, zygote, store, size, timeout, start, kill, run_dir)
        _absorb_profile(hosted)
    outcomes = [_outcome(h, run_dir) for h in hosted]
    _cleanup(run_dir)
    gathered = world.gather_object((outcomes, _ready(hosted, start), monotonic() - start))
    # every rank reached the gather, so none uses the store any more: its server (rank 0's) may end
    store = None
    all_outcomes = sorted((o for part, _, _ in gathered for o in part), key=lambda o: o.rank)
    return SubworldResult(
        name=_name(fn),
        outcomes=_attribute(all_outcomes),
        wall_s=gathered[0][2],  # rank 0's, the same on every rank
        start_s=max(s for _, s, _ in gathered[:size]) if size else 0.0,
    )


_LAYOUTS: dict[int, list[tuple[int, int]]] = {}
"""Each test rank's (node, device index), gathered once per test (a test child runs one test)."""


def _layout(world: World) -> list[tuple[int, int]]:
    key = id(world)
    if key not in _LAYOUTS:
        _LAYOUTS.clear()
        _LAYOUTS[key] = world.gather_object((world.node, world.local_devices[world.local_rank]))
    return _LAYOUTS[key]


def _absorb_profile(hosted: Sequence[_Hosted]) -> None:
    """The first hosted rank's time by phase joins this process's (a ranks test's rank r hosts sub-world
    rank r; a plain test's host, rank 0, speaks for its sub-world as rank 0 of a test does)."""
    if hosted:
        phases.absorb(hosted[0].profile)


def _subworld_place(layout: Sequence[tuple[int, int]], size: int, rank: int) -> dict[str, Any]:
    """Where sub-world rank ``rank`` of ``size`` sits, from each test rank's (node, device index) in ``layout``.

    Sub-world rank r runs on test rank r and computes on that rank's device (the rule that places a test's
    ranks on agents): a packed test sits on any agents' devices (4 and 5, say), so the sub-world's own local
    rank (0, 1) would pick a neighbour's.
    """
    return dict(rank=rank, world_size=size, **dataclasses.asdict(place(layout[:size])[rank]))


def _start(
    forker: Forker,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    seats: list[dict[str, Any]],
    store: tuple[str, int],
    kill: KillPlan | None,
    timeout: float,
    device: str,
    *,
    join: bool = True,
    host_fds: Sequence[int] = (),
) -> tuple[list[_Hosted], Path]:
    run_dir = Path(tempfile.mkdtemp(prefix="sprite-subworld-"))
    hosted = []
    for fields_ in seats:
        seat = Seat(master_addr=store[0], master_port=store[1], device=device, timeout=timeout, **fields_)
        spec = RankSpec(
            name=_name(fn),
            seat=seat,
            plan=kill,
            run_dir=str(run_dir),
            join=join,
            coverage_context=current_context(),
            group_backend=run.group_backend if (run := current_run()) is not None else None,
            profile=phases.enabled(),
        )
        mine, theirs = socket.socketpair()
        pid = forker.spawn((spec, fn, args, kwargs), theirs, host_fds)
        theirs.close()
        mine.setblocking(False)
        hosted.append(_Hosted(rank=seat.rank, pid=pid, channel=mine))
    return hosted, run_dir


def _ready(hosted: list[_Hosted], start: float) -> float:
    """Seconds from ``start`` until the last hosted rank was running with its function loaded."""
    times = [h.ready_at for h in hosted if h.ready_at is not None]
    return max(times) - start if times else 0.0


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _watch(
    hosted: list[_Hosted],
    forker: Forker,
    store: Any,
    size: int,
    timeout: float,
    start: float,
    kill: KillPlan | None,
    run_dir: Path,
    *,
    peer_grace: float = 0.0,
) -> None:
    """Read every hosted rank until it ends; end them all when any dies (after ``peer_grace``) or the time is up.

    A rank that the kill plan also kills where another rank was killed (``KillAt("step", 4)`` on every
    rank) first gets up to ``_PEER_KILL_GRACE`` seconds to reach that point: a rank still finishing the
    step before it would otherwise be ended, not killed there, and the plan's kill would not be what ran.
    """
    deadline = start + timeout
    last_poll = 0.0
    first_death: float | None = None
    while not all(_finished(h, forker.reaps) for h in hosted):
        waits = [*(h.channel.fileno() for h in hosted if not h.eof), *forker.waitable()]
        if waits:  # a rank's message, its channel's end, or its exit (the forker's news) wakes it at once
            select.select(waits, [], [], 0.02)
        else:
            sleep(0.02)
        for h in hosted:
            if not h.eof:
                _read_channel(h)
        for pid, status in forker.poll().items():
            for h in hosted:
                if h.pid == pid:
                    _ended(h, status, store)
        now = monotonic()
        if now - last_poll > 0.05:
            last_poll = now
            if store.add("sprite/ended", 0) > 0:
                first_death = now if first_death is None else first_death
                if now - first_death < peer_grace:
                    spared = tuple(h.rank for h in hosted)
                elif now - first_death < _PEER_KILL_GRACE:
                    spared = _due_to_be_killed(hosted, store, size, kill)
                else:
                    spared = ()
                _end_live(hosted, store, size, spared=spared)
        if now > deadline:
            _time_out([h for h in hosted if not _finished(h, forker.reaps)], timeout, run_dir)
            deadline = float("inf")
    for h in hosted:
        h.channel.close()


def _finished(h: _Hosted, reaped_elsewhere: bool) -> bool:
    """Rank ``h`` is done with: its channel closed, and it ended, or returned while another process reaps
    it (its exit, ``os._exit(0)`` once its peers returned, is reported later; waiting for it cost every
    sub-world the ranks' exits, 20-40 ms on a loaded machine)."""
    return h.eof and (h.status is not None or (reaped_elsewhere and h.returned))


def _ended(h: _Hosted, status: int, store: Any) -> None:
    """Hosted rank ``h`` ended with wait status ``status``: read what is left, tell the peers if it died."""
    h.status = status
    if not h.eof:
        _read_channel(h)
    if h.returned or h.ended:
        return
    why = (
        f"rank {h.rank} was killed at {h.killed_at.describe()}"
        if h.killed_at is not None
        else f"rank {h.rank} died before returning"
    )
    store.set(f"sprite/ended/{h.rank}", why)
    if h.killed_at is not None:
        point = h.killed_at
        store.set(f"sprite/killed/{h.rank}", json.dumps([point.event, point.count, point.index]))
    store.add("sprite/ended", 1)


def _time_out(live: list[_Hosted], timeout: float, run_dir: Path) -> None:
    """The sub-world's time is up: take the stacks of the ranks still running, as a ranks test's are, then kill them."""
    for h in live:
        h.timed_out = True
        h.ended = f"did not finish within the sub-world's timeout of {timeout:g} s"
    why = take_stacks_of([(h.pid, run_dir / f"rank{h.rank}.stacks") for h in live])
    for h in live:
        h.no_stack = why.get(h.pid, "")
        if h.status is None:
            _kill(h.pid, signal.SIGKILL)


def _due_to_be_killed(hosted: list[_Hosted], store: Any, size: int, kill: KillPlan | None) -> tuple[int, ...]:
    """The live hosted ranks that ``kill`` kills at a point where another rank of the sub-world was killed."""
    if kill is None:
        return ()
    points = []
    for r in range(size):
        if store.check([f"sprite/killed/{r}"]):
            event, count, index = json.loads(store.get(f"sprite/killed/{r}"))
            points.append((event, count, index))
    return tuple(
        h.rank
        for h in hosted
        if h.status is None
        and not h.returned
        and any(
            kill.should_kill(KillPoint(rank=h.rank, event=event, count=count, index=index, detail=""))
            for event, count, index in points
        )
    )


def _end_live(hosted: list[_Hosted], store: Any, size: int, *, spared: tuple[int, ...] = ()) -> None:
    for h in hosted:
        if h.rank in spared:
            continue
        if h.status is None and not h.ended and not h.returned:
            whose = [
                store.get(f"sprite/ended/{r}").decode()
                for r in range(size)
                if store.check([f"sprite/ended/{r}"])
            ]
            h.ended = "; ".join(whose) or "another rank of the sub-world died"
            _kill(h.pid, signal.SIGKILL)
        elif h.status is None and h.returned:
            _kill(h.pid, signal.SIGKILL)  # it returned and waits for the dead rank at its exit


def _cleanup(run_dir: Path) -> None:
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
