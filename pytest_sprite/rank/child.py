"""Test child: one fresh process per rank per ranks test.

Initializes the device and the default process group, runs pytest's own protocol for the item
(``runtestprotocol(item, log=False)``), streams each report to its agent as soon as it is made, and
ends with ``os._exit`` so no exit handler can turn a passed test into a crash (the seed's Aurora
FSDP2 + Triton exit segfault).
"""

from __future__ import annotations

import base64
import faulthandler
import io
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from .. import world as _world
from .._device import select_device
from .._rankenv import LAUNCHER_VARIABLES
from .._wire import CHILD_DONE, encode_frame
from ..world import World

if TYPE_CHECKING:
    import torch

__all__ = ["ChildSpec", "run_child", "run_spare"]


@dataclass(frozen=True, kw_only=True)
class ChildSpec:
    """Where this child sits in the test's world (sent by the controller with ``run``)."""

    run_id: int
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node: int
    master_addr: str
    master_port: int
    device: str
    timeout: float
    listen_fd: int | None = None
    """Rank 0: an already listening socket for the rendezvous store (see the agent's reserve_port)."""


class _Channel:
    """Frames from this child to its agent, which relays them to the controller."""

    def __init__(self, fd: int, spec: ChildSpec) -> None:
        self.fd = fd
        self.spec = spec

    def send(self, event: str, **payload: Any) -> None:
        data = encode_frame(event, {"run_id": self.spec.run_id, "rank": self.spec.rank, **payload})
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def collect(self, name: str, rank: int, tensor: torch.Tensor) -> None:
        import torch

        buf = io.BytesIO()
        torch.save(tensor, buf)
        self.send("collected", name=name, tensor=base64.b64encode(buf.getvalue()).decode("ascii"))


class ChildSession:
    """Pytest hooks active inside a test child only."""

    def __init__(self, channel: _Channel, spec: ChildSpec) -> None:
        self.channel = channel
        self.spec = spec
        self.store: Any = None

    def leave(self) -> None:
        """Before exiting, make sure no peer still needs this process for its rendezvous.

        Every rank waits until every rank has finished ``init_process_group`` (a peer still building
        gloo's full mesh would otherwise meet a closed connection), and rank 0, which hosts the store,
        waits until every rank has checked out of it. Bounded: a rank that died never arrives, and the
        controller ends the waiting ranks after the grace period anyway.
        """
        if self.store is None:
            return
        from .._timing import monotonic, sleep

        deadline = monotonic() + 30.0
        try:
            for key, delta, waits in (("sprite/ready", 0, True), ("sprite/done", 1, self.spec.rank == 0)):
                count = self.store.add(key, delta)
                while waits and count < self.spec.world_size and monotonic() < deadline:
                    sleep(0.002)
                    count = self.store.add(key, 0)
        except Exception:  # a peer's crash can break the store; the test's result is already sent
            pass

    @pytest.hookimpl
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Initialize device and process group before fixtures, so a failure is a setup error."""
        _world._set_current(self._init_world())

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        data = item.config.hook.pytest_report_to_serializable(config=item.config, report=report)
        self.channel.send("report", report=data)
        return report

    def _init_world(self) -> World:
        import torch
        import torch.distributed as dist

        spec = self.spec
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_size))
        device, backend = select_device(spec.device, spec.local_rank, spec.local_size)
        if not dist.is_initialized():
            timeout = timedelta(seconds=spec.timeout + 60)
            store = dist.TCPStore(
                spec.master_addr,
                spec.master_port,
                world_size=spec.world_size,
                is_master=spec.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=spec.listen_fd if spec.rank == 0 else None,
            )
            dist.init_process_group(
                backend=backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
            )
            store.add("sprite/ready", 1)
            self.store = store
        return World(
            rank=spec.rank,
            size=spec.world_size,
            local_rank=spec.local_rank,
            local_size=spec.local_size,
            node=spec.node,
            device=device,
            backend=backend,
            _sink=self.channel.collect,
        )


def _redirect_output(run_dir: Path) -> None:
    """Send fd 1 and 2 to a file the agent can read after a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(run_dir / "output.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _install_stack_dumps(run_dir: Path) -> None:
    """Crash tracebacks go to the output file; SIGUSR1 (the agent's abort) dumps every thread's stack."""
    output = open(run_dir / "output.log", "a")  # kept open for the life of the child
    faulthandler.enable(file=output, all_threads=True)
    stacks = open(run_dir / "stacks.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    _KEEP.extend([output, stacks])


_KEEP: list[Any] = []


# Set by MPI process managers for the agent's own launch; a child must not inherit them either.
_PMI_PLUMBING = ("PMI_FD", "PMI_PORT", "PMI_HOSTNAME", "PMI_ID", "PMIX_NAMESPACE", "PMIX_SERVER_URI2")


def _export_env(spec: ChildSpec) -> None:
    """The variables torchrun would set, so a Lightning Trainer(devices=n) uses these processes.

    The agent's own launcher variables (PMI_SIZE=4 beside a test's WORLD_SIZE=2, SLURM_NTASKS, ...)
    describe the session's launch, not this test's world: they are removed, so the rank reader,
    Lightning's cluster detection and mpi4py in the child see only the test's ranks.
    """
    for family, names in LAUNCHER_VARIABLES.items():
        if family != "torchrun":
            for name in names:
                os.environ.pop(name, None)
    for name in _PMI_PLUMBING:
        os.environ.pop(name, None)
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.local_rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.local_size),
        NODE_RANK=str(spec.node),
        GROUP_RANK=str(spec.node),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )


