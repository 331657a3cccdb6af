"""Helpers shared by the project's own tests: one way to run a pytester session, one fnmatch escape, one way to
look like a process no launcher started."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_sprite.glue.options import Settings

WARM_SCRIPT = Path(__file__).with_name("warm_python.py")
_WARM_START_S = 300.0
"""Seconds the warm interpreter may take to import its libraries (9 s on the 2-core CI machine)."""


class _Warm:
    """The warm interpreter of this test process (``warm_python.py``), started once, waited for on first use."""

    process: subprocess.Popen[bytes] | None = None
    path = ""
    log = ""


def start_warm_python() -> None:
    """Start this process's warm interpreter in the background (its imports overlap the first tests).

    ``SPRITE_TEST_WARM=0`` leaves it off: every session then starts a fresh interpreter.
    """
    if _Warm.process is not None or os.environ.get("SPRITE_TEST_WARM", "1") == "0":
        return
    from warm_python import STARTUP_ENV

    home = tempfile.mkdtemp(prefix="sprite-warm-")
    _Warm.path, _Warm.log = os.path.join(home, "socket"), os.path.join(home, "log")
    env = {k: v for k, v in os.environ.items() if k not in STARTUP_ENV}
    with open(_Warm.log, "wb") as log:
        _Warm.process = subprocess.Popen(
            [sys.executable, str(WARM_SCRIPT), "serve", _Warm.path],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C at the terminal ends the test process; it follows
        )
    atexit.register(_stop_warm_python)


def _stop_warm_python() -> None:
    if _Warm.process is not None and _Warm.process.poll() is None:
        _Warm.process.kill()
        _Warm.process.wait()


def _warm_socket() -> str | None:
    """The warm interpreter's socket once it is serving; None when it is off."""
    start_warm_python()
    process = _Warm.process
    if process is None:
        return None
    deadline = time.monotonic() + _WARM_START_S
    while not os.path.exists(_Warm.path):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"the warm interpreter (tests/warm_python.py) did not start; its output:\n"
                f"{Path(_Warm.log).read_text(errors='replace')}\nSPRITE_TEST_WARM=0 runs every session cold"
            )
        time.sleep(0.05)
    return _Warm.path


