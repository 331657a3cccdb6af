"""Launcher command lines and launcher checks, without starting anything (pure and fast).

The commands are the contract with each cluster's launcher: MPICH / Open MPI option spellings, PALS's
``--env WORLD_SIZE``, srun's allocation defaults, torchrun's single-node rendezvous. Each is pinned here
in full, so a change to one is a visible, reviewed change.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pytest_sprite.env.rank_variables import LAUNCHER_VARIABLES, hosts_in_nodefile
from pytest_sprite.errors import LaunchError
from pytest_sprite.launch.launchers import BUILTIN_LAUNCHERS, LauncherRegistry, pytest_sprite_add_launchers
from pytest_sprite.launch.launchers._command import (
    has_option,
    unset_foreign_rank_variables,
)
from pytest_sprite.launch.launchers.base import LaunchRequest
from pytest_sprite.launch.launchers.mpiexec import (
    HOW_TO_GET,
    MpiexecLauncher,
    detect_flavour,
    mpiexec_command,
)
from pytest_sprite.launch.launchers.pals import PalsLauncher, default_ppn, pals_command
from pytest_sprite.launch.launchers.srun import SrunLauncher, allocation_tasks, srun_command
from pytest_sprite.launch.launchers.torchrun import TorchrunLauncher, torchrun_command

pytestmark = pytest.mark.cpu

AGENT = ("/py/bin/python", "-m", "pytest", "tests", "--sprite-agent=node0:4000")


def request(world: int = 4, *, ppn: int | None = None, args: tuple[str, ...] = ()) -> LaunchRequest:
    return LaunchRequest(
        world_size=world,
        controller_host="node0",
        controller_port=4000,
        token="secret",
        agent_argv=AGENT,
        ppn=ppn,
        launcher_args=args,
        env={"SPRITE_TOKEN": "secret", "SPRITE_WORLD_SIZE": str(world)},
        log_path=Path("/nonexistent/launch.log"),
    )


def unset(*families: str, keep: tuple[str, ...] = ()) -> list[str]:
    """The ``env -u`` words for every rank variable outside ``families`` (written out independently)."""
    words = ["env"]
    for family, names in LAUNCHER_VARIABLES.items():
        if family not in families:
            words += [w for name in names if name not in keep for w in ("-u", name)]
    return words


def test_unset_words_cover_exactly_the_foreign_families() -> None:
    words = unset_foreign_rank_variables(["MPICH hydra"])
    names = words[2::2]
    assert words[0] == "env" and set(words[1::2]) == {"-u"}
    assert set(names) == {n for f, ns in LAUNCHER_VARIABLES.items() if f != "MPICH hydra" for n in ns}
    assert "PMI_RANK" not in names and "RANK" in names and "SLURM_PROCID" in names
    assert "WORLD_SIZE" not in unset_foreign_rank_variables(["PALS"], keep=["WORLD_SIZE"])
    with pytest.raises(ValueError, match=r"unknown launcher families \['mpich'\]; known: "):
        unset_foreign_rank_variables(["mpich"])


@pytest.mark.parametrize(
    ("words", "names", "expected"),
    [
        (["--ppn", "4"], ("--ppn",), True),
        (["--ppn=4"], ("--ppn",), True),
        (["--ppnx=4"], ("--ppn",), False),
        (["-N4"], ("-N",), True),
        (["-Nfoo"], ("-N",), False),
        (["--cpu-bind=list:1-8"], ("--cpu-bind",), True),
        ([], ("--ppn",), False),
    ],
)
def test_has_option(words: list[str], names: tuple[str, ...], expected: bool) -> None:
    assert has_option(words, *names) is expected


# --------------------------------------------------------------------------------------------------------
# mpiexec


@pytest.mark.parametrize(
    ("output", "flavour"),
    [
        ("HYDRA build details:\n    Version: 4.2.0", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.13 Build 20240515", "mpich"),
        ("mpiexec (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi"),
        ("mpirun (Open MPI) 5.0.3", "openmpi"),
        ("prterun (PMIx Reference RunTime Environment) 3.0.5 (PRRTE)", "openmpi"),
        ("mpiexec version 1.4.0 (PALS)", "unknown"),
        ("", "unknown"),
    ],
)
def test_detect_flavour(output: str, flavour: str) -> None:
    assert detect_flavour(output) == flavour


def test_mpiexec_mpich_command() -> None:
    argv = mpiexec_command(
        request(4, ppn=2, args=("-genv", "FOO", "1")), program="/bin/mpiexec", flavour="mpich"
    )
    assert argv == [
        "/bin/mpiexec", "-n", "4", "-ppn", "2", "-genv", "FOO", "1", *unset("MPICH hydra"), *AGENT,
    ]  # fmt: skip


def test_mpiexec_openmpi_command_exports_the_session_variables_by_name() -> None:
    argv = mpiexec_command(request(8, ppn=4), program="mpiexec", flavour="openmpi")
    assert argv == [
        "mpiexec", "-n", "8", "--map-by", "ppr:4:node", "-x", "SPRITE_TOKEN", "-x", "SPRITE_WORLD_SIZE",
        *unset("Open MPI", "PMIx"), *AGENT,
    ]  # fmt: skip
    assert "secret" not in argv  # the token travels in the environment, never on a command line


def test_mpiexec_user_ppn_option_wins() -> None:
    argv = mpiexec_command(request(4, ppn=2, args=("-ppn", "1")), program="mpiexec", flavour="mpich")
    assert argv[:5] == ["mpiexec", "-n", "4", "-ppn", "1"]


def test_mpiexec_unknown_flavour() -> None:
    argv = mpiexec_command(request(2), program="mpiexec", flavour="unknown")
    assert argv == ["mpiexec", "-n", "2", *unset("MPICH hydra", "Open MPI", "PMIx", "PALS"), *AGENT]
    with pytest.raises(LaunchError) as excinfo:
        mpiexec_command(request(2, ppn=1), program="/x/mpiexec", flavour="unknown")
    assert str(excinfo.value) == (
        "--launcher=mpiexec: --ppn=1 was given, but `/x/mpiexec` is neither MPICH nor Open MPI (its --version "
        "names neither), so the ranks-per-node option is unknown. Pass the option yourself with "
        "--launcher-args (and drop --ppn), or use --launcher=pals on Aurora."
    )


def fake_program(directory: Path, name: str, script: str = "#!/bin/sh\nexit 0\n") -> Path:
    path = directory / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_mpiexec_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError) as excinfo:
        MpiexecLauncher().check()
    assert str(excinfo.value) == f"--launcher=mpiexec: `mpiexec` is not on PATH. {HOW_TO_GET}"
    assert "pip install mpich" in HOW_TO_GET and "module load" in HOW_TO_GET


def test_mpiexec_check_reads_the_flavour(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_program(tmp_path, "mpiexec", "#!/bin/sh\necho 'mpiexec (Open MPI) 4.1.6'\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    launcher = MpiexecLauncher()
    launcher.check()
    assert (launcher.program, launcher.flavour) == (str(tmp_path / "mpiexec"), "openmpi")


# --------------------------------------------------------------------------------------------------------
# pals


def test_pals_command() -> None:
    argv = pals_command(request(24, args=("--no-vni",)), program="mpiexec", ppn=12)
    assert argv == [
        "mpiexec", "-n", "24", "--ppn", "12", "--cpu-bind", "none", "--env", "WORLD_SIZE=24", "--no-vni",
        *unset("PALS", "PMIx", "MPICH hydra", keep=("WORLD_SIZE",)), *AGENT,
    ]  # fmt: skip
    assert "WORLD_SIZE" not in argv[argv.index("env") :]


def test_pals_user_binding_and_ppn_win() -> None:
    args = ("--cpu-bind=list:1-8:9-16", "--ppn", "2")
    argv = pals_command(request(4, args=args), program="mpiexec", ppn=4)
    assert argv[: argv.index("env")] == ["mpiexec", "-n", "4", "--env", "WORLD_SIZE=4", *args]


def test_pals_default_ppn_from_the_pbs_node_file(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1000c0s0b0n0\n" * 12 + "x1000c0s1b0n0\n" * 12)
    assert hosts_in_nodefile(nodefile) == ["x1000c0s0b0n0", "x1000c0s1b0n0"]
    assert default_ppn(24, {"PBS_NODEFILE": str(nodefile)}) == 12
    assert default_ppn(13, {"PBS_NODEFILE": str(nodefile)}) == 7
    assert default_ppn(4, {}) == 4
    assert default_ppn(4, {"PBS_NODEFILE": str(tmp_path / "gone")}) == 4


def test_pals_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        LaunchError, match=r"^--launcher=pals: `mpiexec` is not on PATH\. On Aurora, run pytest"
    ):
        PalsLauncher().check()


def test_pals_needs_a_pbs_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_program(tmp_path, "mpiexec")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PBS_JOBID", raising=False)
    with pytest.raises(
        LaunchError, match=r"^--launcher=pals: this pytest is not inside a PBS job \(PBS_JOBID"
    ):
        PalsLauncher().check()
    monkeypatch.setenv("PBS_JOBID", "8675309.pbs")
    PalsLauncher().check()


# --------------------------------------------------------------------------------------------------------
# srun


def test_srun_command_defaults_from_the_allocation() -> None:
    argv = srun_command(request(8), program="srun", environ={"SLURM_JOB_NUM_NODES": "2"})
    assert argv == [
        "srun", "--ntasks=8", "--nodes=2", "--ntasks-per-node=4", "--kill-on-bad-exit=1", "--export=ALL",
        *unset("Slurm", "PMIx", "MPICH hydra"), *AGENT,
    ]  # fmt: skip


def test_srun_command_small_world_in_a_big_allocation() -> None:
    argv = srun_command(request(2), program="srun", environ={"SLURM_JOB_NUM_NODES": "8"})
    assert argv[:4] == ["srun", "--ntasks=2", "--nodes=2", "--ntasks-per-node=1"]


def test_srun_command_explicit_ppn_and_user_options() -> None:
    argv = srun_command(
        request(8, ppn=4, args=("--overlap", "--export=NONE,SPRITE_TOKEN")), program="srun", environ={}
    )
    assert argv[: argv.index("env")] == [
        "srun", "--ntasks=8", "--nodes=2", "--ntasks-per-node=4", "--kill-on-bad-exit=1",
        "--overlap", "--export=NONE,SPRITE_TOKEN",
    ]  # fmt: skip
    assert srun_command(request(3), program="srun", environ={})[:3] == [
        "srun",
        "--ntasks=3",
        "--kill-on-bad-exit=1",
    ]


@pytest.mark.parametrize(
    ("raw", "tasks"),
    [("2(x2)", (2, 2)), ("3,1", (3, 1)), ("4(x2),2", (4, 4, 2)), (" 8 ", (8,)), ("", None), ("2(x", None)],
)
def test_srun_reads_the_allocations_tasks_per_node(raw: str, tasks: tuple[int, ...] | None) -> None:
    assert allocation_tasks({"SLURM_TASKS_PER_NODE": raw}) == tasks


def test_srun_default_follows_an_uneven_allocation() -> None:
    """``salloc -N2 -n4`` on shared nodes allocates 3+1 tasks: srun would run 3+1 whatever it is asked."""
    uneven = {"SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "3,1"}
    assert srun_command(request(4), program="srun", environ=uneven)[:3] == [
        "srun",
        "--ntasks=4",
        "--kill-on-bad-exit=1",
    ]
    # what the allocation holds is still asked for: 1 a node, and 2 on the roomier node then 1
    assert srun_command(request(2), program="srun", environ=uneven)[:4] == [
        "srun", "--ntasks=2", "--nodes=2", "--ntasks-per-node=1",
    ]  # fmt: skip
    assert srun_command(request(3), program="srun", environ=uneven)[:4] == [
        "srun", "--ntasks=3", "--nodes=2", "--ntasks-per-node=2",
    ]  # fmt: skip
    even = {"SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert srun_command(request(4), program="srun", environ=even)[:4] == [
        "srun", "--ntasks=4", "--nodes=2", "--ntasks-per-node=2",
    ]  # fmt: skip


def test_srun_refuses_a_ppn_the_allocation_cannot_hold() -> None:
    uneven = {"SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "3,1"}
    with pytest.raises(LaunchError) as caught:
        srun_command(request(4, ppn=2), program="srun", environ=uneven)
    assert str(caught.value) == (
        "--launcher=srun: --ppn=2 asks for 4 ranks at 2 a node on 2 nodes, but this allocation has 3+1 tasks "
        "on its nodes (SLURM_TASKS_PER_NODE=3,1), and srun lays a step out within them, not at 2 a node. "
        "Allocate 2 tasks a node (salloc -N2 --ntasks-per-node=2, or #SBATCH --ntasks-per-node=2), or drop "
        "--ppn to follow the allocation's layout."
    )
    # held: 3 a node fits 3+1; a layout the user spells out is theirs; too few tasks in all is srun's to say
    assert "--ntasks-per-node=3" in srun_command(request(4, ppn=3), program="srun", environ=uneven)
    mine = request(4, ppn=2, args=("--ntasks-per-node=2", "--overcommit"))
    assert srun_command(mine, program="srun", environ=uneven)[:3] == ["srun", "--ntasks=4", "--nodes=2"]
    assert "--ntasks-per-node=2" in srun_command(request(8, ppn=2), program="srun", environ=uneven)


def test_srun_needs_an_allocation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_program(tmp_path, "srun")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchError) as excinfo:
        SrunLauncher().check()
    assert str(excinfo.value) == (
        "--launcher=srun: this pytest is not inside a Slurm allocation (SLURM_JOB_ID is not set), and srun "
        "would queue a new job for every session. Run pytest in an allocation: `salloc -N 1 --ntasks=4` then "
        "pytest, or an sbatch script (hpc/slurm/sprite.sbatch); outside Slurm use --launcher=mpiexec or "
        "--launcher=torchrun."
    )
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    SrunLauncher().check()


def test_srun_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with pytest.raises(LaunchError, match=r"^--launcher=srun: `srun` is not on PATH\. srun comes with Slurm"):
        SrunLauncher().check()


# --------------------------------------------------------------------------------------------------------
# torchrun


def test_torchrun_command() -> None:
    argv = torchrun_command(request(4, args=("--log-dir", "/tmp/tr")), python="/py/bin/python")
    assert argv == [
        "/py/bin/python", "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=4",
        "--no-python", "--log-dir", "/tmp/tr", *unset("torchrun"), *AGENT,
    ]  # fmt: skip
    assert torchrun_command(request(4, ppn=4))[5] == "--nproc-per-node=4"


@pytest.mark.parametrize("args", [("--nnodes=2",), ("--rdzv-endpoint", "h:1"), ("--node_rank=1",)])
def test_torchrun_refuses_multi_node_rendezvous(args: tuple[str, ...]) -> None:
    with pytest.raises(LaunchError, match=r"a multi-node rendezvous; one torchrun started here cannot start"):
        torchrun_command(request(4, args=args))


def test_torchrun_needs_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        LaunchError, match=r"^--launcher=torchrun needs torch in the Python running pytest \("
    ):
        TorchrunLauncher().check()


def _builtin_launchers() -> LauncherRegistry:
    """The registry as a session without plugins of its own fills it."""
    registry = LauncherRegistry()
    pytest_sprite_add_launchers(registry)
    return registry


def test_registry_builds_every_launcher() -> None:
    get_launcher = _builtin_launchers().create
    for name, cls in [("mpiexec", MpiexecLauncher), ("pals", PalsLauncher), ("srun", SrunLauncher)]:
        launcher = get_launcher(name)
        assert isinstance(launcher, cls) and launcher.name == name and launcher.spans_nodes
    torchrun = get_launcher("torchrun")
    assert isinstance(torchrun, TorchrunLauncher) and not torchrun.spans_nodes


def test_launch_writes_the_command_to_the_log_and_keeps_the_token_off_it(tmp_path: Path) -> None:
    from pytest_sprite.launch.launchers._command import start

    req = LaunchRequest(
        world_size=1,
        controller_host="h",
        controller_port=1,
        token="tok-123",
        agent_argv=("sh", "-c", 'echo "token=$SPRITE_TOKEN"'),
        env={"SPRITE_TOKEN": "tok-123"},
        log_path=tmp_path / "launch.log",
        cwd=tmp_path,
    )
    handle = start(["env", *req.agent_argv], req)
    handle.proc.wait(timeout=30)
    handle.terminate()
    lines = (tmp_path / "launch.log").read_text().splitlines()
    assert lines == ["+ env sh -c 'echo \"token=$SPRITE_TOKEN\"'", "token=tok-123"]
    assert os.environ.get("SPRITE_TOKEN") != "tok-123"


def test_every_builtin_launcher_name_has_a_module() -> None:
    registry = _builtin_launchers()
    assert registry.names == tuple(BUILTIN_LAUNCHERS)
    for name in registry.names:
        assert registry.create(name).name == name
