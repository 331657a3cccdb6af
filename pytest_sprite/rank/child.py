"""Test child: one fresh process per rank per ranks test.

Initializes the device and the default process group, runs pytest's own protocol for the item
(``runtestprotocol(item, log=False)``), streams each report to its agent as soon as it is made, and
ends with ``os._exit`` so no exit handler can turn a passed test into a crash (the Aurora
FSDP2 + Triton exit segfault).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import signal
import socket
import sys
import traceback
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import pytest

from .. import subworld
from .. import world as _world
from ..glue.markers import item_ranks_spec
from ..glue.options import settings_key
from ..glue.pytest_internals import capture_tmpfiles, record_warnings, runtestprotocol
from ..glue.recorded_results import DEVICE_ATTR, set_progress_sink
from ..glue.tmp_path import share_tmp_path, shared_test_dir
from ..plumbing import phases
from ..plumbing.coverage import rank_started, save_rank_data
from ..plumbing.phases import PROFILE_PROPERTY
from ..plumbing.process import die_with_parent, install_stack_dumps, name_process, redirect_output
from ..plumbing.protocol import CHILD_DONE, HEADER_SIZE, RunSpec, decode_frame, send_frame
from ..plumbing.stacks import STACK_SIGNAL
from ..subworld.join import Seat, join_world, tcp_store
from ..world import World
from .debugger import bind_debugger, install_debugger
from .given import echo_note, prepare_hypothesis_item
from .leftovers import lead_own_session

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHILD_SESSION",
    "ChildSession",
    "forget_child_session",
    "register_child_session",
    "run_child",
    "run_spare",
]

CHILD_SESSION = "sprite-child"
"""The plugin name of :class:`ChildSession`; registered (in an agent) means this process runs test children."""


class _Channel:
    """Frames from this child to its agent, which relays them to the controller."""

    def __init__(self, fd: int, spec: RunSpec) -> None:
        self.fd = fd
        self.spec = spec

    def send(self, event: str, **payload: Any) -> None:
        try:
            send_frame(self.fd, event, {"run_id": self.spec["run_id"], "rank": self.spec["rank"], **payload})
        except BrokenPipeError:
            _agent_gone()

    def collect(self, name: str, rank: int, tensor: torch.Tensor) -> None:
        import torch

        buf = io.BytesIO()
        torch.save(tensor, buf)
        self.send("collected", name=name, tensor=base64.b64encode(buf.getvalue()).decode("ascii"))


class ChildSession:
    """Pytest hooks active inside a test child only.

    Registered once in the agent (:func:`register_child_session`) and bound to its test in each child
    (:meth:`bind`), because registering a plugin in every child would cost each one page faults.
    Unbound (in the agent) its hooks do nothing; the agent runs no test.
    """

    channel: _Channel
    spec: RunSpec

    def __init__(self) -> None:
        self.bound = False
        self.listen_fd: int | None = None
        """Rank 0: an already listening socket for the rendezvous store (the agent reserved it)."""
        self.store: Any = None
        self.relayed: socket.socket | None = None
        """The agent's word that a report is passed on (see :meth:`_wait_relayed`)."""

    def bind(
        self, channel: _Channel, spec: RunSpec, listen_fd: int | None, relayed: socket.socket | None = None
    ) -> None:
        """This child's test: where it reports, its seat, rank 0's listening socket, the agent's word."""
        self.channel = channel
        self.spec = spec
        self.listen_fd = listen_fd
        self.relayed = relayed
        self.bound = True

    def _wait_relayed(self) -> None:
        """Go on to the next phase only once the agent has passed this phase's report to the controller.

        A body that kills its own agent takes with it whatever the agent has not relayed yet; waiting
        here (one wake-up of the agent, which relays the report anyway) means the controller knows
        which phase the rank was in when its agent was lost. EOF: the agent is gone (see :func:`_agent_gone`).
        """
        if self.relayed is None:
            return
        try:
            word = self.relayed.recv(1)
        except OSError:
            word = b""
        if not word:
            _agent_gone()

    def leave(self) -> None:
        """Before exiting, make sure no peer still needs this process for its rendezvous.

        Every rank finished ``init_process_group`` before any entered the test (:func:`_ready_barrier`);
        rank 0, which hosts the store, waits until every rank has checked out of it. Bounded: a rank that died never arrives, and the
        controller ends the waiting ranks after the grace period anyway.
        """
        if self.store is None:
            return
        try:
            if self.store.add("sprite/done", 1) == self.spec["world_size"]:
                self.store.set("sprite/all-done", "1")
            if self.spec["rank"] == 0:  # woken by the last check-out, not by polling
                self.store.wait(["sprite/all-done"], timedelta(seconds=30))
        except Exception:  # a peer's crash can break the store, or the wait times out: the result is sent
            pass

    @pytest.hookimpl
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Initialize device and process group before fixtures, so a failure is a setup error."""
        if not self.bound:
            return
        spec = item_ranks_spec(item)
        if spec is not None and not spec.init:
            self._join_without_group()
        else:
            self._init_world()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if not self.bound:
            return report
        _annotate(report, call)
        if phases.enabled():  # this phase's time by phase, to the controller in the report
            report.user_properties.append((PROFILE_PROPERTY, phases.take()))
        world = _world.current_world()
        if world is not None:  # the device this rank ran on, for the per-rank outcomes of the reports
            setattr(report, DEVICE_ATTR, str(world.device))
        data = item.config.hook.pytest_report_to_serializable(config=item.config, report=report)
        self.channel.send("report", report=data)
        if report.when != "teardown":
            self._wait_relayed()
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Any:
        """After the fixtures are torn down, end what the test left running in this child's session."""
        try:
            return (yield)
        finally:
            if self.bound:
                self._end_leftovers()

    def _end_leftovers(self) -> None:
        import warnings

        from ..errors import LeftoverProcessWarning
        from .leftovers import (
            ESCAPED_NOTE,
            describe_leftovers,
            end_session_leftovers,
            escaped_sessions,
            started_nothing,
        )

        subworld.settle_zygote_ranks()  # its sub-worlds' ranks that returned end on their own, soon
        zygote = subworld.zygote_pid()
        # A test that started no process (most) has nothing to search for.
        nothing = started_nothing()
        ended = [] if nothing else end_session_leftovers(os.getsid(0), exclude={os.getpid()})
        for sid in [] if nothing else escaped_sessions(exclude={zygote} if zygote else ()):
            ended += [
                dataclasses.replace(left, command=f"{left.command} ({ESCAPED_NOTE})")
                for left in end_session_leftovers(sid)
            ]
        # The ranks of its sub-worlds lived in their zygote's session: what they left running is there.
        if zygote is not None:
            ended += end_session_leftovers(zygote, exclude={zygote})
        if ended:
            warnings.warn(LeftoverProcessWarning(describe_leftovers(self.spec["rank"], ended)), stacklevel=1)

    @pytest.hookimpl
    def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str, location: Any) -> None:
        """Send the test's warnings to the controller, which folds them over ranks into its summary."""
        if when != "runtest" or not self.bound:
            return
        self.channel.send(
            "warning",
            category=_qualified(type(warning_message.message)),
            message=str(warning_message.message),
            filename=str(warning_message.filename),
            lineno=int(warning_message.lineno or 0),
        )

    def _init_world(self) -> World:
        """Join the test's world; rank 0 hosts its store on the socket its agent reserved."""
        spec = self.spec

        def connect(timeout: timedelta) -> Any:
            return tcp_store(
                spec["master_addr"],
                spec["master_port"],
                is_master=spec["rank"] == 0,
                timeout=timeout,
                world_size=spec["world_size"],
                listen_fd=self.listen_fd if spec["rank"] == 0 else None,
            )

        world, self.store = join_world(
            _seat(spec),
            connect=connect,
            sink=self.channel.collect,
            collective_check=spec["collective_check"],
            test_dir=self._test_dir,
            group_backend=self._mutant_backend if spec.get("record_collectives") else None,
        )
        _ready_barrier(self.store, rank=spec["rank"], world_size=spec["world_size"])
        return world

    def _mutant_backend(self, backend: str) -> str:
        """``--sprite-mutate``: the default group records its collectives and plants this run's mutant."""
        from .mutant_backend import install

        return install(self.spec.get("mutant"), backend)

    def send_collectives_called(self) -> None:
        """``--sprite-mutate``'s record of this rank's collectives, for the controller's applicability."""
        if self.bound and self.spec.get("record_collectives"):
            from .mutant_backend import called_ops

            self.channel.send("collectives_called", ops=called_ops())

    def _join_without_group(self) -> World:
        """``ranks(n, init=False)``: device, variables and World, but no store and no default group.

        Rank 0 closes the rendezvous socket its agent reserved, so ``MASTER_PORT`` is free for the test's
        own ``init_process_group`` (``env://``); nothing of the harness waits on the other ranks.
        """
        if self.listen_fd is not None:
            os.close(self.listen_fd)
            self.listen_fd = None
        world, _ = join_world(
            _seat(self.spec),
            connect=None,
            sink=self.channel.collect,
            collective_check=self.spec["collective_check"],
            test_dir=self._test_dir,
        )
        return world

    def _test_dir(self) -> Path:
        return shared_test_dir(Path(self.spec["basetemp"]), Path(self.spec["tmp_path"]))


