"""Rank, world and rendezvous detection from launcher variables: the one reader.

Every launcher announces a process's place in the world through its own variables. This module reads all
of them, requires the ones that are set to agree, and says which variable to fix when they do not: a stale
``RANK=0`` inherited from an outer launcher must never make every rank rank 0. The rank agents, the test
children and the Lightning ``PALSEnvironment`` all use it, so it is stdlib only (``mpi4py`` is imported
lazily, only as the last source of a world size).

Variables read, by launcher (rank; local rank; world size; local world size; node rank):

- torchrun: RANK; LOCAL_RANK; WORLD_SIZE; LOCAL_WORLD_SIZE; GROUP_RANK
- PALS (Aurora): PALS_RANKID; PALS_LOCAL_RANKID; no world size; PALS_LOCAL_SIZE; PALS_NODEID
- PMIx: PMIX_RANK
- MPICH hydra: PMI_RANK; MPI_LOCALRANKID or PMI_LOCAL_RANK; PMI_SIZE; MPI_LOCALNRANKS or PMI_LOCAL_SIZE
- Open MPI: OMPI_COMM_WORLD_RANK; _LOCAL_RANK; _SIZE; _LOCAL_SIZE
- Slurm: SLURM_PROCID; SLURM_LOCALID; SLURM_NTASKS; SLURM_NODEID

A variable set to the empty string counts as unset (job scripts often ``export RANK=$UNSET_THING``).

The rendezvous host and port live in :mod:`pytest_sprite.env.rendezvous` and are re-exported here.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..errors import RankEnvError
from .rendezvous import (
    PORT_RANGE,
    SHARED_PORT_VARIABLES,
    derive_port,
    expand_hostlist,
    free_port,
    hosts_in_nodefile,
    iter_hostlist,
    rendezvous_host,
    rendezvous_port,
)

__all__ = [
    "LAUNCHER_VARIABLES",
    "PORT_RANGE",
    "SHARED_PORT_VARIABLES",
    "TORCHELASTIC_RUN_ID",
    "RankInfo",
    "become_rank",
    "derive_port",
    "expand_hostlist",
    "free_port",
    "gloo_interface",
    "hosts_in_nodefile",
    "iter_hostlist",
    "optional_rank_env",
    "read_rank_env",
    "rendezvous_host",
    "rendezvous_port",
    "torchrun_variables",
]

_Field = Literal["rank", "local_rank", "world_size", "local_world_size", "node_rank"]


@dataclass(frozen=True)
class _Var:
    name: str
    launcher: str
    field: _Field


_VARS: tuple[_Var, ...] = (
    _Var("RANK", "torchrun", "rank"),
    _Var("LOCAL_RANK", "torchrun", "local_rank"),
    _Var("WORLD_SIZE", "torchrun", "world_size"),
    _Var("LOCAL_WORLD_SIZE", "torchrun", "local_world_size"),
    _Var("GROUP_RANK", "torchrun", "node_rank"),
    _Var("PALS_RANKID", "PALS", "rank"),
    _Var("PALS_LOCAL_RANKID", "PALS", "local_rank"),
    _Var("PALS_LOCAL_SIZE", "PALS", "local_world_size"),
    _Var("PALS_NODEID", "PALS", "node_rank"),
    _Var("PMIX_RANK", "PMIx", "rank"),
    _Var("PMI_RANK", "MPICH hydra", "rank"),
    _Var("MPI_LOCALRANKID", "MPICH hydra", "local_rank"),
    _Var("PMI_LOCAL_RANK", "MPICH hydra", "local_rank"),
    _Var("PMI_SIZE", "MPICH hydra", "world_size"),
    _Var("MPI_LOCALNRANKS", "MPICH hydra", "local_world_size"),
    _Var("PMI_LOCAL_SIZE", "MPICH hydra", "local_world_size"),
    _Var("OMPI_COMM_WORLD_RANK", "Open MPI", "rank"),
    _Var("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI", "local_rank"),
    _Var("OMPI_COMM_WORLD_SIZE", "Open MPI", "world_size"),
    _Var("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI", "local_world_size"),
    _Var("SLURM_PROCID", "Slurm", "rank"),
    _Var("SLURM_LOCALID", "Slurm", "local_rank"),
    _Var("SLURM_NTASKS", "Slurm", "world_size"),
    _Var("SLURM_NODEID", "Slurm", "node_rank"),
)

LAUNCHER_VARIABLES: Mapping[str, tuple[str, ...]] = {
    launcher: tuple(v.name for v in _VARS if v.launcher == launcher)
    for launcher in dict.fromkeys(v.launcher for v in _VARS)
}
"""Rank variables by launcher family; a launcher unsets the other families' ones in the agents it starts."""

