"""What the cluster launchers share: finding the launcher program, the agent command, starting it.

Each launcher owns some families of rank variables (``mpiexec`` under MPICH: PMI_RANK ...). Any other
family's variables in an agent's environment can only be stale copies inherited from the controller's
environment (pytest run inside ``torchrun``, an ``sbatch`` script's SLURM_PROCID=0, ...), and the rank
reader would rightly refuse them. So every agent command starts with ``env -u`` for each of them: the
launcher has already set its own variables when ``env`` runs on the rank, so only the stale ones go.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Iterable, Sequence

from ...env.rank_variables import LAUNCHER_VARIABLES
from ...errors import LaunchError
from .base import LaunchHandle, LaunchRequest, SubprocessLaunch

__all__ = [
    "ProgramLauncher",
    "agent_command",
    "find_program",
    "has_option",
    "start",
    "unset_foreign_rank_variables",
]


def find_program(program: str, *, launcher: str, how_to_get: str) -> str:
    """Absolute path of ``program`` on PATH, else a LaunchError that says how to get it."""
    path = shutil.which(program)
    if path is None:
        raise LaunchError(f"--launcher={launcher}: `{program}` is not on PATH. {how_to_get}")
    return path


def unset_foreign_rank_variables(owned: Iterable[str], *, keep: Iterable[str] = ()) -> list[str]:
    """``env -u NAME ...`` words for every rank variable outside the ``owned`` launcher families.

    ``keep`` names variables the launcher passes itself (PALS: ``--env WORLD_SIZE``), which must survive.
    """
    owned, kept = set(owned), set(keep)
    unknown = owned - set(LAUNCHER_VARIABLES)
    if unknown:
        raise ValueError(f"unknown launcher families {sorted(unknown)}; known: {sorted(LAUNCHER_VARIABLES)}")
    words = ["env"]
    for family, names in LAUNCHER_VARIABLES.items():
        if family not in owned:
            for name in names:
                if name not in kept:
                    words += ["-u", name]
    return words


def agent_command(request: LaunchRequest, owned: Iterable[str], *, keep: Iterable[str] = ()) -> list[str]:
    """The per-rank command: drop stale rank variables, then run the controller's agent command."""
    return [*unset_foreign_rank_variables(owned, keep=keep), *request.agent_argv]


def has_option(words: Sequence[str], *names: str) -> bool:
    """True when ``words`` (``--launcher-args``) already give one of the options ``names``.

    Matches ``--ppn 4``, ``--ppn=4`` and, for short options, ``-n4``, so a user's choice always wins over
    the launcher's default.
    """
    for word in words:
        for name in names:
            if word == name or word.startswith(name + "="):
                return True
            if not name.startswith("--") and len(name) == 2 and word.startswith(name) and word[2:].isdigit():
                return True
    return False


def start(argv: Sequence[str], request: LaunchRequest) -> SubprocessLaunch:
    """Start ``argv`` with the request's environment, after writing the command line to the launch log.

    The log line is what a user needs when the launch dies before any agent connects (the controller shows
    the log's tail); the session token travels in the environment, never on the command line.
    """
    request.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(request.log_path, "a", encoding="utf-8") as log:
        log.write(f"+ {shlex.join(argv)}\n")
    return SubprocessLaunch(argv, env=request.env, log_path=request.log_path, cwd=request.cwd)


class ProgramLauncher:
    """A cluster launcher that is one program on PATH: found by :meth:`check`, run with :meth:`command`'s words."""

    name: str
    """The ``--launcher`` value."""
    program_name: str = ""
    """The program looked up on PATH (default: ``name``)."""
    how_to_get: str
    """What the LaunchError says when the program is missing."""
    spans_nodes = True
    job_variable: str = ""
    """The variable a scheduler's job sets (``PBS_JOBID``): when named, the launcher runs only inside a job."""
    outside_job: str = ""
    """What the LaunchError says when ``job_variable`` is unset or blank."""

    def __init__(self) -> None:
        self.program: str | None = None

    def check(self) -> None:
        """Find the program on PATH, and require the job ``job_variable`` names; each LaunchError says how."""
        self.program = find_program(
            self.program_name or self.name, launcher=self.name, how_to_get=self.how_to_get
        )
        if self.job_variable and not os.environ.get(self.job_variable, "").strip():
            raise LaunchError(self.outside_job)

    def command(self, request: LaunchRequest, program: str) -> list[str]:
        """The command line that starts ``request``'s agents with ``program``."""
        raise NotImplementedError

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        if self.program is None:
            self.check()
        return start(self.command(request, self.program or self.program_name or self.name), request)
