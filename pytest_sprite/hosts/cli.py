"""``python -m pytest_sprite hosts N -- <pytest command>``: run a pytest command across N hosts made here.

The controller runs on host1; ``--ranks`` is spread evenly over the hosts by MPICH's ``mpiexec`` (hydra), whose
ssh launcher reaches each host through the run's launcher-exec (``rsh``, a daemon on every host). The command
gets ``--launcher=mpiexec``, ``--ppn=R/N`` and, unless it names one, ``--basetemp`` in the shared directory.
Exit status: pytest's; 6 when this machine cannot make hosts (the reason is printed); 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .crossings import Crossings
from .machine import Machine, cannot_make_hosts

__all__ = ["UNAVAILABLE", "main"]

UNAVAILABLE = 6
"""Exit status when this machine cannot make hosts (not root, no ``ip``, no namespaces, no mpiexec)."""

_PREFIX = "pytest-sprite hosts:"


def _option(words: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in a pytest command line (``--name=V`` or ``--name V``), the last one given."""
    value = None
    for i, word in enumerate(words):
        if word.startswith(name + "="):
            value = word.split("=", 1)[1]
        elif word == name and i + 1 < len(words):
            value = words[i + 1]
    return value


def _mpich_version() -> str:
    out = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    for line in out.stdout.splitlines():
        if line.strip().startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return ""


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_sprite hosts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("n", type=int, metavar="N", help="number of hosts (2 or more)")
    parser.add_argument(
        "--delay", action="append", default=[], metavar="HOST=SECONDS", help="host slow to start its ranks"
    )
    parser.add_argument(
        "--host-env",
        action="append",
        default=[],
        metavar="HOST:NAME=VALUE",
        help="a variable in one host's login environment (a stale RANK, say)",
    )
    words = list(argv)
    if "--" not in words:
        parser.parse_args(words)  # -h: the help
        parser.error("give the pytest command after --: hosts N [options] -- pytest ...")
    split = words.index("--")
    args = parser.parse_args(words[:split])
    args.command = words[split + 1 :]
    if not args.command:
        parser.error("give the pytest command after --")
    if args.n < 2:
        parser.error("N must be 2 or more")
    return args


def check_command(command: Sequence[str], n: int) -> int | None:
    """Ranks per host for a pytest command (None: not given, or not pytest); refuses what cannot run here."""
    if not _is_pytest(command):
        return None
    launcher = _option(command, "--launcher")
    if launcher not in (None, "mpiexec"):
        raise SystemExit(f"{_PREFIX} the hosts are reached through --launcher=mpiexec, not {launcher}")
    ranks_text = _option(command, "--ranks")
    if ranks_text is None:
        return None
    if not ranks_text.isdigit() or int(ranks_text) % n:
        raise SystemExit(f"{_PREFIX} --ranks={ranks_text} does not spread evenly over {n} hosts")
    return int(ranks_text) // n


def prepare_command(
    command: Sequence[str], machine: Machine, n: int
) -> tuple[list[str], dict[str, str], int | None]:
    """The command with the launcher, ranks per host and basetemp; the environment that reaches the hosts.

    Any command but pytest runs on host1 as it is (its own ``mpiexec`` still reaches every host).
    """
    words = list(command)
    per_host = check_command(words, n)
    if _is_pytest(words):
        if _option(words, "--launcher") is None:
            words.append("--launcher=mpiexec")
        if per_host is not None and _option(words, "--ppn") is None:
            words.append(f"--ppn={per_host}")
        if _option(words, "--basetemp") is None:
            words.append(f"--basetemp={machine.shared / 'basetemp'}")
    env = {
        "HYDRA_LAUNCHER": "ssh",
        "HYDRA_LAUNCHER_EXEC": str(machine.rsh),
        "HYDRA_HOST_FILE": str(machine.write_hostfile(per_host)),
        "SPRITE_HOSTS": ",".join(h.name for h in machine.hosts),
        "SPRITE_HOSTS_CONTROL": str(machine.control_socket),
        "SPRITE_HOSTS_SHARED": str(machine.shared),
    }
    return words, env, per_host


def _is_pytest(words: Sequence[str]) -> bool:
    """``pytest ...``, ``py.test ...`` or ``python -m pytest ...``, alone or under ``coverage run``."""
    if not words:
        return False
    if Path(words[0]).name in ("pytest", "py.test"):
        return True
    if len(words) >= 3 and words[1:3] == ["-m", "pytest"]:
        return True
    return _coverage_runs_pytest(words)