_FIELD_WORDS: Mapping[_Field, str] = {
    "rank": "rank",
    "local_rank": "local rank",
    "world_size": "world size",
    "local_world_size": "local world size",
    "node_rank": "node rank",
}

_MPI4PY_SOURCE = "mpi4py COMM_WORLD size"
_ARGUMENT_SOURCE = "world_size argument"


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where this process sits in the world, and which variables said so."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    local_rank: int
    """Rank among the processes of this node: the device index (``xpu:<local_rank>``)."""
    world_size: int
    """Number of ranks in the launch."""
    local_world_size: int | None = None
    """Number of ranks on this node, when the launcher says."""
    node_rank: int | None = None
    """Index of this node in the launch, when the launcher says."""
    sources: tuple[str, ...] = ()
    """Names of the variables read (plus ``world_size argument`` or ``mpi4py COMM_WORLD size``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise RankEnvError(
                f"rank {self.rank} is not in 0..{self.world_size - 1} for world size {self.world_size} "
                f"(from {', '.join(self.sources) or 'the caller'}); every rank must be below the world size"
            )
        if self.local_rank < 0 or (
            self.local_world_size is not None and self.local_rank >= self.local_world_size
        ):
            raise RankEnvError(
                f"local rank {self.local_rank} is not in 0..{(self.local_world_size or 1) - 1} for local world "
                f"size {self.local_world_size} (from {', '.join(self.sources) or 'the caller'})"
            )


# ---------------------------------------------------------------------------------------------------------
# rank and world


def read_rank_env(
    environ: Mapping[str, str] | None = None,
    *,
    world_size: int | None = None,
    use_mpi4py: bool = True,
) -> RankInfo:
    """Read this process's rank and world from the launcher variables; raise if they are missing or disagree.

    ``environ`` defaults to ``os.environ``. The world size comes from the variables, else ``world_size``
    (which must agree with the variables when both are given), else mpi4py's ``COMM_WORLD`` size when
    ``use_mpi4py`` and an MPI launcher started this process (PALS exports no world size).
    """
    env = os.environ if environ is None else environ
    found = _found_values(env)
    _raise_on_disagreement(found)

    if not found["rank"]:
        names = ", ".join(v.name for v in _VARS if v.field == "rank")
        present = [n for n, _ in _all_found(found)]
        detail = f" (only {', '.join(present)} is set)" if present else ""
        raise RankEnvError(
            f"no launcher rank variable is set{detail}: looked for {names}. Start this process with a "
            f"launcher (mpiexec, srun, torchrun) or export RANK, LOCAL_RANK and WORLD_SIZE yourself."
        )
    sources = [n for n, _ in _all_found(found)]
    rank = found["rank"][0][1]
    size, size_source = _world_size(found, world_size, use_mpi4py)
    if size_source is not None:
        sources.append(size_source)
    local_world_size = found["local_world_size"][0][1] if found["local_world_size"] else None
    local_rank = _local_rank(found, rank, size, local_world_size)
    _check_ranges(found, rank, local_rank, size, size_source, local_world_size)
    return RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=size,
        local_world_size=local_world_size,
        node_rank=found["node_rank"][0][1] if found["node_rank"] else None,
        sources=tuple(sources),
    )


def _local_rank(found: _Found, rank: int, size: int, local_world_size: int | None) -> int:
    """The local rank from its variable, else the rank when every rank is on this node."""
    if found["local_rank"]:
        return found["local_rank"][0][1]
    if size == 1 or local_world_size == size:
        return rank  # every rank is on this node
    raise RankEnvError(
        f"no local rank variable is set (rank {rank} from {found['rank'][0][0]}, world size {size}): "
        f"looked for {', '.join(v.name for v in _VARS if v.field == 'local_rank')}. The device index "
        f"cannot be known on a multi-node launch; export LOCAL_RANK (and LOCAL_WORLD_SIZE) per process."
    )


def _check_ranges(
    found: _Found,
    rank: int,
    local_rank: int,
    size: int,
    size_source: str | None,
    local_world_size: int | None,
) -> None:
    """Raise when a rank is not below its world size: one of the variables is stale."""
    if rank >= size and size_source == _MPI4PY_SOURCE:
        raise RankEnvError(
            f"{found['rank'][0][0]}={rank} is not below mpi4py's COMM_WORLD size {size}: MPI in this process "
            f"was not started by the launcher that set {found['rank'][0][0]} (mpi4py built against another "
            f"MPI, or a singleton MPI_Init). Pass the world size instead: `mpiexec --env WORLD_SIZE=<ranks>`"
        )
    if rank >= size:
        raise RankEnvError(
            f"{found['rank'][0][0]}={rank} is not below the world size {size} (from "
            f"{size_source or found['world_size'][0][0]}): ranks run 0..{size - 1}. One of them is stale "
            f"(inherited from another launch); unset it, or launch with -n matching the world size"
        )
    if local_world_size is not None and local_world_size > size:
        raise RankEnvError(
            f"local world size {local_world_size} (from {found['local_world_size'][0][0]}) exceeds the world "
            f"size {size} (from {size_source or found['world_size'][0][0]}): one of them is stale; unset it"
        )
    if local_world_size is not None and local_rank >= local_world_size:
        raise RankEnvError(
            f"{found['local_rank'][0][0]}={local_rank} is not below the local world size {local_world_size} "
            f"(from {found['local_world_size'][0][0]}): local ranks run 0..{local_world_size - 1}. One of "
            f"them is stale (inherited from another launch); unset it"
        )


def optional_rank_env(
    environ: Mapping[str, str] | None = None,
    *,
    world_size: int | None = None,
    use_mpi4py: bool = True,
) -> RankInfo | None:
    """Like :func:`read_rank_env`, but None when no launcher variable at all is set (a plain process)."""
    env = os.environ if environ is None else environ
    if not any(env.get(v.name, "").strip() for v in _VARS):
        return None
    return read_rank_env(env, world_size=world_size, use_mpi4py=use_mpi4py)


_Found = dict[_Field, list[tuple[str, int]]]


def _found_values(env: Mapping[str, str]) -> _Found:
    found: _Found = {"rank": [], "local_rank": [], "world_size": [], "local_world_size": [], "node_rank": []}
    for var in _VARS:
        raw = env.get(var.name)
        if raw is None or not raw.strip():
            continue
        found[var.field].append((var.name, _parse_count(var, raw)))
    return found


def _all_found(found: _Found) -> list[tuple[str, int]]:
    order = {v.name: i for i, v in enumerate(_VARS)}
    return sorted((pair for pairs in found.values() for pair in pairs), key=lambda p: order[p[0]])


_DIGITS = re.compile(r"[0-9]+")


def _parse_count(var: _Var, raw: str) -> int:
    text = raw.strip()
    sizes = ("world_size", "local_world_size")
    if not _DIGITS.fullmatch(text) or (var.field in sizes and int(text) == 0):
        allowed = "a positive integer" if var.field in sizes else "a non-negative integer"
        raise RankEnvError(
            f"{var.name}={raw!r} ({var.launcher} {_FIELD_WORDS[var.field]}) is not {allowed}; "
            f"fix or unset {var.name} in the environment that starts this process"
        )
    return int(text)


def _raise_on_disagreement(found: _Found) -> None:
    lines = []
    for field, pairs in found.items():
        if len({value for _, value in pairs}) > 1:
            shown = ", ".join(f"{name}={value} ({_launcher_of(name)})" for name, value in pairs)
            lines.append(f"  {_FIELD_WORDS[field]}: {shown}")
    if not lines:
        return
    present: dict[str, list[str]] = {}
    for name, _ in _all_found(found):
        present.setdefault(_launcher_of(name), []).append(name)
    fixes = []
    if len(present) > 1:
        for launcher in present:
            stale = [n for other, names in present.items() if other != launcher for n in names]
            fixes.append(f"  started by {launcher}? unset {' '.join(stale)} before launching")
    for pairs in found.values():
        values = dict(pairs)
        for launcher in present:
            names = [name for name, _ in pairs if _launcher_of(name) == launcher]
            if len({values[n] for n in names}) > 1:
                fixes.append(
                    f"  {' and '.join(names)} both come from {launcher} and disagree: the one this launch "
                    f"did not set was inherited; unset it"
                )
    raise RankEnvError(
        "launcher variables disagree, so this process cannot know its place in the world:\n"
        + "\n".join(lines)
        + "\nOnly the launcher that started this process sets true values; the others were inherited from "
        "an outer launcher or a job script (a stale RANK=0 would make every rank rank 0). Unset them where "
        "this process is launched, e.g. `env -u RANK mpiexec ...`:\n" + "\n".join(fixes)
    )


def _launcher_of(name: str) -> str:
    return next(v.launcher for v in _VARS if v.name == name)


def _world_size(found: _Found, argument: int | None, use_mpi4py: bool) -> tuple[int, str | None]:
    """The world size and, when it did not come from a variable, the source it came from."""
    if argument is not None and (isinstance(argument, bool) or not isinstance(argument, int) or argument < 1):
        raise RankEnvError(f"world_size={argument!r} is not a positive integer; pass the number of ranks")
    if found["world_size"]:
        name, size = found["world_size"][0]
        if argument is not None and argument != size:
            raise RankEnvError(
                f"{name}={size} ({_launcher_of(name)}) disagrees with world_size={argument} given by the "
                f"caller: the launch started a different number of ranks than expected; fix the launcher's "
                f"rank count (-n) or unset a stale {name}"
            )
        return size, None
    if argument is not None:
        return argument, _ARGUMENT_SOURCE
    rank_launchers = {_launcher_of(name) for name, _ in found["rank"]}
    mpi_launched = bool(rank_launchers - {"torchrun"})
    why_not = "mpi4py was not consulted (use_mpi4py=False)"
    if use_mpi4py and mpi_launched:
        mpi_size, why_not = _mpi4py_world_size()
        if mpi_size is not None:
            return mpi_size, _MPI4PY_SOURCE
    elif use_mpi4py:
        why_not = "mpi4py was not consulted (only torchrun's RANK is set, not an MPI launch)"
    rank_name = found["rank"][0][0]
    raise RankEnvError(
        f"the world size is unknown: {rank_name} is set but none of "
        f"{', '.join(v.name for v in _VARS if v.field == 'world_size')} is, no world_size was passed, and "
        f"{why_not}. PALS exports no world size: launch with `mpiexec --env WORLD_SIZE=<ranks> ...`, "
        f"export WORLD_SIZE=<ranks>, install mpi4py, or pass world_size=<ranks>."
    )


def _mpi4py_world_size() -> tuple[int | None, str]:
    """COMM_WORLD's size, or None and why not. Importing ``mpi4py.MPI`` initializes MPI, hence last resort."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return None, f"mpi4py is not importable ({exc})"
    except Exception as exc:  # MPI_Init failing raises RuntimeError or an MPI.Exception
        return None, f"mpi4py could not initialize MPI ({type(exc).__name__}: {exc})"
    return int(MPI.COMM_WORLD.Get_size()), ""