def _ready_barrier(store: Any, *, rank: int, world_size: int) -> None:
    """No rank starts the test's setup until every rank of the test has joined its process group.

    Two phases on the test's store: every rank arrives and waits for the last arrival; then every rank
    departs, and rank 0, which hosts the store, waits for the last departure. So once rank 0 enters the
    test (and may die there), no peer still needs its store to get in: a peer's failure after that is
    a consequence of what happened in the test, never a setup error of its own. Each wait is
    bounded by the store's timeout; a rank that never arrives is ended by the controller first.
    """
    if store.add("sprite/arrived", 1) == world_size:
        store.set("sprite/all-arrived", "1")
    store.wait(["sprite/all-arrived"])
    if store.add("sprite/departed", 1) == world_size:
        store.set("sprite/all-departed", "1")
    if rank == 0:
        store.wait(["sprite/all-departed"])


def _annotate(report: pytest.TestReport, call: pytest.CallInfo[None]) -> None:
    """What the raw report of a rank would hide or repeat.

    A rank that failed a hypothesis example only because another rank did (see ``given.py``) passed
    its own checks: its report passes with a note, so the failing example is reported once, by the
    rank that had it. torch's collective mismatch error gets one line per rank.
    """
    from ..plumbing.collectives import mismatch_summary

    if not report.failed or call.excinfo is None:
        return
    note = echo_note(call.excinfo.value)
    if note is not None:
        report.outcome = "passed"
        report.longrepr = None
        report.sections.append(("sprite", note))
        return
    summary = mismatch_summary(str(call.excinfo.value))
    if summary is not None:
        report.sections.append(("collective mismatch (--collective-check)", summary))


