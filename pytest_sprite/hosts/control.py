"""Faults a test plants in the run's hosts from inside them: lose a host, cut or restore its link.

A test that runs under ``python -m pytest_sprite hosts`` finds the run's control socket in
``SPRITE_HOSTS_CONTROL`` (a Unix socket in the run's directory, which every host sees); the machine,
outside every host, does what it asks and answers one line.
"""

from __future__ import annotations

import os
import socket

__all__ = ["HOSTS_ENV", "cut_link", "hosts", "kill_host", "restore_link"]

HOSTS_ENV = "SPRITE_HOSTS"
_CONTROL_ENV = "SPRITE_HOSTS_CONTROL"


def hosts() -> list[str]:
    """The names of the run's hosts (empty outside ``python -m pytest_sprite hosts``)."""
    return [name for name in os.environ.get(HOSTS_ENV, "").split(",") if name]


def _ask(request: str) -> str:
    path = os.environ.get(_CONTROL_ENV)
    if not path:
        raise RuntimeError(f"not inside `python -m pytest_sprite hosts` ({_CONTROL_ENV} is not set)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(path)
        conn.sendall(request.encode() + b"\n")
        reply = conn.makefile("r").readline().strip()
    if not reply.startswith("ok "):
        raise RuntimeError(f"the hosts machine refused {request!r}: {reply}")
    return reply[3:]


def kill_host(name: str) -> str:
    """Kill every process of host ``name`` at once (a node lost)."""
    return _ask(f"kill {name}")


def cut_link(name: str) -> str:
    """Take host ``name``'s link down (``ip link set ... down``): its packets go nowhere."""
    return _ask(f"link {name} down")


def restore_link(name: str) -> str:
    """Bring host ``name``'s link back up."""
    return _ask(f"link {name} up")
