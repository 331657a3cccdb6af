"""Packing end to end (issue 14): ranks tests side by side in one world, each in its own.

Tests that must be in flight at the same time meet through files: each one touches its own and waits for
its neighbour's, so a harness that ran them one at a time fails them on the wait, not on a timing guess.
The scheduler's rules themselves are proved without processes in test_schedule.py.
"""

from __future__ import annotations

import re
import shutil
from functools import partial
from pathlib import Path

import pytest
from sprite_testing import fnescape, run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 240
needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="MPICH's mpiexec is not on PATH (pip install mpich)"
)
LAUNCHERS = [
    pytest.param("local", id="local"),
    pytest.param("mpiexec", marks=[needs_mpiexec, pytest.mark.slow], id="mpiexec"),
]

MEET = '''
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

SPOT = Path({spot!r})


def touch(name):
    SPOT.joinpath(name).touch()


def meet(mine, theirs, timeout=90):
    """Say this test is running and wait until ``theirs`` is running too."""
    touch(mine)
    deadline = time.monotonic() + timeout
    while not SPOT.joinpath(theirs).exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{{theirs}} never ran beside {{mine}}")
        time.sleep(0.05)
'''


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("SPRITE_PACK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)


def suite(pytester: pytest.Pytester, body: str) -> Path:
    spot = pytester.path / "spot"
    spot.mkdir()
    pytester.makepyfile(test_suite=MEET.format(spot=str(spot)) + body)
    return spot


run = partial(run_pytest, timeout=TIMEOUT, flags=("-v",))


def side_by_side(result: pytest.RunResult) -> int:
    match = re.search(r"at most (\d+) side by side", result.stdout.str())
    assert match, result.stdout.str()
    return int(match.group(1))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tests_side_by_side_each_see_their_own_world(pytester: pytest.Pytester, launcher: str) -> None:
    spot = suite(
        pytester,
        """
@pytest.mark.ranks(2)
@pytest.mark.parametrize("name", ["a", "b"])
def test_own_world(world, name):
    assert (world.size, dist.get_world_size(), os.environ["WORLD_SIZE"]) == (2, 2, "2")
    assert dist.get_rank() == world.rank == int(os.environ["RANK"])
    assert world.local_rank == world.rank == int(os.environ["LOCAL_RANK"]) and world.local_size == 2
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == 2.0  # the sum over this test's world only
    touch(f"{name}.{world.rank}.agent-{os.getppid()}")
    meet(f"{name}.{world.rank}", f"{dict(a='b', b='a')[name]}.{world.rank}")
    ranks = torch.tensor([world.rank + 1.0])
    dist.all_reduce(ranks)
    assert ranks.item() == 3.0
""",
    )
    result = run(pytester, "--ranks=4", f"--launcher={launcher}", "--connect-timeout=120")
    result.assert_outcomes(passed=2)
    assert side_by_side(result) == 2
    agents = {p.name.split(".agent-")[0]: p.name.split(".agent-")[1] for p in spot.glob("*.agent-*")}
    assert sorted(agents) == ["a.0", "a.1", "b.0", "b.1"]
    assert len(set(agents.values())) == 4, f"two ranks side by side shared an agent: {agents}"


SUB_DEVICES = """
def sub_devices(world):
    return (world.local_devices, world.local_devices[world.local_rank], world.local_rank)
"""


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tests_side_by_side_compute_on_their_own_agents_devices(
    pytester: pytest.Pytester, launcher: str
) -> None:
    # On cpu every rank computes on the cpu, but the device indices the harness hands out are the ones an
    # accelerator would use (xpu:<i>, cuda:<i>, Lightning's devices=): each agent's own, whatever the test.
    pytester.makepyfile(subfns=SUB_DEVICES)
    spot = suite(
        pytester,
        """
from pytest_sprite import run_subworld
from subfns import sub_devices


@pytest.mark.ranks(2)
@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_devices(world, name):
    devices = world.local_devices
    assert len(devices) == world.local_size == 2 and len(set(devices)) == 2
    assert world.gather_object(devices) == [devices, devices]
    mine = devices[world.local_rank]
    tag = "-".join(map(str, devices))
    touch(f"{name}.{world.rank}.agent-{os.getppid()}.device-{mine}.devices-{tag}")
    # a sub-world rank computes on the device of the test rank it runs on, and lists the test's devices
    assert run_subworld(sub_devices).values() == [(devices, devices[0], 0), (devices, devices[1], 1)]
    partner = dict(a="b", b="a", c="d", d="c")[name]
    meet(f"{name}.{world.rank}", f"{partner}.{world.rank}")
""",
    )
    result = run(pytester, "--ranks=4", f"--launcher={launcher}", "--connect-timeout=120")
    result.assert_outcomes(passed=4)
    assert side_by_side(result) == 2
    seen = [p.name.split(".") for p in spot.glob("*.agent-*")]
    assert len(seen) == 8, sorted(p.name for p in spot.iterdir())
    # agent -> the device index its children were given, in every test it ran
    device_of: dict[str, set[int]] = {}
    lists: dict[str, set[tuple[int, ...]]] = {}  # test -> its local_devices
    for name, _rank, agent, device, devices in seen:
        device_of.setdefault(agent, set()).add(int(device.removeprefix("device-")))
        lists.setdefault(name, set()).add(tuple(int(d) for d in devices.removeprefix("devices-").split("-")))
    assert len(device_of) == 4 and all(len(d) == 1 for d in device_of.values()), device_of
    assert sorted(d for (d,) in device_of.values()) == [0, 1, 2, 3], f"two agents share a device: {device_of}"
    assert all(len(v) == 1 for v in lists.values()), lists
    (a,), (b,), (c,), (d,) = (lists[n] for n in "abcd")
    assert not set(a) & set(b) and not set(c) & set(d), f"tests side by side share devices: {lists}"
    # packed, some test runs on agents other than 0 and 1 (2 and 3, or whichever connected first): its
    # devices are theirs, not its LOCAL_RANKs 0 and 1
    assert {a, b, c, d} - {(0, 1)}, lists


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_same_outcomes_and_failure_text_packed_or_not(pytester: pytest.Pytester, launcher: str) -> None:
    suite(
        pytester,
        """
@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


@pytest.mark.ranks(2)
def test_pass(world):
    dist.barrier()


@pytest.mark.ranks(2)
def test_fails_on_rank_one(world):
    dist.barrier()
    assert world.rank != 1, "rank one disagrees"


@pytest.mark.ranks(4)
def test_four_fails_everywhere():  # no world argument: its repr would make each rank's text differ
    dist.barrier()
    size = dist.get_world_size()
    assert size == 3, "four is not three"


@pytest.mark.ranks(2)
def test_skipped(world):
    pytest.skip("not here")


@pytest.mark.ranks(2)
@pytest.mark.xfail(reason="known")
def test_xfailed(world):
    assert False


@pytest.mark.ranks(2)
def test_setup_error(world, broken):
    pass


def test_plain():
    pass


@pytest.mark.ranks(2)
def test_last(world):
    dist.barrier()
""",
    )
    common = (f"--launcher={launcher}", "--ranks=4", "--rank-grace=2", "-rfE")
    runs = {pack: run(pytester, *common, f"--pack={pack}") for pack in ("off", "on")}
    for result in runs.values():
        result.assert_outcomes(passed=3, failed=2, skipped=1, xfailed=1, errors=1)

    def verdicts(result: pytest.RunResult) -> dict[str, str]:
        return dict(
            re.findall(
                r"^test_suite\.py::(\w+) (PASSED|FAILED|SKIPPED|XFAIL|ERROR)", result.stdout.str(), re.M
            )
        )

    def failure_text(result: pytest.RunResult) -> list[str]:
        lines = result.stdout.lines
        return sorted(line for line in lines if re.match(r"^(FAILED|ERROR) |^E ", line))

    assert verdicts(runs["on"]) == verdicts(runs["off"])
    assert failure_text(runs["on"]) == failure_text(runs["off"])
    runs["on"].stdout.fnmatch_lines_random(
        [
            "FAILED test_suite.py::test_fails_on_rank_one - [[]rank 1[]] AssertionError: rank one disagrees*",
            "FAILED test_suite.py::test_four_fails_everywhere - [[]ranks 0-3[]] AssertionError: four is not three*",
            "ERROR test_suite.py::test_setup_error - [[]ranks 0-1[]] RuntimeError: fixture broke",
        ]
    )


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("local", id="local"),
        pytest.param("mpiexec", marks=[needs_mpiexec, pytest.mark.slow], id="mpiexec"),
    ],
)
def test_a_crash_and_a_hang_leave_the_tests_beside_them_alone(
    pytester: pytest.Pytester, launcher: str
) -> None:
    suite(
        pytester,
        """
import signal


@pytest.mark.ranks(2, timeout=8)
def test_hang(world):
    meet("hang", "beside_hang")
    if world.rank == 0:
        time.sleep(1000)
    dist.barrier()


@pytest.mark.ranks(2)
def test_beside_hang(world):
    meet("beside_hang", "hang")
    time.sleep(11)  # past the hang's timeout, its stack dump and its end
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == 2.0


@pytest.mark.ranks(2)
def test_crash(world):
    meet("crash", "beside_crash")
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.ranks(2)
def test_beside_crash(world):
    meet("beside_crash", "crash")
    time.sleep(4)  # past the crash and its peer's grace period
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == 2.0
""",
    )
    result = run(pytester, f"--launcher={launcher}", "--ranks=4", "--rank-grace=2")
    verdicts = dict(re.findall(r"^test_suite\.py::(\w+) (PASSED|FAILED)", result.stdout.str(), re.M))
    assert verdicts == {
        "test_hang": "FAILED",
        "test_beside_hang": "PASSED",
        "test_crash": "FAILED",
        "test_beside_crash": "PASSED",
    }
    result.stdout.fnmatch_lines_random(
        [
            "*still running after the 8s timeout (from @pytest.mark.ranks(timeout=...))*",
            "*--- stacks of rank* (most recent call first) ---*",
            "*rank 1 CRASHED with signal 9 (SIGKILL) during call*",
        ]
    )
    assert side_by_side(result) == 2


