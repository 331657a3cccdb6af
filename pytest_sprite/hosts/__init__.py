"""N hosts on one machine for a real multi-node run: ``python -m pytest_sprite hosts N -- <pytest command>``.

Each host has its own network stack and address, hostname, ``/tmp``, ``/dev/shm`` and process table; a
directory they all see stands for the shared file system. The controller runs on host1 and MPICH's
``mpiexec`` places the ranks on every host. Needs root, ``ip``, ``unshare``, ``nsenter`` and MPICH.
"""

from __future__ import annotations

from .control import cut_link, hosts, kill_host, restore_link
from .machine import Machine, cannot_make_hosts

__all__ = ["Machine", "cannot_make_hosts", "cut_link", "hosts", "kill_host", "restore_link"]