def _prepare_item(item: pytest.Item, spec: RunSpec) -> None:
    """Before any fixture runs: the shared tmp_path, and hypothesis made safe on several ranks."""
    share_tmp_path(
        item.config, basetemp=Path(spec["basetemp"]), test_dir=Path(spec["tmp_path"]), item_name=item.name
    )

    def agree(outcome: object) -> list[object]:
        current = _world.current_world()
        return [outcome] if current is None else current.gather_object(outcome)

    prepare_hypothesis_item(
        item, rank=spec["rank"], world_size=spec["world_size"], seed=spec["hypothesis_seed"], agree=agree
    )


def _seat(spec: RunSpec) -> Seat:
    """Where this child sits in its test's world: the spec's fields of a seat (a JSON list back to a tuple)."""
    fields = cast("Mapping[str, Any]", spec)
    seat = {f.name: fields[f.name] for f in dataclasses.fields(Seat)}
    return Seat(**{**seat, "local_devices": tuple(seat["local_devices"])})


def _send_uncaptured_output(config: pytest.Config, channel: _Channel, run_dir: Path) -> None:
    """With ``-s`` the user wants to see what each rank printed: send it for the controller to show."""
    if config.getoption("capture", None) != "no":
        return
    text = (run_dir / "output.log").read_text(errors="replace")
    if text.strip():
        channel.send("output", text=text)


def register_child_session(config: pytest.Config) -> None:
    """In the agent, before it forks test children: the hooks each child binds to its test, registered once."""
    if not config.pluginmanager.has_plugin(CHILD_SESSION):
        config.pluginmanager.register(ChildSession(), CHILD_SESSION)
    install_debugger(config)


def forget_child_session(config: pytest.Config) -> None:
    """In a process forked from the agent that runs no test (its sub-world zygote): drop the child hooks."""
    if config.pluginmanager.has_plugin(CHILD_SESSION):
        config.pluginmanager.unregister(name=CHILD_SESSION)


