"""A warm interpreter for the project's own pytest sessions: torch, Lightning, transformers and peft imported once.

Most of this project's tests run a pytest session of their own (a ranks session forks its agents from its own
process, so it cannot run inside the test's). On the 2-core CI machine a fresh ``python -m pytest`` spends 3 s
importing torch and 6 s more when the session touches Lightning, transformers or peft: more than most sessions'
work. This module is both ends of a fork server that removes that cost:

- ``serve``: a fresh interpreter imports those libraries once (never pytest nor pytest_sprite, which every
  session imports itself, as a fresh interpreter would), then forks one process per request. The fork takes
  the caller's working directory, environment, ``sys.path`` (``python -m`` puts the directory first, then
  ``PYTHONPATH``) and standard streams, reseeds what a fresh interpreter seeds, and runs ``python -m pytest``
  through :mod:`runpy`. It ends with the test process that started it.
- the client (run with ``python -I -S``, the stdlib only, 20 ms): sends its own directory, environment,
  arguments and descriptors 0-2, waits, and exits as the session did (the same code, or the same signal).
  ``pytester.run`` starts it, so output capture, timeouts and ``RunResult`` stay pytest's own; when pytester
  kills it on a timeout, the server kills the session.

``tests/sprite_testing.py`` uses it for every session; a test about what a fresh interpreter imports asks for
``fresh=True`` (a real ``python -m pytest``). Set ``SPRITE_TEST_WARM=0`` to run every session cold.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

_HEADER = struct.Struct("!I")
WARM_IMPORTS = ("torch", "torch.distributed", "lightning.pytorch", "transformers", "peft")
"""Imported once by the server: what makes a fresh session slow, and reads nothing of the session's options."""
STARTUP_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Read by the interpreter or the libraries as they load: kept out of the server's own start (see ``_child``)."""


# -- the client --------------------------------------------------------------------------------------------------


def client(path: str, args: list[str]) -> None:
    """Ask the server at ``path`` for ``python -m pytest *args`` here, with this process's streams; exit as it did."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    body = json.dumps({"cwd": os.getcwd(), "env": dict(os.environ), "args": args}).encode()
    socket.send_fds(sock, [_HEADER.pack(len(body))], [0, 1, 2])
    sock.sendall(body)
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    if not answer:
        sys.stderr.write("warm_python: the server ended without an answer\n")
        os._exit(70)
    ended = json.loads(answer)
    if ended.get("signal"):
        signal.signal(ended["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), ended["signal"])
    os._exit(int(ended.get("exit", 70)))


# -- the server --------------------------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import the warm libraries, then fork a session for every client until the parent process ends."""
    parent = os.getppid()
    for name in WARM_IMPORTS:
        try:
            __import__(name)
        except ImportError:
            pass
    leaked = [name for name in ("pytest", "_pytest", "pytest_sprite") if name in sys.modules]
    if leaked:
        raise SystemExit(f"warm_python: the warm imports loaded {leaked}; a session must import them itself")
    from importlib.metadata import entry_points

    # pytest rewrites the asserts of its plugins' packages as it loads them, and warns about one already
    # imported (Lightning and transformers import anyio): each session drops them and imports them anew.
    plugins = {e.value.split(":")[0].split(".")[0] for e in entry_points(group="pytest11")}
    plugins &= {name.split(".")[0] for name in sys.modules}
    base_path = [p for p in sys.path[1:] if p]  # the server's own directory comes first: not a session's
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients see the socket only once the imports are done
    running: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *running.values()], [], [], 0.05)
        for pid, conn in list(running.items()):
            if conn in ready:  # the client died (pytester's timeout killed it): end its session
                _kill(pid)
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                del running[pid]
                _answer(conn, status)
        if listener in ready:
            conn, _ = listener.accept()
            pid = _fork_session(conn, listener, running, base_path, plugins)
            if pid is not None:
                running[pid] = conn
    for pid in running:
        _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _answer(conn: socket.socket, status: int) -> None:
    ended = (
        {"signal": os.WTERMSIG(status)}
        if os.WIFSIGNALED(status)
        else {"exit": os.waitstatus_to_exitcode(status)}
    )
    try:
        conn.sendall(json.dumps(ended).encode())
    except OSError:
        pass
    conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the client left mid-request")
        data += chunk
    return data


def _fork_session(
    conn: socket.socket,
    listener: socket.socket,
    running: dict[int, socket.socket],
    base_path: list[str],
    plugins: set[str],
) -> int | None:
    try:
        head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        (size,) = _HEADER.unpack(head)
        request = json.loads(_recv_exact(conn, size))
    except (OSError, EOFError, ValueError):
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for other in (conn, *running.values()):
                other.close()
            _child(request, fds, base_path, plugins)
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    return pid


def _child(request: dict[str, Any], fds: list[int], base_path: list[str], plugins: set[str]) -> None:
    """Become ``python -m pytest *args`` started in the client's directory, environment and streams."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    cwd, env, args = request["cwd"], request["env"], request["args"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *python_path, *base_path]
    for name in [n for n in sys.modules if n.split(".")[0] in plugins]:
        del sys.modules[name]
    _fresh_state(env)
    import runpy

    sys.argv = ["-m", *args]
    code: Any = 0
    try:
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    os._exit(code)


def _fresh_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would differ in: seeds drawn at start, and thread counts read as torch loads."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _main() -> None:
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[2], sys.argv[3:])


if __name__ == "__main__":
    _main()
