"""N hosts on this machine: namespaces, a private bridge, names, a shared directory; and their removal.

Each host is a process 1 (``_hostd.py``) in fresh network, UTS, mount and PID namespaces made by
``unshare``: its own hostname, ``eth0`` with an address on the run's bridge, ``/etc/hosts`` naming every
host, its own ``/tmp``, ``/dev/shm`` and process table, and the run's shared directory (the cluster's shared
file system; the rest of this machine's files, the virtual environment among them, every host sees as a
cluster's nodes see their shared home). The bridge has no address: only the hosts' namespaces get one.

Every name the run makes in this machine's own namespace carries the run's id (bridge ``spb<id>``, veths
``sp<id>h<i>``, directory ``/var/tmp/sprite-hosts-<id>``), so two runs never collide, and a run that could
not clean up (its process was killed) is cleaned by the next one (:func:`clean_leftovers`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["ROOT", "Host", "Machine", "cannot_make_hosts", "clean_leftovers"]

ROOT = Path("/var/tmp")
"""Where each run's directory is made (not /tmp: every host has its own)."""
_PREFIX = "sprite-hosts-"
_HOSTD = Path(__file__).with_name("_hostd.py")
_RSH = Path(__file__).with_name("_rsh.py")
_PR_SET_PDEATHSIG = 1


def cannot_make_hosts() -> str | None:
    """Why this machine cannot make hosts (not root, a tool missing, no namespaces), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "hosts need root (network, UTS, mount and PID namespaces, a bridge); run as root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"hosts need `{tool}` ({package}), which is not on PATH"
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return "hosts launch the ranks with MPICH's mpiexec, which is not on PATH (pip install mpich)"
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if "HYDRA" not in version.stdout:  # another mpiexec ignores the hosts and the launcher-exec: one host
        said = (version.stdout or version.stderr).strip().splitlines()[:1] or [f"status {version.returncode}"]
        return (
            f"hosts launch the ranks with MPICH's mpiexec (hydra), and {mpiexec} is not it ({said[0]}); "
            f"put MPICH's first on PATH (pip install mpich)"
        )
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if probe.returncode != 0:
        return f"this machine refuses new namespaces (`unshare --net --uts --mount --pid`: {probe.stderr.strip()})"
    return None


def _carried() -> list[str]:
    """What of this machine's /tmp every host must still see: the Python environment, the package, the cwd."""
    package_home = Path(__file__).resolve().parents[2]  # the folder holding pytest_sprite/
    wanted = {sys.prefix, sys.base_prefix, os.getcwd(), str(package_home)}
    under = [p for p in wanted if any(p == d or p.startswith(d + "/") for d in ("/tmp", "/dev/shm"))]
    return sorted(under)


_DEFAULT_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when the process that started it dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def _holder_pid(unshare_pid: int, timeout: float = 10.0) -> int:
    """The process ``unshare --fork`` started in the new PID namespace (its only child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{unshare_pid}/task").glob("*"):
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.01)
    raise RuntimeError(f"unshare (pid {unshare_pid}) started no host process within {timeout:g}s")


def _is_hostd(pid: int) -> bool:
    try:
        return str(_HOSTD.name).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@dataclass(kw_only=True)
class Host:
    """One host of the run."""

    name: str
    index: int
    address: str
    veth: str
    """The host's end of its link, in this machine's namespace, on the bridge (``ip link set VETH down``)."""
    unshare: subprocess.Popen[bytes] | None = None
    pid: int = 0
    """Process 1 of the host, as this machine's namespace numbers it (``nsenter -t PID``)."""
    port: int = 0
    """Where the host's daemon takes launches (the launcher-exec's ssh port)."""
    lost: bool = False
    link_up: bool = True