def _qualified(cls: type) -> str:
    """A warning class as ``module.QualName``, which the controller finds again (a builtin: its bare name)."""
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _agent_gone() -> NoReturn:
    """The agent died (its end of a pipe or socket closed): end now, as its death signal is about to.

    Linux closes a dying process's files before it signals the children that asked to die with it, so
    a child can see the agent's pipe break first; going on would only print a BrokenPipeError that no
    one reads. The controller reports the rank from the agent's loss.
    """
    os._exit(1)


def _die_with_parent(agent_pid: int) -> None:
    """Ask Linux to kill this child when its agent dies, so a lost agent leaves no rank behind.

    Without it, a child waiting in a collective outlives an agent killed by the launcher or the OOM
    killer. No-op where prctl is unavailable.
    """
    if die_with_parent() and os.getppid() != agent_pid:  # the agent died before prctl took effect
        os._exit(1)


def run_spare(
    *,
    control: socket.socket,
    items: Mapping[str, pytest.Item],
    write_fd: int,
    run_dir: Path,
    agent_pid: int,
    pristine: socket.socket | None = None,
) -> NoReturn:
    """Body of a spare child: prepare what no test decides, wait for the test, run it; never returns.

    The agent sends the controller's ``run`` frame (a RunSpec) with rank 0's listening rendezvous
    socket attached (SCM_RIGHTS); EOF means the spare is not needed. ``pristine``: the agent's pristine
    zygote, asked for this test's zygote only when the test starts a sub-world.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    lead_own_session()  # what the test starts stays in this session, to be ended with the test
    _die_with_parent(agent_pid)
    name_process("spare")  # sprite-test once the test arrives
    redirect_output(run_dir / "output.log", stdin_devnull=True)
    install_stack_dumps(run_dir / "output.log", run_dir / "stacks.txt", STACK_SIGNAL)
    subworld.set_pristine(pristine)
    message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
    if not message:
        os._exit(0)
    event, payload = decode_frame(message[HEADER_SIZE:])
    if event != "run":
        raise ValueError(f"a spare child expects a run frame, not {event!r}")
    spec = cast(RunSpec, payload)
    item = items[spec["nodeid"]]
    name_process("test")
    run_child(
        item=item,
        write_fd=write_fd,
        run_dir=run_dir,
        spec=spec,
        listen_fd=fds[0] if fds else None,
        relayed=control,
    )


def run_child(
    *,
    item: pytest.Item,
    write_fd: int,
    run_dir: Path,
    spec: RunSpec,
    listen_fd: int | None,
    relayed: socket.socket | None = None,
) -> NoReturn:
    """Run one item as one rank and end the process; never returns. Output is already redirected."""
    code = 0
    channel = _Channel(write_fd, spec)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        rank_started(f"rank{spec['rank']}")
        _seat(spec).export_env()
        _prepare_item(item, spec)
        phases.enable(item.config.stash[settings_key].profile)
        capture_tmpfiles(item.config, run_dir)
        session = item.config.pluginmanager.get_plugin(CHILD_SESSION)
        if not isinstance(session, ChildSession):  # registered in the agent before it forked this child
            raise RuntimeError(f"a test child found no {CHILD_SESSION!r} plugin: the agent registers it")
        session.bind(channel, spec, listen_fd, relayed)
        bind_debugger(spec)
        set_progress_sink(lambda message: channel.send("progress", message=message))
        # Warnings go to the controller, which folds them over ranks into its summary.
        with record_warnings(item):
            runtestprotocol(item)
        _send_uncaptured_output(item.config, channel, run_dir)
        session.send_collectives_called()
        session.leave()
    except KeyboardInterrupt:
        channel.send(
            "interrupted", message=f"KeyboardInterrupt on rank {spec['rank']}", reason="got KeyboardInterrupt"
        )
        code = 2
    except pytest.exit.Exception as exc:  # pytest.exit(msg, returncode=N): the session ends as pytest's would
        code_arg = "" if exc.returncode is None else f", returncode={exc.returncode}"
        channel.send(
            "interrupted",
            message=f"{exc.msg} (pytest.exit on rank {spec['rank']})",
            returncode=exc.returncode,
            reason=f"called pytest.exit({exc.msg!r}{code_arg})",
        )
        code = 2
    except BaseException:
        traceback.print_exc()
        code = 70
    finally:
        try:
            save_rank_data()  # before the test can count as done: os._exit skips coverage's save
            sys.stdout.flush()
            sys.stderr.flush()
            if code == 0:
                channel.send(CHILD_DONE)
        finally:
            os._exit(code)
