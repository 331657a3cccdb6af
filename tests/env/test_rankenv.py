"""Unit tests of the rank-variable reader (pure: explicit ``environ`` mappings, no process group)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_sprite.env import rank_variables as _rankenv
from pytest_sprite.env.rank_variables import (
    LAUNCHER_VARIABLES,
    PORT_RANGE,
    RankInfo,
    derive_port,
    expand_hostlist,
    free_port,
    optional_rank_env,
    read_rank_env,
    rendezvous_host,
    rendezvous_port,
)
from pytest_sprite.errors import RankEnvError

pytestmark = pytest.mark.cpu

ALL_VARS = [name for names in LAUNCHER_VARIABLES.values() for name in names]
RENDEZVOUS_VARS = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "PBS_NODEFILE",
    "PBS_JOBID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_JOBID",
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """os.environ without any launcher or rendezvous variable (the test runner may itself be launched)."""
    for name in ALL_VARS + RENDEZVOUS_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``from mpi4py import MPI`` raise ImportError."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)


def install_fake_mpi4py(monkeypatch: pytest.MonkeyPatch, size: int) -> list[int]:
    """A stand-in mpi4py whose COMM_WORLD has ``size`` ranks; returns a list that records each size query."""
    calls: list[int] = []

    class Comm:
        def Get_size(self) -> int:
            calls.append(size)
            return size

    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = Comm()  # type: ignore[attr-defined]
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return calls


# --------------------------------------------------------------------------------------------------------
# each launcher's variable set


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param(
            {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
            RankInfo(
                rank=3,
                local_rank=1,
                world_size=8,
                local_world_size=2,
                node_rank=1,
                sources=("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
            ),
            id="torchrun",
        ),
        pytest.param(
            # PALS with the world size passed as `mpiexec --env WORLD_SIZE=24`; PMIx rides along.
            {
                "PALS_RANKID": "13",
                "PALS_LOCAL_RANKID": "1",
                "PALS_LOCAL_SIZE": "12",
                "PALS_NODEID": "1",
                "PMIX_RANK": "13",
                "WORLD_SIZE": "24",
            },
            RankInfo(
                rank=13,
                local_rank=1,
                world_size=24,
                local_world_size=12,
                node_rank=1,
                sources=(
                    "WORLD_SIZE",
                    "PALS_RANKID",
                    "PALS_LOCAL_RANKID",
                    "PALS_LOCAL_SIZE",
                    "PALS_NODEID",
                    "PMIX_RANK",
                ),
            ),
            id="pals",
        ),
        pytest.param(
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "9"},
            RankInfo(
                rank=1,
                local_rank=1,
                world_size=2,
                local_world_size=2,
                sources=("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
            ),
            id="mpich-hydra",
        ),
        pytest.param(
            {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4"},
            RankInfo(
                rank=5,
                local_rank=1,
                world_size=8,
                local_world_size=4,
                sources=("PMI_RANK", "PMI_LOCAL_RANK", "PMI_SIZE", "PMI_LOCAL_SIZE"),
            ),
            id="pmi-local-rank",
        ),
        pytest.param(
            {
                "OMPI_COMM_WORLD_RANK": "6",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "PMIX_RANK": "6",
            },
            RankInfo(
                rank=6,
                local_rank=2,
                world_size=8,
                local_world_size=4,
                sources=(
                    "PMIX_RANK",
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ),
            ),
            id="open-mpi",
        ),
        pytest.param(
            {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "8", "SLURM_NODEID": "1"},
            RankInfo(
                rank=7,
                local_rank=3,
                world_size=8,
                node_rank=1,
                sources=("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID"),
            ),
            id="slurm",
        ),
    ],
)
def test_each_launcher(environ: dict[str, str], expected: RankInfo) -> None:
    assert read_rank_env(environ, use_mpi4py=False) == expected


def test_reads_os_environ_by_default(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_PROCID", "2")
    clean_env.setenv("SLURM_LOCALID", "0")
    clean_env.setenv("SLURM_NTASKS", "4")
    info = read_rank_env()
    assert (info.rank, info.local_rank, info.world_size) == (2, 0, 4)
    assert optional_rank_env() == info


def test_empty_value_counts_as_unset() -> None:
    info = read_rank_env(
        {"RANK": "", "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": " ", "LOCAL_RANK": "1"}
    )
    assert (info.rank, info.local_rank, info.sources) == (1, 1, ("LOCAL_RANK", "PMI_RANK", "PMI_SIZE"))


# every family's variables, filled consistently for one rank of a layout
def family_env(family: str, rank: int, local: int, size: int, local_size: int, node: int) -> dict[str, str]:
    by_field = {
        "rank": rank,
        "local_rank": local,
        "world_size": size,
        "local_world_size": local_size,
        "node_rank": node,
    }
    return {
        v.name: str(by_field[v.field])
        for v in _rankenv._VARS  # the table under test names each variable's meaning
        if v.launcher == family
    }


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    """(rank, local rank, world size, local world size, node rank) of a block layout of whole nodes."""
    ppn = draw(st.integers(1, 16))
    nodes = draw(st.integers(1, 64))
    rank = draw(st.integers(0, ppn * nodes - 1))
    return rank, rank % ppn, ppn * nodes, ppn, rank // ppn


@given(layout=layouts(), families=st.sets(st.sampled_from(sorted(LAUNCHER_VARIABLES)), min_size=1))
def test_agreeing_families_give_the_layout(
    layout: tuple[int, int, int, int, int], families: set[str]
) -> None:
    rank, local, size, local_size, node = layout
    environ: dict[str, str] = {}
    for family in families:
        environ.update(family_env(family, rank, local, size, local_size, node))
    has_size = any(v in environ for v in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"))
    has_local = any(v in environ for v in ("LOCAL_RANK", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"))
    has_local = has_local or any(v in environ for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"))
    if not has_local and size > 1:
        # PMIx alone says no local rank: the device index is unknowable on a multi-node layout.
        with pytest.raises(RankEnvError, match=r"no local rank variable is set \(rank \d+ from PMIX_RANK"):
            read_rank_env(environ, world_size=size, use_mpi4py=False)
        return
    info = read_rank_env(environ, world_size=None if has_size else size, use_mpi4py=False)
    assert (info.rank, info.local_rank, info.world_size) == (rank, local, size)
    assert set(info.sources) - {"world_size argument"} == set(environ)
    assert ("world_size argument" in info.sources) == (not has_size)


# --------------------------------------------------------------------------------------------------------
# disagreement


def test_stale_rank_zero_from_outer_launcher_raises() -> None:
    environ = {"RANK": "0", "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env(environ)
    assert str(excinfo.value) == (
        "launcher variables disagree, so this process cannot know its place in the world:\n"
        "  rank: RANK=0 (torchrun), PMI_RANK=1 (MPICH hydra)\n"
        "Only the launcher that started this process sets true values; the others were inherited from an "
        "outer launcher or a job script (a stale RANK=0 would make every rank rank 0). Unset them where this "
        "process is launched, e.g. `env -u RANK mpiexec ...`:\n"
        "  started by torchrun? unset PMI_RANK MPI_LOCALRANKID PMI_SIZE before launching\n"
        "  started by MPICH hydra? unset RANK before launching"
    )


_RANK_VARS = [v.name for v in _rankenv._VARS if v.field == "rank"]
_SIZE_VARS = [v.name for v in _rankenv._VARS if v.field == "world_size"]


@given(
    names=st.lists(st.sampled_from(_RANK_VARS), min_size=2, max_size=len(_RANK_VARS), unique=True),
    values=st.lists(st.integers(0, 10_000), min_size=len(_RANK_VARS), max_size=len(_RANK_VARS)),
)
def test_any_rank_disagreement_names_every_variable(names: list[str], values: list[int]) -> None:
    environ = {name: str(value) for name, value in zip(names, values[: len(names)], strict=True)}
    environ.update(WORLD_SIZE="100000", LOCAL_RANK="0")
    if len(set(environ[n] for n in names)) == 1:
        assert read_rank_env(environ).rank == values[0]
        return
    with pytest.raises(RankEnvError, match="disagree") as excinfo:
        read_rank_env(environ)
    rank_line = next(line for line in str(excinfo.value).splitlines() if line.startswith("  rank: "))
    for name in names:
        assert f"{name}={environ[name]} (" in rank_line


@given(
    names=st.lists(st.sampled_from(_SIZE_VARS), min_size=2, max_size=len(_SIZE_VARS), unique=True),
    sizes=st.lists(st.integers(1, 1000), min_size=len(_SIZE_VARS), max_size=len(_SIZE_VARS)),
)
def test_any_world_size_disagreement_names_every_variable(names: list[str], sizes: list[int]) -> None:
    environ = {name: str(size) for name, size in zip(names, sizes[: len(names)], strict=True)}
    environ.update(RANK="0", LOCAL_RANK="0")
    if len(set(sizes[: len(names)])) == 1:
        assert read_rank_env(environ).world_size == sizes[0]
        return
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env(environ)
    size_line = next(line for line in str(excinfo.value).splitlines() if line.startswith("  world size: "))
    assert size_line == "  world size: " + ", ".join(
        f"{n}={environ[n]} ({_rankenv._launcher_of(n)})" for n in _SIZE_VARS if n in names
    )


def test_local_rank_and_node_disagreements_are_listed_per_field() -> None:
    environ = {
        "SLURM_PROCID": "4",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_NODEID": "1",
        "OMPI_COMM_WORLD_RANK": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "8",
        "PALS_NODEID": "2",
    }
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env(environ)
    lines = str(excinfo.value).splitlines()
    assert lines[1:3] == [
        "  local rank: OMPI_COMM_WORLD_LOCAL_RANK=1 (Open MPI), SLURM_LOCALID=0 (Slurm)",
        "  node rank: PALS_NODEID=2 (PALS), SLURM_NODEID=1 (Slurm)",
    ]
    assert lines[-3:] == [
        "  started by PALS? unset OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_SIZE "
        "SLURM_PROCID SLURM_LOCALID SLURM_NTASKS SLURM_NODEID before launching",
        "  started by Open MPI? unset PALS_NODEID SLURM_PROCID SLURM_LOCALID SLURM_NTASKS SLURM_NODEID "
        "before launching",
        "  started by Slurm? unset PALS_NODEID OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_LOCAL_RANK "
        "OMPI_COMM_WORLD_SIZE before launching",
    ]


# --------------------------------------------------------------------------------------------------------
# bad values


@given(
    name=st.sampled_from(ALL_VARS),
    value=st.text(min_size=1).filter(lambda t: t.strip() and not re.fullmatch(r"\s*[0-9]+\s*", t)),
)
def test_non_integer_value_raises_naming_the_variable(name: str, value: str) -> None:
    environ = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", name: value}
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env(environ, use_mpi4py=False)
    message = str(excinfo.value)
    assert message.startswith(f"{name}={value!r} (")
    assert f"fix or unset {name} in the environment that starts this process" in message


@pytest.mark.parametrize("name", ["WORLD_SIZE", "PMI_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_zero_size_raises(name: str) -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"RANK": "0", "LOCAL_RANK": "0", name: "0"}, world_size=1)
    assert re.fullmatch(
        rf"{name}='0' \([\w ]+ (local )?world size\) is not a positive integer; fix or unset {name} in the "
        rf"environment that starts this process",
        str(excinfo.value),
    )


def test_rank_not_below_world_size_raises() -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"})
    assert str(excinfo.value) == (
        "SLURM_PROCID=4 is not below the world size 4 (from SLURM_NTASKS): ranks run 0..3. One of them is "
        "stale (inherited from another launch); unset it, or launch with -n matching the world size"
    )


def test_rank_not_below_world_size_argument_raises() -> None:
    with pytest.raises(
        RankEnvError, match=r"^PALS_RANKID=2 is not below the world size 2 \(from world_size "
    ):
        read_rank_env({"PALS_RANKID": "2", "PALS_LOCAL_RANKID": "0"}, world_size=2)


def test_local_rank_not_below_local_world_size_raises() -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"RANK": "5", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"})
    assert str(excinfo.value) == (
        "LOCAL_RANK=2 is not below the local world size 2 (from LOCAL_WORLD_SIZE): local ranks run 0..1. "
        "One of them is stale (inherited from another launch); unset it"
    )


def test_local_world_size_above_world_size_raises() -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"PMI_RANK": "0", "MPI_LOCALRANKID": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "4"})
    assert str(excinfo.value) == (
        "local world size 4 (from MPI_LOCALNRANKS) exceeds the world size 2 (from PMI_SIZE): one of them is "
        "stale; unset it"
    )


def test_rank_info_validates_itself() -> None:
    with pytest.raises(RankEnvError, match=r"^rank 2 is not in 0\.\.1 for world size 2 \(from the caller\)"):
        RankInfo(rank=2, local_rank=0, world_size=2)
    with pytest.raises(RankEnvError, match=r"^local rank 3 is not in 0\.\.2 for local world size 3"):
        RankInfo(rank=3, local_rank=3, world_size=8, local_world_size=3)


# --------------------------------------------------------------------------------------------------------
# world size: variables, argument, mpi4py


def test_world_size_argument_fills_in_for_pals() -> None:
    info = read_rank_env({"PALS_RANKID": "1", "PALS_LOCAL_RANKID": "1"}, world_size=2, use_mpi4py=False)
    assert (info.world_size, info.sources) == (2, ("PALS_RANKID", "PALS_LOCAL_RANKID", "world_size argument"))


def test_world_size_argument_must_agree_with_variables() -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "24"}, world_size=12)
    assert str(excinfo.value) == (
        "WORLD_SIZE=24 (torchrun) disagrees with world_size=12 given by the caller: the launch started a "
        "different number of ranks than expected; fix the launcher's rank count (-n) or unset a stale WORLD_SIZE"
    )


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_world_size_argument_must_be_positive_int(bad: object) -> None:
    with pytest.raises(RankEnvError, match=rf"^world_size={re.escape(repr(bad))} is not a positive integer"):
        read_rank_env({"RANK": "0", "LOCAL_RANK": "0"}, world_size=bad)  # type: ignore[arg-type]


def test_missing_world_size_without_mpi4py(no_mpi4py: None) -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PMIX_RANK": "0"})
    assert re.fullmatch(
        r"the world size is unknown: PALS_RANKID is set but none of WORLD_SIZE, PMI_SIZE, "
        r"OMPI_COMM_WORLD_SIZE, SLURM_NTASKS is, no world_size was passed, and mpi4py is not importable "
        r"\(.+\)\. PALS exports no world size: launch with `mpiexec --env WORLD_SIZE=<ranks> \.\.\.`, export "
        r"WORLD_SIZE=<ranks>, install mpi4py, or pass world_size=<ranks>\.",
        str(excinfo.value),
    )


def test_missing_world_size_with_mpi4py_uses_comm_world(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = install_fake_mpi4py(monkeypatch, size=24)
    info = read_rank_env({"PALS_RANKID": "13", "PALS_LOCAL_RANKID": "1", "PMIX_RANK": "13"})
    assert (info.rank, info.local_rank, info.world_size) == (13, 1, 24)
    assert info.sources == ("PALS_RANKID", "PALS_LOCAL_RANKID", "PMIX_RANK", "mpi4py COMM_WORLD size")
    assert calls == [24]


def test_mpi4py_is_not_imported_when_a_variable_gives_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = install_fake_mpi4py(monkeypatch, size=99)
    assert read_rank_env({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}).world_size == 2
    assert read_rank_env({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0"}, world_size=3).world_size == 3
    assert calls == []


def test_mpi4py_refused_by_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = install_fake_mpi4py(monkeypatch, size=24)
    with pytest.raises(
        RankEnvError, match=r"and mpi4py was not consulted \(use_mpi4py=False\)\. PALS exports"
    ):
        read_rank_env({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0"}, use_mpi4py=False)
    assert calls == []


def test_mpi4py_not_consulted_for_torchrun_rank_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # a singleton MPI_Init would report size 1 and hide the missing WORLD_SIZE
    calls = install_fake_mpi4py(monkeypatch, size=1)
    with pytest.raises(RankEnvError, match=r"only torchrun's RANK is set, not an MPI launch"):
        read_rank_env({"RANK": "0", "LOCAL_RANK": "0"})
    assert calls == []


def test_mpi4py_singleton_size_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_mpi4py(monkeypatch, size=1)
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "5"})
    assert str(excinfo.value) == (
        "PALS_RANKID=5 is not below mpi4py's COMM_WORLD size 1: MPI in this process was not started by the "
        "launcher that set PALS_RANKID (mpi4py built against another MPI, or a singleton MPI_Init). Pass the "
        "world size instead: `mpiexec --env WORLD_SIZE=<ranks>`"
    )


def test_mpi4py_init_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    class Boom(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            raise RuntimeError("MPI_Init failed: no PMI server")

    monkeypatch.setitem(sys.modules, "mpi4py", Boom("mpi4py"))
    with pytest.raises(
        RankEnvError, match=r"mpi4py could not initialize MPI \(RuntimeError: MPI_Init failed"
    ):
        read_rank_env({"PMIX_RANK": "0", "PALS_LOCAL_RANKID": "0"})


# --------------------------------------------------------------------------------------------------------
# local rank missing, optional reader


def test_missing_local_rank_single_node_falls_back_to_rank() -> None:
    assert read_rank_env({"RANK": "0", "WORLD_SIZE": "1"}).local_rank == 0
    info = read_rank_env({"PMIX_RANK": "3", "PALS_LOCAL_SIZE": "4"}, world_size=4, use_mpi4py=False)
    assert info.local_rank == 3


def test_missing_local_rank_multi_node_raises() -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"RANK": "3", "WORLD_SIZE": "8"})
    assert str(excinfo.value) == (
        "no local rank variable is set (rank 3 from RANK, world size 8): looked for LOCAL_RANK, "
        "PALS_LOCAL_RANKID, MPI_LOCALRANKID, PMI_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID. The "
        "device index cannot be known on a multi-node launch; export LOCAL_RANK (and LOCAL_WORLD_SIZE) per "
        "process."
    )


def test_missing_rank_raises_and_names_what_is_set() -> None:
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env({"WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    assert str(excinfo.value) == (
        "no launcher rank variable is set (only LOCAL_RANK, WORLD_SIZE is set): looked for RANK, PALS_RANKID, "
        "PMIX_RANK, PMI_RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID. Start this process with a launcher "
        "(mpiexec, srun, torchrun) or export RANK, LOCAL_RANK and WORLD_SIZE yourself."
    )
    with pytest.raises(RankEnvError, match=r"^no launcher rank variable is set: looked for RANK, "):
        read_rank_env({})


def test_optional_rank_env() -> None:
    assert optional_rank_env({}) is None
    assert optional_rank_env({"RANK": "", "HOME": "/root", "MASTER_ADDR": "x"}) is None
    info = optional_rank_env({"PALS_RANKID": "1", "PALS_LOCAL_RANKID": "1"}, world_size=2, use_mpi4py=False)
    assert info is not None and info.rank == 1
    with pytest.raises(RankEnvError, match="no launcher rank variable is set"):
        optional_rank_env({"WORLD_SIZE": "2"})


def test_launcher_variables_cover_every_family() -> None:
    assert sorted(LAUNCHER_VARIABLES) == ["MPICH hydra", "Open MPI", "PALS", "PMIx", "Slurm", "torchrun"]
    assert LAUNCHER_VARIABLES["PALS"] == (
        "PALS_RANKID",
        "PALS_LOCAL_RANKID",
        "PALS_LOCAL_SIZE",
        "PALS_NODEID",
    )
    assert len(ALL_VARS) == len(set(ALL_VARS))


# --------------------------------------------------------------------------------------------------------
# under a real mpiexec (MPICH hydra): the variables it exports, and mpi4py's size


_PROBE = """
import json, os, sys
from pytest_sprite.env.rank_variables import read_rank_env
info = read_rank_env()
env = {k: os.environ[k] for k in ("PMI_RANK", "MPI_LOCALRANKID")}
via_mpi4py = read_rank_env(env)  # PMI_SIZE left out of the mapping: the size must come from mpi4py
row = [info.rank, info.local_rank, info.world_size, list(info.sources), via_mpi4py.world_size,
       list(via_mpi4py.sources)]