def _coverage_runs_pytest(words: Sequence[str]) -> bool:
    """``coverage run [OPTIONS] -m pytest ...`` or ``python -m coverage run [OPTIONS] -m pytest ...``."""
    if Path(words[0]).name == "coverage":
        rest = list(words[1:])
    elif words[1:3] == ["-m", "coverage"]:
        rest = list(words[3:])
    else:
        return False
    if not rest or rest[0] != "run" or "-m" not in rest:
        return False
    module = rest.index("-m") + 1
    return module < len(rest) and rest[module] == "pytest"


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    check_command(args.command, args.n)  # a command that cannot run is refused before anything is made
    reason = cannot_make_hosts()
    if reason is not None:
        print(f"{_PREFIX} cannot make hosts on this machine: {reason}", file=sys.stderr)
        return UNAVAILABLE
    delays, host_env = _host_options(args)
    interrupted: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        if signum != signal.SIGINT and child is not None:  # Ctrl-C reaches pytest from the terminal itself
            _signal_children(child.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    try:
        with Machine(n=args.n, delays=delays, host_env=host_env) as machine:
            words, env, per_host = prepare_command(args.command, machine, args.n)
            _say_made(machine, time.monotonic() - started, per_host, words)
            crossings = Crossings(machine.hosts)
            crossings.start()
            child = machine.run(machine.hosts[0], words, env=dict(os.environ, **env))
            status = _wait(child, interrupted)
            crossings.stop()
            lost = [h.name for h in machine.hosts if h.lost]
        _say_crossed(crossings)
        print(
            f"{_PREFIX} pytest exited {status}; removed {args.n} hosts, their links, bridge {machine.bridge} "
            f"and {machine.workdir}" + (f" (lost during the run: {', '.join(lost)})" if lost else ""),
            file=sys.stderr,
        )
        return status
    except RuntimeError as exc:
        print(f"{_PREFIX} {exc}", file=sys.stderr)
        return UNAVAILABLE
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _host_options(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """``--delay HOST=SECONDS`` and ``--host-env HOST:NAME=VALUE``, by host."""
    delays = {}
    for item in args.delay:
        host, _, seconds = item.partition("=")
        delays[host] = float(seconds)
    host_env: dict[str, dict[str, str]] = {}
    for item in args.host_env:
        host, _, assignment = item.partition(":")
        name, _, value = assignment.partition("=")
        host_env.setdefault(host, {})[name] = value
    return delays, host_env


def _say_made(machine: Machine, made: float, per_host: int | None, words: Sequence[str]) -> None:
    """What was made, which launcher runs the command, and the command as host 1 runs it."""
    print(
        f"{_PREFIX} {len(machine.hosts)} hosts on bridge {machine.bridge} ({machine.subnet}.0/24, made in "
        f"{made:.1f}s): " + ", ".join(f"{h.name} {h.address}" for h in machine.hosts),
        file=sys.stderr,
    )
    print(
        f"{_PREFIX} launcher: MPICH mpiexec (hydra {_mpich_version()}), its ssh launcher through "
        f"{machine.rsh}, {per_host or 'default'} ranks per host; controller on host1",
        file=sys.stderr,
    )
    print(
        f"{_PREFIX} shared directory {machine.shared}; /tmp, /dev/shm and processes are each host's own",
        file=sys.stderr,
    )
    print(f"{_PREFIX} host1$ {shlex.join(words)}", file=sys.stderr, flush=True)


def _say_crossed(crossings: Crossings) -> None:
    """The connections seen between hosts: the proof that the run did not stay on one."""
    print(f"{_PREFIX} what crossed hosts (client -> server, TCP connections seen):", file=sys.stderr)
    try:
        crossed = crossings.lines() or ["nothing"]
    except (KeyError, ValueError, TypeError) as exc:  # never let the summary cost the exit status
        crossed = [f"could not say ({exc!r})"]
    for line in crossed:
        print(f"    {line}", file=sys.stderr)


def _wait(child: subprocess.Popen[bytes], interrupted: list[int]) -> int:
    """pytest's exit status; after a signal, it gets 60 s to end by itself before the hosts go anyway."""
    deadline: float | None = None
    while True:
        try:
            status = child.wait(timeout=0.5)
            return 128 - status if status < 0 else status
        except subprocess.TimeoutExpired:
            pass
        if interrupted and deadline is None:
            deadline = time.monotonic() + 60
        if deadline is not None and time.monotonic() > deadline:
            _signal_children(child.pid, signal.SIGKILL)
            child.wait()
            return 128 + interrupted[0]


def _signal_children(pid: int, sig: int) -> None:
    """Signal what ``nsenter`` (``pid``) started: the pytest command, in host1's namespaces."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                os.kill(int(child), sig)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