def test_exitfirst_finishes_the_tests_in_flight_and_starts_nothing_new(pytester: pytest.Pytester) -> None:
    spot = suite(
        pytester,
        """
@pytest.mark.ranks(2)
def test_a_fails(world):
    meet("a", "b")
    assert world.rank == 0


@pytest.mark.ranks(2)
def test_b_in_flight(world):
    meet("b", "a")
    time.sleep(2)
    dist.barrier()


@pytest.mark.ranks(2)
def test_c_never_starts(world):
    touch("c")


def test_d_never_runs():
    touch("d")
""",
    )
    result = run(pytester, "-x", "--ranks=4")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    assert "test_b_in_flight PASSED" in result.stdout.str()
    assert not (spot / "c").exists() and not (spot / "d").exists()
    assert "test_c_never_starts" not in result.stdout.str()


def test_a_whole_world_test_is_not_starved_by_the_small_tests_after_it(
    pytester: pytest.Pytester,
) -> None:
    spot = suite(
        pytester,
        """
def log(name, what):
    with open(SPOT / "log", "a") as fh:
        fh.write(f"{name} {what} {time.time()!r}\\n")


@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(2))
def test_small_before(world, i):
    if world.rank == 0:
        log(f"before{i}", "start")
    time.sleep(1.5)
    if world.rank == 0:
        log(f"before{i}", "end")


@pytest.mark.ranks(4)
def test_whole_world(world):
    if world.rank == 0:
        log("whole", "start")
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == 4.0
    if world.rank == 0:
        log("whole", "end")


@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(6))
def test_small_after(world, i):
    if world.rank == 0:
        log(f"after{i}", "start")
    time.sleep(0.2)
    if world.rank == 0:
        log(f"after{i}", "end")
""",
    )
    result = run(pytester, "--ranks=4")
    result.assert_outcomes(passed=9)
    events = [line.split() for line in (spot / "log").read_text().splitlines()]
    starts = {name: float(t) for name, what, t in events if what == "start"}
    ends = {name: float(t) for name, what, t in events if what == "end"}
    order = sorted(starts, key=starts.__getitem__)
    # Tests started together reach their bodies in any order (each child initializes its own group);
    # the controller's start order itself is collection order (test_schedule.py proves it).
    assert set(order[:2]) == {"before0", "before1"} and order[2] == "whole"
    assert set(order[3:]) == {f"after{i}" for i in range(6)}
    # Nothing ran beside the whole-world test: it waited for the two before it, and all after it waited.
    assert starts["whole"] >= max(ends["before0"], ends["before1"])
    assert ends["whole"] <= min(starts[f"after{i}"] for i in range(6))
    assert side_by_side(result) == 2


