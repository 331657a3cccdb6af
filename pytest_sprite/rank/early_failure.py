"""A launched agent that fails before it can join tells the controller why, at once.

Under mpiexec or torchrun one agent's early exit does not end the launch while the others run, so the
controller would wait out ``--connect-timeout`` (120 s) and then show the launcher's words, not the
error. An agent whose initial conftest fails to import connects anyway, presents the session's token
and sends one ``agent_failed`` frame with its rank and the traceback; the controller shows that and
stops. Anything that goes wrong here is swallowed: the agent is failing already, and pytest still
prints the error to the launch log.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Final

from ..plumbing.protocol import AGENT_FAILED, FIRST_FRAME_MAX, encode_frame

__all__ = ["agent_address", "describe_failure", "report_agent_failure"]

_CONNECT_WITHIN: Final = 10.0
_LINES: Final = 40
"""The traceback's last lines sent: a screen, not the whole chain."""


def agent_address(args: list[str]) -> tuple[str, int] | None:
    """The controller's address from ``--sprite-agent=HOST:PORT`` in ``args``, None when not an agent."""
    for i, word in enumerate(args):
        value = None
        if word.startswith("--sprite-agent="):
            value = word.partition("=")[2]
        elif word == "--sprite-agent" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None:
            host, _, port = value.rpartition(":")
            return (host, int(port)) if host and port.isdigit() else None
    return None


def describe_failure(exc: BaseException) -> str:
    """What pytest would print for ``exc``: for a conftest that failed to import, the file and its cause."""
    cause = getattr(exc, "cause", None)  # pytest's ConftestImportFailure wraps the real error
    path = getattr(exc, "path", None)
    shown = cause if isinstance(cause, BaseException) else exc
    try:
        import pytest

        text = str(pytest.ExceptionInfo.from_exception(shown).getrepr(style="short", chain=False))
    except Exception:
        text = "".join(traceback.format_exception(shown))
    lines = text.rstrip("\n").splitlines()
    head = f"{type(shown).__name__} while loading conftest '{path}':" if path is not None else ""
    body = "\n".join(lines[-_LINES:])
    return f"{head}\n{body}" if head else body


def report_agent_failure(address: tuple[str, int], detail: str) -> None:
    """Send ``agent_failed`` (token, rank, detail) to the controller at ``address``; never raises."""
    try:
        from ..env.rank_variables import read_rank_env

        try:
            rank: int | None = read_rank_env(use_mpi4py=False).rank
        except Exception:
            rank = None
        frame = _fitting_frame(os.environ.get("SPRITE_TOKEN", ""), rank, detail)
        with socket.create_connection(address, timeout=_CONNECT_WITHIN) as sock:
            sock.sendall(frame)
    except Exception:
        pass


def _fitting_frame(token: str, rank: int | None, detail: str) -> bytes:
    """The ``agent_failed`` frame, its detail cut from the top (its first line kept) until the frame fits
    in what the controller reads before it has checked the token (FIRST_FRAME_MAX)."""
    head, _, rest = detail.partition("\n")
    lines = rest.splitlines()
    while True:
        text = "\n".join([head, *(["..."] if len(lines) < len(rest.splitlines()) else []), *lines])
        frame = encode_frame(AGENT_FAILED, {"token": token, "rank": rank, "detail": text})
        if len(frame) <= FIRST_FRAME_MAX or not lines:
            return (
                frame
                if len(frame) <= FIRST_FRAME_MAX
                else encode_frame(AGENT_FAILED, {"token": token, "rank": rank, "detail": head[:1000]})
            )
        lines = lines[1:]
