"""A real one-node Slurm for the project's own tests: munged, slurmctld and slurmd started from a temporary folder.

Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them) run as root with a configuration written into
the folder: one node at 127.0.0.1, named after this host, ``select/cons_tres``, ``proctrack/linuxproc``,
``task/none``, no accounting, a munge key and socket of its own. Every client (``salloc``, ``sbatch``, ``srun``,
``sinfo``) finds it through ``SLURM_CONF`` in :attr:`SlurmCluster.env`. The node claims more CPUs than the
machine has (``SlurmdParameters=config_overrides``), so a 4-rank job fits on CI's 2 cores, and carries the
``gpu`` feature, so the shipped sbatch script's ``--constraint=gpu`` is satisfied.

:func:`slurm_missing` says why a real Slurm cannot run here (no binaries, not root); with ``CI`` or
``SPRITE_REQUIRE_ENGINES`` set (``.ci/run`` sets the latter), the tests fail on it instead of skipping, so a CI
machine without Slurm cannot pass unnoticed. The daemons are stopped by
their PIDs, never by name: other sessions on the machine may run their own.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("salloc", "sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")
START_TIMEOUT_S = 60.0
"""Bound on the wait for munged's socket and for the node to show idle (about 2 s here)."""
NODE_CPUS = 8
"""CPUs the node claims: 4 ranks a job, and room for a second job beside it."""


def _find(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def slurm_missing() -> str | None:
    """Why a real Slurm cannot start here, or None when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _find(name) is None]
    if missing:
        return (
            f"no real Slurm here ({', '.join(missing)} not found): "
            "`apt-get install slurm-wlm munge` (as .ci/run does) runs these tests"
        )
    if os.geteuid() != 0:
        return "a real Slurm here runs its daemons as root (SlurmUser=root); these tests are root-only"
    return None


def engines_required() -> bool:
    """True in CI, where a real engine's tests must run rather than skip."""
    return any(os.environ.get(name, "") not in ("", "0") for name in ("CI", "SPRITE_REQUIRE_ENGINES"))


def require(why_missing: str | None) -> None:
    """Skip the calling test when an engine is missing (``why_missing``); in CI fail instead, so CI cannot skip it."""
    if why_missing is None:
        return
    if engines_required():
        pytest.fail(f"CI must run the real-engine tests, but {why_missing}", pytrace=False)
    pytest.skip(why_missing)


def require_slurm() -> None:
    """Skip (in CI: fail) the calling test when a real Slurm cannot run here."""
    require(slurm_missing())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class SlurmCluster:
    """A running one-node Slurm under ``home``; :meth:`stop` ends its daemons by PID."""

    def __init__(self, home: Path, *, node: str | None = None) -> None:
        self.home = home
        self.node = node or socket.gethostname()
        self.conf = home / "slurm.conf"
        self.munge_socket = home / "munge" / "munge.socket"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in [n for n in os.environ if n.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
            if name != "SLURM_CONF":
                del self.env[name]

    # -- configuration ---------------------------------------------------------------------------------

    def config_text(self) -> str:
        home = self.home
        return "\n".join(
            [
                "ClusterName=sprite",
                f"SlurmctldHost={self.node}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket}",
                f"StateSaveLocation={home}/state",
                f"SlurmdSpoolDir={home}/spool/%n",
                f"SlurmctldPidFile={home}/slurmctld.pid",
                f"SlurmdPidFile={home}/slurmd-%n.pid",
                f"SlurmctldLogFile={home}/slurmctld.log",
                f"SlurmdLogFile={home}/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MpiDefault=none",
                "SwitchType=switch/none",
                "SchedulerType=sched/builtin",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                "SlurmdParameters=config_overrides",
                # a killed job's tasks get SIGTERM, then SIGKILL this many seconds later (Slurm's default)
                "KillWait=30",
                # a lost slurmd marks its node down (and its jobs failed) after this many seconds
                "SlurmdTimeout=10",
                "MessageTimeout=10",
                "InactiveLimit=0",
                "MinJobAge=300",
                f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory=1000 Features=gpu "
                "State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    # -- life --------------------------------------------------------------------------------------------

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "jobs"):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.home / "munge", 0o700)
        key = self.home / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self.conf.write_text(self.config_text())
        self._spawn(
            "munged",
            [
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.home / 'munge' / 'munged.pid'}",
                f"--log-file={self.home / 'munge' / 'munged.log'}",
                f"--seed-file={self.home / 'munge' / 'munged.seed'}",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self._spawn("slurmctld", ["-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.node_state() == "idle", f"node {self.node} idle in sinfo")

    def _spawn(self, name: str, args: Sequence[str]) -> None:
        program = _find(name)
        assert program is not None, name
        with open(self.home / f"{name}.out", "ab") as out:
            self.processes[name] = subprocess.Popen(
                [program, *args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait(self, ready: object, what: str, timeout: float = START_TIMEOUT_S) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, proc in self.processes.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the test Slurm did not come up ({what}; ended: {dead or 'none'}):\n{self.logs()}"
                )
            time.sleep(0.2)

    def node_state(self, node: str | None = None) -> str:
        """The node's state as ``sinfo`` prints it (``idle``, ``alloc``, ``down*`` ...), or "" when unknown."""
        out = self.run(["sinfo", "-h", "-N", "-n", node or self.node, "-o", "%t"], check=False)
        return out.stdout.strip()

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs the controller still holds in any state but completed."""
        out = self.run(["squeue", "-h", "-o", "%i %T"], check=False).stdout.split("\n")
        return [line.split()[0] for line in out if line.strip()]

    def submit(self, argv: Sequence[str], *, cwd: Path) -> str:
        """``sbatch --parsable <argv>`` from ``cwd``: the new job's id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *argv], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job_fields(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job`` (JobState, ExitCode, Reason, NodeList ...)."""
        out = self.run(["scontrol", "-o", "show", "job", job], check=False).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def wait_job(self, job: str, timeout: float) -> dict[str, str]:
        """Poll until ``job`` has ended (``sbatch --wait`` polls with a growing interval); its final fields."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        fields: dict[str, str] = {}

        def done() -> bool:
            fields.update(self.job_fields(job))
            return fields.get("JobState") in ended

        self._wait(done, f"job {job} ended (last seen {fields.get('JobState')})", timeout)
        return fields

    def wait_until(self, ready: object, what: str, timeout: float = START_TIMEOUT_S) -> None:
        """Poll ``ready()`` until true, failing with ``what`` and the daemons' logs after ``timeout``."""
        self._wait(ready, what, timeout)

    def kill_slurmd(self) -> None:
        """SIGKILL the node's slurmd, as when a node is lost; its job steps' slurmstepd keep running."""
        proc = self.processes.pop("slurmd")
        proc.kill()
        proc.wait()

    def restart_slurmd(self) -> None:
        """Start the node's slurmd again and wait for the node to show idle (``ReturnToService=2``)."""
        self._spawn("slurmd", ["-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.node_state() == "idle", f"node {self.node} idle again in sinfo")

    def logs(self) -> str:
        parts = []
        for path in sorted(self.home.glob("*.log")) + sorted(self.home.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        """End the daemons by PID (slurmd, slurmctld, then munged) and wait for each."""
        for job in self.jobs():
            self.run(["scancel", job], check=False)
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def running_cluster(home: Path) -> Iterator[SlurmCluster]:
    """A started cluster under ``home`` for a fixture to yield; stopped when the fixture ends."""
    cluster = SlurmCluster(home)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