# Set by MPI process managers for the agent's own launch; a process of a world we start must not inherit them.
_PMI_PLUMBING = ("PMI_FD", "PMI_PORT", "PMI_HOSTNAME", "PMI_ID", "PMIX_NAMESPACE", "PMIX_SERVER_URI2")

TORCHELASTIC_RUN_ID = "pytest-sprite"
"""What the processes pytest-sprite starts carry as ``TORCHELASTIC_RUN_ID`` (torchrun sets one in every worker)."""


def torchrun_variables(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """The variables torchrun sets in one worker of a world, for the processes pytest-sprite starts itself.

    ``TORCHELASTIC_RUN_ID`` among them makes Lightning choose ``TorchElasticEnvironment`` at once, as under
    torchrun. Without it Lightning's cluster detection falls through to ``MPIEnvironment``, whose
    ``import mpi4py.MPI`` initializes MPI (0.3-0.8 s per Trainer on a 2-core machine) only to find a world
    of one. ``NODE_RANK`` is Lightning's own name for ``GROUP_RANK``.
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": TORCHELASTIC_RUN_ID,
    }


def become_rank(variables: Mapping[str, str]) -> None:
    """Make this process the worker ``variables`` (from :func:`torchrun_variables`) describe, and nothing else.

    The launch that started the session set its own variables (``PMI_SIZE=4`` beside a test's
    ``WORLD_SIZE=2``, ``SLURM_NTASKS``, an MPI process manager's connection): they describe that launch, not
    this world, so they are removed and the rank reader, Lightning's cluster detection and mpi4py see only
    this world's ranks.
    """
    for family, names in LAUNCHER_VARIABLES.items():
        if family != "torchrun":
            for name in names:
                os.environ.pop(name, None)
    for name in _PMI_PLUMBING:
        os.environ.pop(name, None)
    os.environ.update(variables)
    interface = gloo_interface(variables)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def gloo_interface(variables: Mapping[str, str]) -> str | None:
    """The interface gloo must use in the world ``variables`` describe, when its own choice would fail.

    Gloo binds to the address this host's name resolves to. Debian and Ubuntu install a node with its
    name on ``127.0.1.1``: gloo then listens on loopback and gives that address to the ranks on other nodes,
    which can never connect. So when the world spans nodes (fewer local ranks than ranks), the
    user named no interface (``GLOO_SOCKET_IFNAME``) and the name is a loopback address, this is the
    interface that reaches the rendezvous host, or, on the rendezvous host itself, the default route's
    (else the first interface with an IPv4 address that is not loopback). None otherwise: gloo's choice.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        if int(variables.get("LOCAL_WORLD_SIZE", "0")) >= int(variables.get("WORLD_SIZE", "0")):
            return None  # every rank on this host: loopback reaches them all
        if not socket.gethostbyname(socket.gethostname()).startswith("127."):
            return None
    except (OSError, ValueError):
        return None
    local = _local_address_toward(variables.get("MASTER_ADDR", ""))
    addresses = _ipv4_interfaces()
    if local is not None and not local.startswith("127."):
        return next((name for name, addr in addresses.items() if addr == local), None)
    default = _default_route_interface()
    if default in addresses:
        return default
    return next((name for name, addr in addresses.items() if not addr.startswith("127.")), None)


def _local_address_toward(host: str) -> str | None:
    """This host's address on the route to ``host`` (no packet is sent)."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _ipv4_interfaces() -> dict[str, str]:
    """Each interface with an IPv4 address, and that address (Linux: SIOCGIFADDR)."""
    import fcntl
    import struct

    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                data = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(data[20:24])
    return found


def _default_route_interface() -> str | None:
    try:
        with open("/proc/net/route", encoding="ascii") as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None