@dataclass(kw_only=True)
class Machine:
    """The run's hosts: ``with Machine(2) as m: m.run(host, argv)``; leaving the block removes everything."""

    n: int
    delays: Mapping[str, float] = field(default_factory=dict)
    """Seconds a host's daemon waits before it starts a launch (a host slow to start)."""
    host_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Variables a host's daemon adds to what it starts (say, a stale RANK in that host's login environment)."""
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: list[Host] = field(default_factory=list)
    log: IO[str] = field(default=sys.stderr)
    _token: str = field(default_factory=lambda: secrets.token_hex(16))
    _control: threading.Thread | None = None
    _per_host: int | None = None
    _hostfile_written: bool = False

    # -- names ------------------------------------------------------------------------------------

    @property
    def workdir(self) -> Path:
        return ROOT / f"{_PREFIX}{self.run_id}"

    @property
    def shared(self) -> Path:
        """The directory every host sees (the cluster's shared file system), the default basetemp's parent."""
        return self.workdir / "shared"

    @property
    def bridge(self) -> str:
        return f"spb{self.run_id}"

    @property
    def subnet(self) -> str:
        a, b = int(self.run_id[:2], 16), int(self.run_id[2:4], 16)
        return f"10.{200 + a % 50}.{b}"

    @property
    def rsh(self) -> Path:
        """The launcher-exec (hydra's ``-launcher-exec``): ``rsh [-x] HOST COMMAND``."""
        return self.workdir / "rsh"

    @property
    def hostfile(self) -> Path:
        return self.workdir / "hostfile"

    @property
    def control_socket(self) -> Path:
        return self.workdir / "control.sock"

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in this run ({', '.join(h.name for h in self.hosts)})")

    # -- make -------------------------------------------------------------------------------------

    def __enter__(self) -> Machine:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        clean_leftovers()
        self.workdir.mkdir(mode=0o700, parents=True)
        self.shared.mkdir()
        self.shared.chmod(0o1777)
        (self.workdir / "owner").write_text(f"{os.getpid()}\n")
        self.hosts = [
            Host(name=f"host{i}", index=i, address=f"{self.subnet}.{i}", veth=f"sp{self.run_id}h{i}")
            for i in range(1, self.n + 1)
        ]
        table = [f"{h.address} {h.name}" for h in self.hosts]
        # a dual-stack listener (torch's TCPStore) sees IPv4 peers as ::ffff:A, which it names for its logs
        table += [f"::ffff:{h.address} {h.name}" for h in self.hosts]
        for host in self.hosts:
            # As Debian and Ubuntu install a node: its own name first on 127.0.1.1, which only it can reach
            # (what a listener or gloo bound to "this host's address" gets there), the others by address.
            lines = [
                "127.0.0.1 localhost",
                f"127.0.1.1 {host.name}",
                "::1 localhost ip6-localhost ip6-loopback",
            ]
            hosts_file = self._hosts_file(host)
            hosts_file.write_text("\n".join([*lines, *table]) + "\n")
            hosts_file.chmod(0o644)
        for host in self.hosts:
            self._start_host(host, self._hosts_file(host))
        self._save_state()
        _ip("link", "add", self.bridge, "type", "bridge")
        self._save_state()
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            self._wire(host)
        self._write_bootstrap()
        self._control = threading.Thread(target=self._serve_control, name="sprite-hosts-control", daemon=True)
        self._control.start()

    def _start_host(self, host: Host, hosts_file: Path) -> None:
        env = dict(os.environ, SPRITE_HOSTS_TOKEN=self._token)
        with open(self._host_log(host), "wb") as errors:  # the child keeps its own copy
            proc = subprocess.Popen(
                [
                    "unshare",
                    "--net",
                    "--uts",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    "--propagation",
                    "private",
                    "--kill-child=SIGKILL",
                    sys.executable,
                    "-I",
                    str(_HOSTD),
                    host.name,
                    str(hosts_file),
                    str(self.shared),
                    str(self.delays.get(host.name, 0.0)),
                    json.dumps(dict(self.host_env.get(host.name, {}))),
                    json.dumps(_carried()),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=env,
                start_new_session=True,  # a Ctrl-C at the terminal is the controller's; hosts end with the run
                preexec_fn=_die_with_parent,
            )
        host.unshare = proc
        host.pid = _holder_pid(proc.pid)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if line != "ready":
            raise RuntimeError(
                f"{host.name} did not start (its first process said {line!r}, status {proc.poll()}): "
                f"{self._host_errors(host)}"
            )

    def _hosts_file(self, host: Host) -> Path:
        return self.workdir / f"{host.name}.hosts"

    def _host_log(self, host: Host) -> Path:
        return self.workdir / f"{host.name}.log"

    def _host_errors(self, host: Host) -> str:
        """What the host's first process printed, less unshare's own notice when it is killed."""
        try:
            text = self._host_log(host).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(line for line in text.splitlines() if "sigprocmask" not in line).strip()

    def _wire(self, host: Host) -> None:
        """Link ``host`` to the bridge as its ``eth0`` with its address, then start its daemon there."""
        inner = f"sp{self.run_id}n{host.index}"
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        _ip("link", "set", inner, "netns", str(host.pid))
        commands = f"link set {inner} name eth0\naddr add {host.address}/24 dev eth0\nlink set eth0 up\n"
        done = subprocess.run(
            ["nsenter", "-t", str(host.pid), "--net", "ip", "-batch", "-"],
            input=commands,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"could not give {host.name} its address: {done.stderr.strip()}")
        assert host.unshare is not None and host.unshare.stdin is not None and host.unshare.stdout is not None
        host.unshare.stdin.write(f"serve {host.address}\n".encode())
        host.unshare.stdin.flush()
        line = host.unshare.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"{host.name}'s daemon did not start (it said {' '.join(line)!r})")
        host.port = int(line[1])

    def _write_bootstrap(self) -> None:
        table = self.workdir / "table.json"
        table.write_text(json.dumps({"token": self._token, "ports": {h.name: h.port for h in self.hosts}}))
        table.chmod(0o600)
        self.rsh.write_text(f'#!/bin/sh\nexec {sys.executable} -I {_RSH} {table} "$@"\n')
        self.rsh.chmod(0o700)

    def write_hostfile(self, per_host: int | None) -> Path:
        """Hydra's host file: every host of the run that is left, with ``per_host`` slots when given.

        A host lost or cut off leaves the file before the fault is made, as a scheduler drops a failed
        node: a later launch (the session's fresh world after a lost agent) places every rank on the hosts
        left, rather than racing its tests against its launch failing on the host it cannot reach.
        """
        self._per_host = per_host
        self._hostfile_written = True
        self._rewrite_hostfile()
        return self.hostfile

    def _rewrite_hostfile(self) -> None:
        if not self._hostfile_written:
            return
        suffix = f":{self._per_host}" if self._per_host else ""
        left = [h for h in self.hosts if not h.lost and h.link_up]
        staged = self.hostfile.with_suffix(".new")
        staged.write_text("".join(f"{h.name}{suffix}\n" for h in left))
        os.replace(staged, self.hostfile)  # a launch reading it sees the old list or the new, whole

    def _save_state(self) -> None:
        state = {
            "owner": os.getpid(),
            "bridge": self.bridge,
            "veths": [h.veth for h in self.hosts],
            "pids": [h.pid for h in self.hosts if h.pid],
        }
        (self.workdir / "state.json").write_text(json.dumps(state))

    # -- use --------------------------------------------------------------------------------------

    def enter(self, host: Host, *, cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """The words that run a command in ``host``'s namespaces (its network, name, files and processes)."""
        return [
            "nsenter",
            "-t",
            str(host.pid),
            "--net",
            "--uts",
            "--mount",
            "--pid",
            f"--wd={os.fspath(cwd or os.getcwd())}",
            "--",
        ]

    def run(self, host: Host, argv: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (it inherits this process's terminal and environment unless told).

        A Ctrl-C at the terminal reaches ``argv`` (pytest stops and says so) but not ``nsenter``, which
        stays to report ``argv``'s exit status: nsenter ignores SIGINT, and ``argv`` gets it back.
        """
        words = [*self.enter(host), sys.executable, "-c", _DEFAULT_SIGINT, *argv]
        return subprocess.Popen(words, preexec_fn=_ignore_sigint, **popen)  # type: ignore[call-overload, no-any-return]

    def kill_host(self, name: str) -> str:
        """Lose ``name``: SIGKILL its process 1, which ends every process of the host at once."""
        host = self.host(name)
        host.lost = True
        self._rewrite_hostfile()
        os.kill(host.pid, signal.SIGKILL)
        return f"killed every process of {name}{self._hosts_left()}"

    def set_link(self, name: str, up: bool) -> str:
        """Cut (or restore) ``name``'s link to the bridge."""
        host = self.host(name)
        host.link_up = up
        self._rewrite_hostfile()
        try:
            _ip("link", "set", host.veth, "up" if up else "down")
        except RuntimeError:
            host.link_up = not up
            self._rewrite_hostfile()
            raise
        return f"{name}'s link {host.veth} is {'up' if up else 'down'}{self._hosts_left()}"

    def _hosts_left(self) -> str:
        if not self._hostfile_written:
            return ""
        left = [h.name for h in self.hosts if not h.lost and h.link_up]
        return f"; later launches place their ranks on {', '.join(left) or 'no host'}"

    def _serve_control(self) -> None:
        """Answer ``kill HOST`` / ``link HOST down|up`` on the control socket (faults a test plants)."""
        import socket

        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.control_socket))
        self.control_socket.chmod(0o600)
        server.listen(8)
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                words = conn.makefile("r").readline().split()
                try:
                    if len(words) == 2 and words[0] == "kill":
                        reply = "ok " + self.kill_host(words[1])
                    elif len(words) == 3 and words[0] == "link" and words[2] in ("up", "down"):
                        reply = "ok " + self.set_link(words[1], words[2] == "up")
                    else:
                        reply = f"error: unknown request {' '.join(words)!r}"
                except (KeyError, RuntimeError, OSError) as exc:
                    reply = f"error: {exc}"
                print(f"pytest-sprite hosts: {reply.removeprefix('ok ')}", file=self.log, flush=True)
                conn.sendall(reply.encode() + b"\n")

    # -- remove -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove everything the run made: every process of every host, the links, the bridge, the files."""
        for host in self.hosts:
            if host.pid and _is_hostd(host.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host.pid, signal.SIGKILL)
            if host.unshare is not None:
                for stream in (host.unshare.stdin, host.unshare.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.unshare.wait(timeout=10)
        for host in self.hosts:
            errors = self._host_errors(host)
            if errors:
                print(f"pytest-sprite hosts: {host.name} printed:\n{errors}", file=self.log)
            _ip("link", "del", host.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _leftover_dirs() -> Iterator[Path]:
    if ROOT.is_dir():
        yield from ROOT.glob(f"{_PREFIX}*")


def clean_leftovers() -> list[str]:
    """Remove what earlier runs left when their process was killed (their owner is gone); say what."""
    removed: list[str] = []
    for directory in _leftover_dirs():
        try:
            state = json.loads((directory / "state.json").read_text())
        except (OSError, ValueError):
            state = {}
        owner = state.get("owner")
        if owner is None:
            with contextlib.suppress(OSError, ValueError):
                owner = int((directory / "owner").read_text())
        if owner is not None and Path(f"/proc/{owner}").exists():
            continue  # a run in progress
        if owner is None and time.time() - directory.stat().st_mtime < 60:
            continue  # a run that is still writing its first file
        for pid in state.get("pids", []):
            if _is_hostd(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for name in [*state.get("veths", []), state.get("bridge")]:
            if name and _ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(str(directory))
    return removed
