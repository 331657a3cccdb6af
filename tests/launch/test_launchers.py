"""Cluster launchers end to end: the harness core's scenarios under mpiexec, torchrun, pals and srun.

mpiexec (MPICH's hydra) and torchrun run for real. pals runs against ``tests/fakes/pals/mpiexec`` (PALS's
options and variables, MPICH underneath) and srun against ``tests/fakes/slurm/srun``, a stand-in that lays one
host's tasks out as on two nodes (``test_slurm_real.py`` runs srun under a real one-node Slurm,
``test_slurm_two_nodes.py`` under a real two-node one).
Every session starts with stale rank variables of the launcher families it does not own in the controller's
environment, as when pytest runs inside an sbatch script or under an outer torchrun: the launchers must keep
them from the agents, or the agents would refuse to start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from functools import partial
from pathlib import Path

import pytest
from sprite_testing import clear_rank_variables, local_settings, needs_mpiexec, run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 120
FAKES = Path(__file__).parents[1] / "fakes"

SCENARIOS = """
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

W = {world}


@pytest.mark.ranks(2)
def test_collectives(world):
    t = torch.tensor([world.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    assert [g.item() for g in world.gather(torch.tensor([world.rank]))] == [0, 1]


@pytest.mark.ranks(2)
def test_fails_on_rank_one(world):
    dist.barrier()  # see test_layout
    assert world.rank != 1, "rank one disagrees"


@pytest.mark.ranks(2)
def test_crash(world):
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.ranks(2)
def test_after_crash(world):
    dist.barrier()


@pytest.mark.ranks(2, timeout=8)
def test_hang(world):
    if world.rank == 0:
        time.sleep(1000)
    dist.barrier()


@pytest.mark.ranks(2)
def test_after_hang(world):
    dist.barrier()


@pytest.mark.ranks(2)
def test_agent_lost(world):
    if world.rank == 1:
        os.kill(os.getppid(), signal.SIGKILL)  # the rank agent itself
    time.sleep(30)


@pytest.mark.ranks(2)
def test_after_agent_lost(world):
    dist.barrier()


@pytest.mark.ranks(W)
def test_layout(world):
    # No collective on purpose: rank 0 hosts the rendezvous store and must not exit while a slower
    # rank is still in init_process_group (the harness keeps it until every rank has checked out).
    env = os.environ
    rank = world.rank
    assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), str(W))
    launcher_variables = {{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS",
                           "SLURM_LOCALID", "PALS_RANKID", "PALS_LOCAL_RANKID", "PMIX_RANK",
                           "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}}
    assert not launcher_variables & set(env), launcher_variables & set(env)
{layout}
"""

_ONE_NODE = """
    assert (world.local_rank, world.local_size, world.node) == (rank, W, 0)
"""
_TWO_NODES = """
    # 2 nodes of 2: the local rank differs from the global rank on the second node
    assert (world.local_rank, world.local_size, world.node) == (rank % 2, 2, rank // 2)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == (str(rank % 2), "2", str(rank // 2))
"""
# The launcher's placement reaches the test through world / LOCAL_RANK / NODE_RANK; its own variables
# (which describe the whole launch, not the test's world) are removed from every test child.
LAYOUTS = {
    "mpiexec": _ONE_NODE,
    "torchrun": _ONE_NODE
    + """
    assert env["TORCHELASTIC_RUN_ID"]
""",
    "pals": _TWO_NODES,
    "srun": _TWO_NODES,
}


# Rank variables a controller may inherit from elsewhere, by the launcher they must not reach.
STALE = {
    "mpiexec": {"RANK": "0", "LOCAL_RANK": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PALS_RANKID": "0"},
    "torchrun": {"PMI_RANK": "0", "PMI_SIZE": "1", "SLURM_PROCID": "0", "PALS_RANKID": "0"},
    "pals": {"RANK": "0", "LOCAL_RANK": "0", "SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "0"},
    "srun": {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "PALS_RANKID": "0",
        "OMPI_COMM_WORLD_RANK": "0",
    },
}


run = partial(run_pytest, timeout=TIMEOUT, flags=("-v",))


LAUNCHERS = [
    pytest.param("mpiexec", 2, [], marks=needs_mpiexec, id="mpiexec"),
    pytest.param("torchrun", 2, [], marks=pytest.mark.slow, id="torchrun"),
    pytest.param("pals", 4, ["--ppn=2"], marks=[needs_mpiexec, pytest.mark.slow], id="pals-fake"),
    pytest.param("srun", 4, [], marks=pytest.mark.slow, id="srun-stand-in"),
]


@pytest.mark.parametrize(("launcher", "world", "extra"), LAUNCHERS)
def test_harness_scenarios_under_launcher(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    launcher: str,
    world: int,
    extra: list[str],
) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    clear_rank_variables(monkeypatch)
    argv_log = tmp_path / "argv.jsonl"
    if launcher == "pals":
        monkeypatch.setenv("PATH", f"{FAKES / 'pals'}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_PALS_ARGV_LOG", str(argv_log))
        monkeypatch.setenv("PBS_JOBID", f"{os.getpid()}.fake-pbs")  # PALS runs only inside a PBS job
    if launcher == "srun":
        monkeypatch.setenv("PATH", f"{FAKES / 'slurm'}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_SRUN_ARGV_LOG", str(argv_log))
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")  # the default --ppn comes from here: 4 ranks / 2 nodes
    for name, value in STALE[launcher].items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile(test_scenarios=SCENARIOS.format(world=world, layout=LAYOUTS[launcher]))

    result = run(
        pytester,
        f"--launcher={launcher}",
        f"--ranks={world}",
        "--rank-grace=2",
        "--connect-timeout=60",
        # One at a time: under mpiexec, pals and srun a lost agent takes the whole launch down, and with
        # it a test running beside it; these scenarios check each outcome alone (test_packing.py packs).
        "--pack=off",
        *extra,
    )

    verdicts = dict(
        re.findall(r"^test_scenarios\.py::(\w+) (PASSED|FAILED|ERROR)", result.stdout.str(), re.M)
    )
    # test_agent_lost is an error rather than a failure when rank 1's setup report did not get out before
    # its agent died (a race the test cannot steer); either way it fails and the next test passes
    assert verdicts.pop("test_agent_lost") in ("FAILED", "ERROR")
    assert verdicts == {
        "test_collectives": "PASSED",
        "test_fails_on_rank_one": "FAILED",
        "test_crash": "FAILED",
        "test_after_crash": "PASSED",
        "test_hang": "FAILED",
        "test_after_hang": "PASSED",
        "test_after_agent_lost": "PASSED",
        "test_layout": "PASSED",
    }
    result.stdout.fnmatch_lines_random(
        [
            "*::test_collectives PASSED*",
            "*::test_after_crash PASSED*",
            "*::test_after_hang PASSED*",
            "*::test_after_agent_lost PASSED*",
            "*::test_layout PASSED*",
            "FAILED *::test_fails_on_rank_one - [[]rank 1[]]*",
            "E * AssertionError: rank one disagrees",
            "*rank 1 CRASHED with signal 9 (SIGKILL) during call*",
            "*still running after the 8s timeout (from @pytest.mark.ranks(timeout=...))*",
            "*--- stacks of rank* (most recent call first) ---*",
            "*connection to rank agent 1 closed*",
        ]
    )
    if launcher in ("pals", "srun"):
        # two launches: the first, and a fresh one after the lost agent took the first one down
        launches = [json.loads(line) for line in argv_log.read_text().splitlines()]
        assert len(launches) == 2, launches
        expected_head = {
            "pals": ["-n", "4", "--ppn", "2", "--cpu-bind", "none", "--env", "WORLD_SIZE=4", "env"],
            "srun": [
                "--ntasks=4",
                "--nodes=2",
                "--ntasks-per-node=2",
                "--kill-on-bad-exit=1",
                "--export=ALL",
                "env",
            ],
        }[launcher]
        assert launches[0][: len(expected_head)] == expected_head


# --------------------------------------------------------------------------------------------------------
# failures of the launcher itself, as the user sees them


ONE_TEST = """
import pytest

@pytest.mark.ranks(2)
def test_one(world):
    pass

@pytest.mark.ranks(2)
def test_two(world):
    pass
"""


def test_mpiexec_not_found(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clear_rank_variables(monkeypatch)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    pytester.makepyfile(ONE_TEST)
    result = run(pytester, "--launcher=mpiexec")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*pytest-sprite could not start the rank agents: --launcher=mpiexec: `mpiexec` is not on PATH. "
            "Install MPICH's (it comes beside mpi4py): `pip install mpich`, or load your site's MPI module "
            "(`module load mpich` or `module load openmpi`), then check `mpiexec --version`.*"
        ]
    )
    assert "test_two" not in result.stdout.str().split("short test summary")[0].split("test_one")[-1]


@needs_mpiexec
def test_launch_that_dies_before_agents_connect(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    pytester.makepyfile(ONE_TEST)
    result = run(pytester, "--launcher=mpiexec", "--launcher-args=--no-such-option")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*its rank agent could not run the test: --launcher=mpiexec: the launch ended with status * "
            "before all 2 agents connected (0 did). Its output:*",
            "*+ */mpiexec -n 2 --no-such-option env -u RANK -u LOCAL_RANK*",
            "*no-such-option*",
        ]
    )


@needs_mpiexec
@pytest.mark.slow  # 22 s (a 15 s connect timeout); test_launch_that_dies_before_agents_connect runs in CI
def test_fewer_agents_than_asked_within_connect_timeout(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    # rank 1's agent never gets past collection: it sleeps in its conftest (the controller has no PMI_RANK)
    pytester.makeconftest(
        """
        import os, time
        if os.environ.get("PMI_RANK") == "1":
            time.sleep(60)
        """
    )
    pytester.makepyfile(ONE_TEST)
    # 15 s: rank 0's agent imports torch and collects before it connects, several seconds under load
    result = run(pytester, "--launcher=mpiexec", "--connect-timeout=15")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*its rank agent could not run the test: --launcher=mpiexec: only 1 of 2 agents connected "
            "within 15s (--connect-timeout); connected ranks: [[]0[]]. Launcher output:*",
        ]
    )


@needs_mpiexec
def test_agent_that_cannot_read_its_rank_says_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stale variable of the launcher's own family cannot be told apart from a true one: the agent must
    # refuse it with the reader's message, which reaches the user through the launch output.
    clear_rank_variables(monkeypatch)
    pytester.makepyfile(ONE_TEST)
    result = run(
        pytester, "--launcher=mpiexec", "--connect-timeout=20", "--launcher-args=-genv PMI_LOCAL_RANK 7"
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*launcher variables disagree, so this process cannot know its place in the world:*",
            "*  local rank: MPI_LOCALRANKID=? (MPICH hydra), PMI_LOCAL_RANK=7 (MPICH hydra)*",
            "*  MPI_LOCALRANKID and PMI_LOCAL_RANK both come from MPICH hydra and disagree: the one this launch "
            "did not set was inherited; unset it*",
        ]
    )


def test_srun_outside_an_allocation(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_rank_variables(monkeypatch)
    monkeypatch.setenv("PATH", f"{FAKES / 'slurm'}{os.pathsep}{os.environ['PATH']}")
    pytester.makepyfile(ONE_TEST)
    result = run(pytester, "--launcher=srun")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*pytest-sprite could not start the rank agents: --launcher=srun: this pytest is not inside a Slurm "
            "allocation (SLURM_JOB_ID is not set)*"
        ]
    )


def test_torchrun_refuses_a_multi_node_layout(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    pytester.makepyfile(ONE_TEST)
    result = run(pytester, "--launcher=torchrun", "--ranks=4", "--ppn=2")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*--launcher=torchrun starts every rank on this node, but --ppn=2 with --ranks=4 asks for 2 nodes. "
            "Drop --ppn, or use --launcher=srun, pals or mpiexec across nodes.*"
        ]
    )


@needs_mpiexec
@pytest.mark.slow  # 21 s; the mpiexec harness scenarios cover the reader in test children
def test_reader_in_a_child_of_a_smaller_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_rank_variables(monkeypatch)
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist
        from pytest_sprite.env.rank_variables import read_rank_env

        @pytest.mark.ranks(2)
        def test_reader(world):
            dist.barrier()
            info = read_rank_env(use_mpi4py=False)
            assert (info.rank, info.local_rank, info.world_size) == (world.rank, world.local_rank, 2)
        """
    )
    result = run(pytester, "--launcher=mpiexec", "--ranks=4")
    result.assert_outcomes(passed=1)


# --------------------------------------------------------------------------------------------------------
# a launched world starts while the controller collects


EARLY_CONFTEST = """
import os
import time
from pathlib import Path

STARTED = Path({started!r})
COLLECTED = Path({collected!r})
BEGAN = []


def pytest_configure(config):
    if config.getoption("sprite_agent", None):  # a launched agent's own session
        (STARTED / f"agent-{{os.getpid()}}").write_text(str(os.getpid()))


def pytest_collection(session):
    BEGAN.append(time.monotonic())


def pytest_collection_modifyitems(session):
    if session.config.getoption("sprite_agent", None):
        (COLLECTED / f"agent-{{os.getpid()}}").touch()
        return
    # The controller, before pytest-sprite plans the world (its hook runs last): wait (at most 30 s) for
    # agents to have collected, then stay until {linger} s after the collection began.
    deadline = time.monotonic() + 30
    while len(list(COLLECTED.iterdir())) < {agents} and time.monotonic() < deadline:
        time.sleep(0.1)
    (STARTED.parent / "controller-saw-agents.txt").write_text(str(len(list(STARTED.iterdir()))))
    time.sleep(max(0.0, BEGAN[0] + {linger} - time.monotonic()))
"""


def _early_launch_session(
    pytester: pytest.Pytester, tmp_path: Path, body: str, *args: str, linger: float = 0.0
) -> tuple[pytest.RunResult, int, list[int]]:
    """Run ``body`` under mpiexec at --ranks=2; return the result, how many agents the controller saw
    started before its collection ended, and the agents' pids."""
    started, collected = tmp_path / "started", tmp_path / "collected"
    started.mkdir()
    collected.mkdir()
    pytester.makeconftest(
        EARLY_CONFTEST.format(started=str(started), collected=str(collected), agents=2, linger=linger)
    )
    pytester.makepyfile(body)
    result = run(pytester, "--launcher=mpiexec", "--ranks=2", "--launch-early=on", *args)
    seen = tmp_path / "controller-saw-agents.txt"
    pids = [int(p.read_text()) for p in started.iterdir()]
    return result, int(seen.read_text()) if seen.exists() else -1, pids


@needs_mpiexec
@pytest.mark.slow  # 12 s (the controller lingers past an 8 s connect timeout); CI runs the sibling below
def test_a_launched_world_starts_while_the_controller_collects(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The agents collect while the controller does; one that connected before the controller finished
    is accepted even when that collection outlasts --connect-timeout (it counts the agents' connecting)."""
    clear_rank_variables(monkeypatch)
    result, seen, _ = _early_launch_session(pytester, tmp_path, ONE_TEST, "--connect-timeout=8", linger=10.0)
    result.assert_outcomes(passed=2)
    assert seen == 2, f"{seen} agents had started by the end of the controller's collection, not 2"


UNUSED_WORLD = """
import time
from pathlib import Path

import pytest


def test_plain():
    # pytest-sprite ended the world when collection showed that no selected test needs it.
    pids = [int(p.read_text()) for p in Path({started!r}).iterdir()]
    assert pids
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{{pid}}").exists() and Path(f"/proc/{{pid}}/stat").read_text().split()[2] != "Z"]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"agents {{alive}} still run during the session's only test")


@pytest.mark.ranks(2)
def test_not_selected(world):
    pass
"""


@needs_mpiexec
def test_a_world_launched_early_and_needed_by_no_selected_test_ends_with_collection(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clear_rank_variables(monkeypatch)
    body = UNUSED_WORLD.format(started=str(tmp_path / "started"))
    result, seen, _ = _early_launch_session(pytester, tmp_path, body, "-k", "plain")
    result.assert_outcomes(passed=1, deselected=1)
    assert seen == 2


@pytest.mark.parametrize(
    ("launcher", "world", "ppn", "mode", "collect_only", "cores", "early"),
    [
        ("mpiexec", 2, None, "auto", False, 3, True),  # a core for the controller and each agent
        ("mpiexec", 2, None, "auto", False, 2, False),  # agents and collection would share the cores
        ("pals", 24, 12, "auto", False, 13, True),  # twelve of the 24 agents on this node
        ("pals", 24, 12, "auto", False, 12, False),
        ("mpiexec", 8, None, "on", False, 2, True),
        ("mpiexec", 8, None, "off", False, 64, False),
        ("local", 2, None, "on", False, 64, False),  # forks need the collected tests
        ("mpiexec", None, None, "on", False, 64, False),  # the size is known only after collection
        ("mpiexec", 2, None, "on", True, 64, False),  # --collect-only runs nothing
    ],
)
def test_when_the_world_is_launched_before_collection(
    launcher: str, world: int | None, ppn: int | None, mode: str, collect_only: bool, cores: int, early: bool
) -> None:
    from pytest_sprite.launch.controller import launches_early

    settings = local_settings(world_size=world, launcher=launcher, ppn=ppn, launch_early=mode)
    assert launches_early(settings, collect_only=collect_only, cores=cores) is early


STRAGGLER_CONFTEST = """
import os
import time
from pathlib import Path

GO, LATE = Path({go!r}), Path({late!r})


def pytest_configure(config):
    # Rank agent 2 starts only once the first test has run (at most 30 s): a straggler.
    if config.getoption("sprite_agent", None) and os.environ.get("PMI_RANK") == "2":
        deadline = time.monotonic() + 30
        while not GO.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not GO.exists():
            LATE.touch()
"""

STRAGGLER_TESTS = """
from pathlib import Path

import pytest

GO, LATE = Path({go!r}), Path({late!r})


@pytest.mark.ranks(2)
def test_runs_while_agent_two_is_starting(world):
    assert not LATE.exists(), "this test waited for the straggling agent"
    world.barrier()
    if world.rank == 0:
        GO.touch()


@pytest.mark.ranks(3)
def test_the_whole_world_runs_once_it_has_connected(world):
    assert GO.exists() and not LATE.exists()
"""


@needs_mpiexec
def test_tests_start_on_the_agents_that_have_connected_while_a_straggler_starts(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clear_rank_variables(monkeypatch)
    paths = {"go": str(tmp_path / "go"), "late": str(tmp_path / "late")}
    pytester.makeconftest(STRAGGLER_CONFTEST.format(**paths))
    pytester.makepyfile(STRAGGLER_TESTS.format(**paths))
    result = run(pytester, "--launcher=mpiexec", "--ranks=3", "--launch-early=off")
    result.assert_outcomes(passed=2)


@needs_mpiexec
@pytest.mark.slow  # 11 s (an 8 s connect timeout); test_launch_that_dies_before_agents_connect takes the same path in CI
def test_an_agent_that_never_connects_fails_only_the_tests_that_need_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clear_rank_variables(monkeypatch)
    paths = {"go": str(tmp_path / "never"), "late": str(tmp_path / "late")}
    pytester.makeconftest(STRAGGLER_CONFTEST.format(**paths))
    pytester.makepyfile(
        """
import pytest


@pytest.mark.ranks(2)
def test_two(world):
    world.barrier()


@pytest.mark.ranks(3)
def test_three(world):
    pass


@pytest.mark.ranks(2)
def test_after(world):
    pass
"""
    )
    result = run(pytester, "--launcher=mpiexec", "--ranks=3", "--launch-early=off", "--connect-timeout=8")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_two PASSED*",
            "*test_three ERROR*",
            "*--launcher=mpiexec: only 2 of 3 agents connected within 8s (--connect-timeout); connected ranks: "
            "?0, 1?. Launcher output:*",
        ]
    )
    assert "test_after" not in result.stdout.str().split("short test summary")[0]  # the session stopped