def test_pack_off_runs_one_at_a_time_and_says_so(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite(
        pytester,
        """
@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(2))
def test_two(world, i):
    assert world.local_rank == world.rank
    assert world.local_devices == (0, 1)  # one test at a time: agents 0 and 1, as before packing
""",
    )
    monkeypatch.setenv("SPRITE_PACK", "off")
    result = run(pytester, "--ranks=4")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "sprite: the world of 4 ranks was *% busy (* busy rank-seconds of 4 x *s held); 2 ranks tests, "
            "at most 1 side by side (--pack=off)"
        ]
    )


@pytest.mark.parametrize(
    ("args", "env", "ini", "message"),
    [
        (["--pack=maybe"], {}, "", "--pack='maybe': valid values are on, off"),
        ([], {"SPRITE_PACK": "yes"}, "", "environment variable SPRITE_PACK='yes': valid values are on, off"),
        ([], {}, "[pytest]\npack = 1\n", "ini option pack='1': valid values are on, off"),
    ],
)
def test_a_bad_pack_value_is_a_usage_error_naming_its_source(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    ini: str,
    message: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if ini:
        pytester.makeini(ini)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([fnescape(f"ERROR: {message}")])


@pytest.mark.slow
def test_a_suite_of_two_and_four_rank_tests_at_eight_ranks_packed_or_not(pytester: pytest.Pytester) -> None:
    suite(
        pytester,
        """
CASES = [2, 2, 4, 2, 2, 2, 4, 2, 4, 2, 2, 2]


@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", [i for i, n in enumerate(CASES) if n == 2])
def test_two(world, i):
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == world.size == 2
    assert i % 5 != 3, f"case {i} fails on purpose"


@pytest.mark.ranks(4)
@pytest.mark.parametrize("i", [i for i, n in enumerate(CASES) if n == 4])
def test_four(world, i):
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == world.size == 4
    if i == 6 and world.rank == 2:
        raise ValueError("rank 2 of case 6 says no")
""",
    )
    runs = {pack: run(pytester, "--ranks=8", "--rank-grace=2", f"--pack={pack}") for pack in ("off", "on")}
    for result in runs.values():
        result.assert_outcomes(passed=10, failed=2)  # two-rank case 3 fails; four-rank case 6 fails

    def summary(result: pytest.RunResult) -> list[str]:
        return sorted(line for line in result.stdout.lines if re.match(r"^(FAILED|ERROR) |^E ", line))

    assert summary(runs["on"]) == summary(runs["off"])
    assert side_by_side(runs["on"]) >= 3