with open(os.path.join(sys.argv[1], os.environ["PMI_RANK"] + ".json"), "w") as fh:
    json.dump(row, fh)  # a file per rank: mpiexec may interleave the ranks' stdout mid-line
"""


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH (pip install mpich)")
def test_real_mpiexec_ranks(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, "-c", _PROBE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    sources = ["PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"]
    via = ["PMI_RANK", "MPI_LOCALRANKID", "mpi4py COMM_WORLD size"]
    assert rows == [[0, 0, 2, sources, 2, via], [1, 1, 2, sources, 2, via]]


# --------------------------------------------------------------------------------------------------------
# host lists


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("nid001", ["nid001"]),
        ("nid[001-004,007]", ["nid001", "nid002", "nid003", "nid004", "nid007"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("x[08-10]", ["x08", "x09", "x10"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu[1-2].cluster,login", ["gpu1.cluster", "gpu2.cluster", "login"]),
        ("[1-2]", ["1", "2"]),
        (" a , b ", ["a", "b"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("nid[1-", "unclosed '['"),
        ("nid]1", "unmatched ']' at position 3"),
        ("nid[[1]]", "nested '[' at position 4"),
        ("nid[a-b]", "range 'a-b' is not N or N-M"),
        ("nid[1-2-3]", "range '1-2-3' is not N or N-M"),
        ("nid[]", "range '' is not N or N-M"),
        ("nid[3-1]", "range '3-1' runs backwards"),
        ("a,,b", "an empty host name"),
        ("a b", "whitespace inside 'a b'"),
    ],
)
def test_bad_hostlist_raises(text: str, why: str) -> None:
    with pytest.raises(RankEnvError) as excinfo:
        expand_hostlist(text, source="SLURM_JOB_NODELIST")
    assert str(excinfo.value) == (
        f"SLURM_JOB_NODELIST={text!r} is not a Slurm host list ({why}); expected names like "
        f"'nid[001-004,007]' or 'a1,b[2-3]'. Export MASTER_ADDR=<first node> to bypass the node list."
    )


_prefix = st.from_regex(r"[a-z][a-z0-9-]{0,6}[a-z-]", fullmatch=True)
_ranges = st.lists(
    st.tuples(st.integers(0, 500), st.integers(0, 30), st.integers(1, 4)).map(
        lambda t: (t[0], t[0] + t[1], t[2])  # (lo, hi, zero-padded width)
    ),
    min_size=1,
    max_size=4,
)


@given(groups=st.lists(st.tuples(_prefix, _ranges), min_size=1, max_size=4))
def test_compressed_hostlist_round_trips(groups: list[tuple[str, list[tuple[int, int, int]]]]) -> None:
    text_items, expected = [], []
    for prefix, ranges in groups:
        parts = []
        for lo, hi, width in ranges:
            parts.append(f"{lo:0{width}d}-{hi:0{width}d}" if hi > lo else f"{lo:0{width}d}")
            expected += [prefix + str(n).zfill(len(f"{lo:0{width}d}")) for n in range(lo, hi + 1)]
        text_items.append(f"{prefix}[{','.join(parts)}]")
    text = ",".join(text_items)
    assert expand_hostlist(text) == expected
    assert rendezvous_host({"SLURM_JOB_NODELIST": text}) == expected[0]


def test_malformed_tail_is_caught_before_the_first_host_is_used() -> None:
    with pytest.raises(
        RankEnvError, match=r"^SLURM_JOB_NODELIST='a,b\[1-' is not a Slurm host list \(unclosed"
    ):
        rendezvous_host({"SLURM_JOB_NODELIST": "a,b[1-"})
    with pytest.raises(RankEnvError, match=r"\(range 'x' is not N or N-M\)"):
        rendezvous_host({"SLURM_JOB_NODELIST": "a,b[x]"})


def test_first_host_of_a_huge_list_is_cheap() -> None:
    # lazily expanded: a 10**7-node list must not be materialized to find its first host
    assert rendezvous_host({"SLURM_NODELIST": "n[0000000-9999999]"}) == "n0000000"


# --------------------------------------------------------------------------------------------------------
# rendezvous host


def test_rendezvous_host_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("\n  x4102c5s2b0n0.hsn.cm.aurora.alcf.anl.gov\nx4102c5s2b0n0.hsn\nx4102c5s3b0n0\n")
    monkeypatch.setattr(socket, "gethostname", lambda: "this-host")
    env = {
        "MASTER_ADDR": "10.0.0.7",
        "PBS_NODEFILE": str(nodefile),
        "SLURM_STEP_NODELIST": "step[3-4]",
        "SLURM_JOB_NODELIST": "job[1-4]",
        "SLURM_NODELIST": "old[1-4]",
    }
    expected = ["10.0.0.7", "x4102c5s2b0n0.hsn.cm.aurora.alcf.anl.gov", "step3", "job1", "old1", "this-host"]
    for want in expected:
        assert rendezvous_host(env) == want
        if env:
            del env[next(iter(env))]
    assert rendezvous_host({"MASTER_ADDR": " ", "SLURM_JOB_NODELIST": "a"}) == "a"


def test_rendezvous_host_reads_os_environ(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_JOB_NODELIST", "nid[007-008]")
    assert rendezvous_host() == "nid007"


def test_pbs_nodefile_missing_raises(tmp_path: Path) -> None:
    path = tmp_path / "gone"
    with pytest.raises(RankEnvError) as excinfo:
        rendezvous_host({"PBS_NODEFILE": str(path), "SLURM_JOB_NODELIST": "a"})
    assert str(excinfo.value) == (
        f"PBS_NODEFILE={str(path)!r} cannot be read (No such file or directory); run inside the PBS job that "
        f"set it, or export MASTER_ADDR=<first node> to name the rendezvous host yourself"
    )


def test_pbs_nodefile_empty_raises(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_text("\n   \n")
    with pytest.raises(RankEnvError) as excinfo:
        rendezvous_host({"PBS_NODEFILE": str(path)})
    assert str(excinfo.value) == (
        f"PBS_NODEFILE={str(path)!r} lists no host; export MASTER_ADDR=<first node> to name the rendezvous host"
    )


def test_bad_slurm_nodelist_names_its_variable() -> None:
    with pytest.raises(RankEnvError, match=r"^SLURM_STEP_NODELIST='n\[1-' is not a Slurm host list"):
        rendezvous_host({"SLURM_STEP_NODELIST": "n[1-", "SLURM_JOB_NODELIST": "ok"})


# --------------------------------------------------------------------------------------------------------
# rendezvous port


@pytest.mark.parametrize("port", ["1", "29500", "65535", " 4242 "])
def test_master_port_wins(port: str) -> None:
    assert rendezvous_port({"MASTER_PORT": port, "PBS_JOBID": "1.pbs"}) == int(port)


@pytest.mark.parametrize("port", ["0", "65536", "-1", "abc", "29500.0", "0x50"])
def test_bad_master_port_raises(port: str) -> None:
    with pytest.raises(RankEnvError) as excinfo:
        rendezvous_port({"MASTER_PORT": port})
    assert str(excinfo.value) == (
        f"MASTER_PORT={port!r} is not a port number in 1..65535; export a free port (e.g. MASTER_PORT=29500) "
        f"or unset MASTER_PORT to derive one from the job id"
    )


def test_derived_port_is_the_documented_formula() -> None:
    # pinned: every node of a job, whatever version it runs, must derive the same port
    assert derive_port("8142501.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov") == 21_417
    assert derive_port("123456") == 25_970


@given(job_id=st.text(min_size=1))
def test_derived_port_in_range_and_deterministic(job_id: str) -> None:
    port = derive_port(job_id)
    digest = hashlib.sha256(job_id.encode()).digest()
    assert port == 20_000 + int.from_bytes(digest[:8], "big") % 10_000
    assert port in PORT_RANGE


def test_job_id_precedence() -> None:
    assert rendezvous_port({"PBS_JOBID": "a", "SLURM_JOB_ID": "b"}) == derive_port("a")
    assert rendezvous_port({"SLURM_JOB_ID": "b", "SLURM_JOBID": "c"}) == derive_port("b")
    assert rendezvous_port({"SLURM_JOBID": "c"}) == derive_port("c")


def test_derived_ports_spread() -> None:
    # consecutive job ids must not crowd onto a few ports (500 ids into 10000 ports: ~488 distinct expected)
    assert len({derive_port(str(8_000_000 + k)) for k in range(500)}) >= 470


def test_free_port_fallback_is_bindable(clean_env: pytest.MonkeyPatch) -> None:
    port = rendezvous_port()
    assert 1 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("", port))
    assert free_port("127.0.0.1") != 0


def test_disagreement_inside_one_family_names_both() -> None:
    environ = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "PMI_LOCAL_RANK": "7"}
    with pytest.raises(RankEnvError) as excinfo:
        read_rank_env(environ)
    assert str(excinfo.value).splitlines()[1:2] + str(excinfo.value).splitlines()[-1:] == [
        "  local rank: MPI_LOCALRANKID=1 (MPICH hydra), PMI_LOCAL_RANK=7 (MPICH hydra)",
        "  MPI_LOCALRANKID and PMI_LOCAL_RANK both come from MPICH hydra and disagree: the one this launch did "
        "not set was inherited; unset it",
    ]
    assert "started by" not in str(excinfo.value)


def test_torchrun_variables_read_back_as_the_world_they_describe(clean_env: pytest.MonkeyPatch) -> None:
    """The one writer of rank variables and the one reader agree; the run id is torchrun's marker."""
    variables = _rankenv.torchrun_variables(
        rank=3, local_rank=1, world_size=4, local_world_size=2, node=1, master_addr="h0", master_port=29511
    )
    info = read_rank_env(variables, use_mpi4py=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank) == (
        3,
        1,
        4,
        2,
        1,
    )
    assert variables["MASTER_ADDR"] == "h0" and variables["MASTER_PORT"] == "29511"
    assert variables["TORCHELASTIC_RUN_ID"] == _rankenv.TORCHELASTIC_RUN_ID


