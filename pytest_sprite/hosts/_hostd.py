"""One host of ``python -m pytest_sprite hosts``: its first process, and its ssh-like daemon (stdlib only).

Started by ``unshare`` in fresh network, UTS, mount and PID namespaces, so this is process 1 of the host:
it names the host, gives it its own ``/tmp`` and ``/dev/shm``, the run's ``/etc/hosts`` and the shared
directory, brings ``lo`` up and says ``ready``. Once the machine has given the host its address it reads
``serve ADDRESS`` on stdin and then starts the commands that a launcher-exec (``_rsh.py``) on any host of the
run asks for over TCP: the bootstrap a cluster's ``ssh`` is. When this process ends, the kernel ends every
process of the host, which is how the machine loses a host and how it removes one.

Run by path (``python _hostd.py``), not as a module: it imports nothing of the package.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

_TOKEN_ENV = "SPRITE_HOSTS_TOKEN"


_MS_BIND = 4096
_MS_REC = 16384


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    args = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def set_up(name: str, hosts_file: str, shared: str, carry: list[str]) -> None:
    """Name the host, give it its own /tmp and /dev/shm, the run's /etc/hosts and the shared directory.

    ``carry``: directories under /tmp that every host must still see (the virtual environment CI makes in
    /tmp, the directory the command runs in): held open, then bound again over the host's own /tmp.
    """
    socket.sethostname(name)
    held = {path: os.open(path, os.O_PATH) for path in carry if os.path.isdir(path)}
    for own in ("/tmp", "/dev/shm"):
        _mount(f"{own.rsplit('/', 1)[1]}-{name}", own, "tmpfs", 0, "mode=1777,size=2g")
    for path, fd in held.items():
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)
    _mount(hosts_file, "/etc/hosts", None, _MS_BIND)
    _mount(shared, shared, None, _MS_BIND)  # the shared file system: the same directory on every host
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, stdin=subprocess.DEVNULL)


def _frame(conn: socket.socket, kind: bytes, payload: bytes) -> None:
    conn.sendall(kind + struct.pack("!I", len(payload)) + payload)


class Daemon:
    """Starts commands on this host for launcher-execs that present the run's token."""

    def __init__(self, token: str, delay: float, extra_env: dict[str, str]) -> None:
        self.token = token
        self.delay = delay
        self.env = dict(os.environ)
        self.env.pop(_TOKEN_ENV, None)
        self.env.update(extra_env)
        self.lock = threading.Lock()
        self.ours: set[int] = set()
        """Pids of commands a connection waits for; everything else that ends here is an orphan to reap."""

    def serve(self, address: str) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen(64)
        print(f"port {listener.getsockname()[1]}", flush=True)
        threading.Thread(target=self._reap_orphans, daemon=True).start()
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _reap_orphans(self) -> None:
        """Process 1 inherits every orphan of the host; reap those no connection waits for."""
        while True:
            time.sleep(0.2)
            while True:
                try:
                    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    break
                if info is None:
                    break
                with self.lock:
                    if info.si_pid in self.ours:
                        break
                try:
                    os.waitpid(info.si_pid, 0)
                except ChildProcessError:
                    pass

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            request: dict[str, Any] = json.loads(conn.makefile("rb").readline() or b"{}")
            if request.get("token") != self.token:
                return
            if self.delay:
                time.sleep(self.delay)
            with self.lock:
                proc = subprocess.Popen(
                    request["argv"],
                    cwd=request.get("cwd") or "/",
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                self.ours.add(proc.pid)
            assert proc.stdout is not None
            try:
                while chunk := os.read(proc.stdout.fileno(), 65536):
                    _frame(conn, b"o", chunk)
                status = proc.wait()
                _frame(conn, b"x", str(status).encode())
            except OSError:  # the launcher-exec went away: so does what it started
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            finally:
                with self.lock:
                    self.ours.discard(proc.pid)


def main(argv: list[str]) -> int:
    name, hosts_file, shared, delay, extra, carry = argv
    set_up(name, hosts_file, shared, json.loads(carry))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "serve":
        return 1
    token = os.environ.get(_TOKEN_ENV, "")
    Daemon(token, float(delay), json.loads(extra)).serve(line[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
