"""The rendezvous host and port every rank of a launch computes alike, from the job's own variables.

Split from :mod:`pytest_sprite.env.rank_variables` (which re-exports these names): the host comes from
MASTER_ADDR, the PBS node file or the Slurm node list (expanded here, so no ``scontrol`` is needed); the port
from MASTER_PORT, else derived from the job id, else a free port. Stdlib only.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
from collections.abc import Iterator, Mapping

from ..errors import RankEnvError

__all__ = [
    "PORT_RANGE",
    "SHARED_PORT_VARIABLES",
    "derive_port",
    "expand_hostlist",
    "free_port",
    "hosts_in_nodefile",
    "iter_hostlist",
    "rendezvous_host",
    "rendezvous_port",
    "unresolved",
]

_DIGITS = re.compile(r"[0-9]+")


# ---------------------------------------------------------------------------------------------------------
# rendezvous host


RESOLVE_WITHIN = 10.0
"""Seconds a name may take to resolve before it counts as unresolvable (a resolver that never answers)."""


def unresolved(host: str, within: float = RESOLVE_WITHIN) -> str | None:
    """Why ``host`` does not resolve on this machine, or None when it does; never waits past ``within`` s.

    The lookup runs in a daemon thread: a resolver that retries for a minute holds no one.
    """
    outcome: list[str | None] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            outcome.append(str(exc) or type(exc).__name__)
        else:
            outcome.append(None)

    thread = threading.Thread(target=look_up, name="sprite-resolve", daemon=True)
    thread.start()
    thread.join(within)
    return outcome[0] if outcome else f"no answer within {within:g}s"


_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def rendezvous_host(environ: Mapping[str, str] | None = None) -> str:
    """Host every rank can reach for the rendezvous: MASTER_ADDR, else the first node of the job, else this host.

    The first node comes from the file named by PBS_NODEFILE, else the Slurm node list (SLURM_STEP_NODELIST,
    SLURM_JOB_NODELIST, SLURM_NODELIST, expanded here so no ``scontrol`` is needed).
    """
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR", "").strip()
    if addr:
        return addr
    nodefile = env.get("PBS_NODEFILE", "").strip()
    if nodefile:
        return _first_host_in_file(nodefile)
    for name in _NODELIST_VARS:
        text = env.get(name, "").strip()
        if text:
            return next(iter_hostlist(text, source=name))
    return socket.gethostname()


def _first_host_in_file(path: str) -> str:
    hosts = hosts_in_nodefile(path)
    if not hosts:
        raise RankEnvError(
            f"PBS_NODEFILE={path!r} lists no host; export MASTER_ADDR=<first node> to name the rendezvous host"
        )
    return hosts[0]


def hosts_in_nodefile(path: str | os.PathLike[str]) -> list[str]:
    """The distinct hosts of a PBS node file, in order (a host repeats there once per slot).

    Raises RankEnvError when the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise RankEnvError(
            f"PBS_NODEFILE={str(path)!r} cannot be read ({exc.strerror or exc}); run inside the PBS job that set "
            f"it, or export MASTER_ADDR=<first node> to name the rendezvous host yourself"
        ) from exc
    hosts: dict[str, None] = {}
    for line in lines:
        words = line.split("#", 1)[0].split()
        if words:
            hosts.setdefault(words[0], None)
    return list(hosts)


_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def iter_hostlist(text: str, *, source: str = "host list") -> Iterator[str]:
    """Expand a Slurm host list (``nid[001-004,007]``, ``a1,b[2-3]``, ``r[1-2]n[1-2]``) lazily, in order.

    The whole list is checked first (so a malformed tail is not missed), then hosts are produced one at a
    time: the first host of ``n[0000000-9999999]`` costs nothing. Zero padding follows the lower bound as
    written (``[08-10]`` gives 08, 09, 10), as Slurm does. ``source`` names the variable in error messages.
    """
    items = [_parse_item(item, text, source) for item in _split_top_level(text, source)]
    return (host for literals, groups in items for host in _expand_item(literals, groups))


def expand_hostlist(text: str, *, source: str = "host list") -> list[str]:
    """Every host of a Slurm host list, in order (see :func:`iter_hostlist`)."""
    return list(iter_hostlist(text, source=source))