def fnescape(text: str) -> str:
    """``text`` as a literal fnmatch pattern (pytester's fnmatch_lines treats [] * ? as wildcards)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)


def run_pytest(
    pytester: pytest.Pytester,
    *args: str,
    timeout: float,
    flags: Sequence[str] = (),
    fresh: bool = False,
    cache: bool = False,
) -> pytest.RunResult:
    """A pytest session in a subprocess of the pytester folder (a ranks session needs its own process).

    It is ``runpytest_subprocess``, forked from this process's warm interpreter (``warm_python.py``: torch and
    the training libraries already imported) unless ``fresh`` asks for a fresh ``python -m pytest`` (a test
    of what a fresh interpreter imports). The cache provider stays off unless ``cache`` (a test of ``--lf``):
    it would write ``.pytest_cache`` into the folder the assertions read. ``flags`` come before ``args`` (a file's usual ``-v``), so a test's own
    arguments win.
    """
    argv = (*(() if cache else ("-p", "no:cacheprovider")), *flags, *args)
    server = None if fresh else _warm_socket()
    if server is None:
        return pytester.runpytest_subprocess(*argv, timeout=timeout)
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    plugins: list[str] = []
    for plugin in pytester.plugins:
        if not isinstance(plugin, str):
            raise ValueError(f"a pytester session in a subprocess takes plugins by name, not {plugin!r}")
        plugins += ["-p", plugin]
    return pytester.run(
        sys.executable,
        "-I",
        "-S",
        str(WARM_SCRIPT),
        "client",
        server,
        *plugins,
        f"--basetemp={basetemp}",
        *argv,
        timeout=timeout,
    )


class Terminal:
    """A pytest session whose stdin, stdout and stderr are a pseudo terminal, driven as a user types.

    Every read has a deadline (the session's ``timeout``): a prompt that never comes fails the test with
    everything the session wrote, never hangs it.
    """

    def __init__(self, process: subprocess.Popen[bytes], master: int, timeout: float) -> None:
        self.process = process
        self.master = master
        self.deadline = time.monotonic() + timeout
        self.output = ""
        """Everything the session wrote so far (carriage returns dropped)."""
        self._seen = 0

    def _read(self) -> bool:
        """Read what the session wrote; False at its end (the terminal closed)."""
        import select

        left = self.deadline - time.monotonic()
        if left <= 0:
            self.process.kill()
            raise AssertionError(f"the session outlived its deadline; it wrote:\n{self.output}")
        readable, _, _ = select.select([self.master], [], [], min(left, 1.0))
        if not readable:
            return True
        try:
            data = os.read(self.master, 1 << 16)
        except OSError:  # EIO: every process holding the terminal ended
            return False
        self.output += data.decode(errors="replace").replace("\r", "")
        return bool(data)

    def expect(self, text: str) -> str:
        """Wait until the session writes ``text``; what it wrote since the last expectation, ``text`` included."""
        while (found := self.output.find(text, self._seen)) < 0:
            if not self._read():
                raise AssertionError(f"the session ended before writing {text!r}; it wrote:\n{self.output}")
        start, self._seen = self._seen, found + len(text)
        return self.output[start : self._seen]

    def send(self, line: str) -> None:
        """Type ``line`` and Enter."""
        os.write(self.master, line.encode() + b"\n")

    def finish(self) -> int:
        """Wait for the session to end; its exit status."""
        while self._read():
            pass
        left = max(1.0, self.deadline - time.monotonic())
        code = self.process.wait(timeout=left)
        os.close(self.master)
        return code


def run_pytest_in_terminal(pytester: pytest.Pytester, *args: str, timeout: float) -> Terminal:
    """:func:`run_pytest` with a pseudo terminal for its stdin, stdout and stderr (a user at a terminal).

    Colour and readline's escape sequences are off (``--color=no``, ``TERM=dumb``), so what is expected
    reads as plain text.
    """
    import pty

    argv = ("-p", "no:cacheprovider", "--color=no", *args)
    server = _warm_socket()
    if server is None:
        command = [sys.executable, "-m", "pytest", *argv]
    else:
        basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
        command = [
            sys.executable,
            "-I",
            "-S",
            str(WARM_SCRIPT),
            "client",
            server,
            f"--basetemp={basetemp}",
            *argv,
        ]
    master, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            command,
            cwd=pytester.path,
            env={**os.environ, "TERM": "dumb", "COLUMNS": "120"},
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
            start_new_session=True,
        )
    finally:
        os.close(terminal)
    return Terminal(process, master, timeout)


needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="MPICH's mpiexec is not on PATH (pip install mpich)"
)
"""For a test that launches with ``--launcher=mpiexec``: skipped where no MPI is installed."""


def clear_rank_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every launcher's rank variables (and a job's Slurm and PBS ones): a process no launcher started."""
    from pytest_sprite.env.rank_variables import LAUNCHER_VARIABLES

    for names in LAUNCHER_VARIABLES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    for name in (
        "SLURM_JOB_ID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_TASKS_PER_NODE",
        "PBS_NODEFILE",
        "PBS_JOBID",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def local_settings(**overrides: Any) -> Settings:
    """The plugin's resolved settings as a plain local session has them, with ``overrides``."""
    from pytest_sprite.glue.options import Settings

    fields: dict[str, Any] = {
        "world_size": None,
        "launcher": "local",
        "timeout": 300.0,
        "timeout_source": "the default",
        "grace": 5.0,
        "ppn": None,
        "launcher_args": (),
        "controller_host": None,
        "connect_timeout": 120.0,
        "device": "cpu",
        "artifacts": None,
        "qwen_path": None,
    }
    return Settings(**{**fields, **overrides})