def _all_fixturedefs(item: pytest.Item) -> list[Any]:
    """Every fixture definition the session knows (pytest's private registry changed shape in 9.2).

    Falls back to the item's own closure, which covers every fixture it requests by name.
    """
    manager = item.session._fixturemanager  # type: ignore[attr-defined]
    if hasattr(manager, "_get_all_fixture_defs"):  # pytest >= 9.2
        return list(manager._get_all_fixture_defs())
    if hasattr(manager, "_arg2fixturedefs"):  # pytest 8.0 - 9.1
        return [fd for defs in manager._arg2fixturedefs.values() for fd in defs]
    info = getattr(item, "_fixtureinfo", None)
    return [fd for defs in info.name2fixturedefs.values() for fd in defs] if info is not None else []


def _fresh_pytest_state(item: pytest.Item) -> None:
    """Forget fixtures and setup state inherited through fork: every child sets up its own."""
    from _pytest.runner import SetupState

    session = item.session
    session._setupstate = SetupState()  # type: ignore[attr-defined]
    for fixturedef in _all_fixturedefs(item):
        fixturedef.cached_result = None
        finalizers = getattr(fixturedef, "_finalizers", None)
        if finalizers is not None:
            finalizers.clear()
    # No debugger prompt in a rank without a terminal.
    for name in ("pdbinvoke", "pdbtrace"):
        plugin = item.config.pluginmanager.get_plugin(name)
        if plugin is not None:
            item.config.pluginmanager.unregister(plugin)


def _capture_to_files(config: pytest.Config, run_dir: Path) -> None:
    """Point pytest's fd capture at named files, so a crash's captured output can be read back.

    The new file is dup'd onto the capture's own descriptor, so every holder of that file object
    (a logging handler made at collection time holds ``sys.stderr`` as it was then) keeps writing
    to a valid file. pytest snapshots and truncates it per phase; after a crash it holds the running
    phase's output. Other capture modes keep pytest's own temporary files.
    """
    from _pytest.capture import FDCapture

    capman = config.pluginmanager.get_plugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)
    for attr, name in (("out", "capture-out.log"), ("err", "capture-err.log")):
        cap = getattr(capturing, attr, None)
        if not isinstance(cap, FDCapture):
            continue
        fd = os.open(run_dir / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, cap.tmpfile.fileno())
        os.close(fd)


def _send_uncaptured_output(config: pytest.Config, channel: _Channel, run_dir: Path) -> None:
    """With ``-s`` the user wants to see what each rank printed: send it for the controller to show."""
    if config.getoption("capture", None) != "no":
        return
    text = (run_dir / "output.log").read_text(errors="replace")
    if text.strip():
        channel.send("output", text=text)


def _die_with_parent(agent_pid: int) -> None:
    """Ask Linux to kill this child when its agent dies, so a lost agent leaves no rank behind.

    Without it, a child waiting in a collective outlives an agent killed by the launcher or the OOM
    killer. No-op where prctl is unavailable.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != agent_pid:  # the agent died before prctl took effect
        os._exit(1)


def run_spare(
    *,
    control: socket.socket,
    items: Mapping[str, pytest.Item],
    write_fd: int,
    run_dir: Path,
    agent_pid: int,
) -> NoReturn:
    """Body of a spare child: prepare what no test decides, wait for the test, run it; never returns.

    The agent sends ``{"run_id", "nodeid", **ChildSpec fields}`` as JSON, with rank 0's listening
    rendezvous socket attached (SCM_RIGHTS); EOF means the spare is not needed.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(agent_pid)
    _redirect_output(run_dir)
    _install_stack_dumps(run_dir)
    message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
    control.close()
    if not message:
        os._exit(0)
    request = json.loads(message)
    item = items[request.pop("nodeid")]
    run_child(item=item, write_fd=write_fd, run_dir=run_dir, listen_fd=fds[0] if fds else None, **request)


def run_child(
    *, item: pytest.Item, write_fd: int, run_dir: Path, run_id: int, **spec_fields: Any
) -> NoReturn:
    """Run one item as one rank and end the process; never returns. Output is already redirected."""
    code = 0
    spec = ChildSpec(run_id=run_id, **spec_fields)
    channel = _Channel(write_fd, spec)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _export_env(spec)
        _fresh_pytest_state(item)
        _capture_to_files(item.config, run_dir)
        session = ChildSession(channel, spec)
        item.config.pluginmanager.register(session, "sprite-child")
        from _pytest.runner import runtestprotocol

        runtestprotocol(item, log=False, nextitem=None)
        _send_uncaptured_output(item.config, channel, run_dir)
        session.leave()
    except KeyboardInterrupt:
        channel.send("interrupted", message=f"KeyboardInterrupt on rank {spec.rank}")
        code = 2
    except BaseException:
        traceback.print_exc()
        code = 70
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            if code == 0:
                channel.send(CHILD_DONE)
        finally:
            os._exit(code)