_Range = tuple[int, int, int]  # lo, hi, zero-padded width


def _bad_hostlist(text: str, source: str, why: str) -> RankEnvError:
    return RankEnvError(
        f"{source}={text!r} is not a Slurm host list ({why}); expected names like 'nid[001-004,007]' or "
        f"'a1,b[2-3]'. Export MASTER_ADDR=<first node> to bypass the node list."
    )


def _split_top_level(text: str, source: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad_hostlist(text, source, f"nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(text, source, f"unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise _bad_hostlist(text, source, "unclosed '['")
    items.append(text[start:].strip())
    if not all(items):
        raise _bad_hostlist(text, source, "an empty host name")
    return items


def _parse_item(item: str, text: str, source: str) -> tuple[list[str], list[list[_Range]]]:
    """Literal pieces and bracket groups of one host-list item: ``r[1-2]n[3]`` -> (['r', 'n', ''], [...])."""
    literals = _BRACKET.split(item)[0::2]
    if any(ch.isspace() for ch in "".join(literals)):
        raise _bad_hostlist(text, source, f"whitespace inside {item!r}")
    groups = []
    for body in _BRACKET.findall(item):
        ranges = []
        for part in body.split(","):
            match = _RANGE.fullmatch(part.strip())
            if not match:
                raise _bad_hostlist(text, source, f"range {part!r} is not N or N-M")
            lo_text, hi_text = match.group(1), match.group(2)
            lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
            if hi < lo:
                raise _bad_hostlist(text, source, f"range {part!r} runs backwards")
            ranges.append((lo, hi, len(lo_text)))
        groups.append(ranges)
    return literals, groups


def _expand_item(
    literals: list[str], groups: list[list[_Range]], level: int = 0, prefix: str = ""
) -> Iterator[str]:
    prefix += literals[level]
    if level == len(groups):
        yield prefix
        return
    for lo, hi, width in groups[level]:
        for number in range(lo, hi + 1):
            yield from _expand_item(literals, groups, level + 1, prefix + str(number).zfill(width))


# ---------------------------------------------------------------------------------------------------------
# rendezvous port


PORT_RANGE = range(20000, 30000)
"""Ports :func:`derive_port` picks from: unprivileged, and below Linux's ephemeral range (32768-60999), so an
outgoing connection of some other process cannot be holding the port by chance."""

_JOB_ID_VARS = ("PBS_JOBID", "SLURM_JOB_ID", "SLURM_JOBID")
SHARED_PORT_VARIABLES: tuple[str, ...] = ("MASTER_PORT", *_JOB_ID_VARS)
"""Variables from which every rank derives the same rendezvous port (without them each picks its own)."""


def rendezvous_port(environ: Mapping[str, str] | None = None) -> int:
    """Rendezvous port every rank computes alike: MASTER_PORT, else derived from the job id, else a free port.

    The derivation (:func:`derive_port`) needs no communication, so all nodes of a PBS or Slurm job agree on
    it; two launches at once inside one job get the same derived port and need their own MASTER_PORT. The
    free-port fallback is only right on a single host: it is chosen by this process alone.
    """
    env = os.environ if environ is None else environ
    raw = env.get("MASTER_PORT", "").strip()
    if raw:
        if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= 65535:
            raise RankEnvError(
                f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number in 1..65535; export a free port "
                f"(e.g. MASTER_PORT=29500) or unset MASTER_PORT to derive one from the job id"
            )
        return int(raw)
    for name in _JOB_ID_VARS:
        job_id = env.get(name, "").strip()
        if job_id:
            return derive_port(job_id)
    return free_port()


def derive_port(job_id: str) -> int:
    """Port for a job id: ``20000 + (first 8 bytes of sha256(job_id), big-endian) % 10000``.

    sha256 rather than ``hash()`` because Python salts string hashes per process; the whole id is hashed
    (``12345.aurora-pbs-0001...`` and ``12345`` differ) because that is what every node of the job sees.
    """
    digest = hashlib.sha256(job_id.encode("utf-8")).digest()
    return PORT_RANGE.start + int.from_bytes(digest[:8], "big") % len(PORT_RANGE)


def free_port(host: str = "") -> int:
    """A TCP port that is free on ``host`` now (the kernel picks it); another process may take it before use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