def test_become_rank_drops_the_launch_that_started_the_session(clean_env: pytest.MonkeyPatch) -> None:
    """A process of a world we start sees that world only: no PMI size, Slurm task count or PMI socket."""
    clean_env.setenv("PMI_SIZE", "8")
    clean_env.setenv("PMI_RANK", "5")
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("PMI_FD", "7")
    clean_env.setenv("RANK", "5")
    variables = _rankenv.torchrun_variables(
        rank=0, local_rank=0, world_size=2, local_world_size=2, node=0, master_addr="127.0.0.1", master_port=1
    )
    for name in variables:  # so that monkeypatch removes what become_rank sets, after the test
        clean_env.setenv(name, "unset")
    _rankenv.become_rank(variables)
    for name in ("PMI_SIZE", "PMI_RANK", "SLURM_NTASKS", "PMI_FD"):
        assert name not in os.environ
    assert {name: os.environ[name] for name in variables} == variables
    info = read_rank_env(use_mpi4py=False)
    assert (info.rank, info.world_size) == (0, 2)


def test_gloo_is_given_the_interface_others_reach_when_the_name_is_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Debian's ``127.0.1.1 thishost`` makes gloo listen on loopback; a world across nodes gets eth0 (issue 25)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(
        _rankenv.socket, "gethostbyname", lambda name: "127.0.1.1" if name == "me" else "10.0.0.1"
    )
    monkeypatch.setattr(_rankenv.socket, "gethostname", lambda: "me")
    monkeypatch.setattr(
        _rankenv, "_ipv4_interfaces", lambda: {"lo": "127.0.0.1", "eth0": "10.0.0.2", "ib0": "10.1.0.2"}
    )
    monkeypatch.setattr(_rankenv, "_local_address_toward", lambda host: {"node1": "10.0.0.2"}.get(host))
    monkeypatch.setattr(_rankenv, "_default_route_interface", lambda: "ib0")
    spans = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert _rankenv.gloo_interface({**spans, "MASTER_ADDR": "node1"}) == "eth0"  # the route to the master
    assert (
        _rankenv.gloo_interface({**spans, "MASTER_ADDR": "me"}) == "ib0"
    )  # on the master: the default route
    assert _rankenv.gloo_interface({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "me"}) is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "hsn0")
    assert _rankenv.gloo_interface({**spans, "MASTER_ADDR": "node1"}) is None  # the user's choice stands
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(_rankenv.socket, "gethostbyname", lambda name: "10.0.0.2")
    assert (
        _rankenv.gloo_interface({**spans, "MASTER_ADDR": "node1"}) is None
    )  # the name is reachable: gloo's own
