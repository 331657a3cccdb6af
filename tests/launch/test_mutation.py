"""``--sprite-mutate`` end to end: a user's plain-torch suite, each mutant killed by one test and survived
by another, the report forms, the exit status, packed and unpacked, under mpiexec."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from functools import partial

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 300
run = partial(run_pytest, timeout=TIMEOUT)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("SPRITE_MUTATE", "SPRITE_MUTATE_FAIL_UNDER", "SPRITE_RANKS"):
        monkeypatch.delenv(name, raising=False)


def table(stdout: str) -> dict[str, dict[str, list[str]]]:
    """The terminal table back as nodeid -> {"killed": [...], "survived": [...], ...}."""
    result: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        test = re.match(r"^(\S*::\S+): killed \d+/\d+", line)  # --pyargs: an empty path
        if test:
            current = result.setdefault(test[1].rsplit("::", 1)[1], {})
        row = re.match(r"^    (killed|survived|not applicable): (.*)$", line)
        if row:
            current[row[1]] = row[2].split(", ")
    return result


PLAIN = """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.ranks(2)
    def test_allreduce_value(world):
        t = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0

    @pytest.mark.ranks(2)
    def test_allreduce_ran(world):
        t = torch.tensor([float(world.rank + 1)])
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        assert work.is_completed()
"""


def test_scores_reports_and_fail_under(pytester: pytest.Pytester) -> None:
    """The representative fast path: two mutants run, one not applicable; the tests' outcomes stand, the
    table, the JSON (against the schema) and JUnit say what each killed; fail-under turns the exit status."""
    import jsonschema

    from pytest_sprite.report.json_report import load_schema

    pytester.makepyfile(test_plain=PLAIN)
    result = run(
        pytester,
        "--sprite-mutate=skip_allreduce,allreduce_sum_as_mean,broadcast_wrong_source",
        "--sprite-mutate-fail-under=0.9",
        "--sprite-report=report.json",
        "--junitxml=junit.xml",
    )
    result.assert_outcomes(passed=2)  # no line for a mutant run
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # 2 killed of 4: below 0.9
    assert table(result.stdout.str()) == {
        "test_allreduce_value": {
            "killed": ["skip_allreduce", "allreduce_sum_as_mean"],
            "not applicable": ["broadcast_wrong_source"],
        },
        "test_allreduce_ran": {
            "survived": ["skip_allreduce", "allreduce_sum_as_mean"],
            "not applicable": ["broadcast_wrong_source"],
        },
    }
    result.stdout.fnmatch_lines(["mutation score: 0.50, 2 killed of 4 applicable"])
    document = json.loads((pytester.path / "report.json").read_text())
    jsonschema.validate(document, load_schema())
    mutation = document["mutation"]
    assert mutation["score"] == 0.5
    assert mutation["tests"]["test_plain.py::test_allreduce_ran"]["survived"] == [
        "skip_allreduce",
        "allreduce_sum_as_mean",
    ]
    props = {
        (case.get("name"), p.get("name")): p.get("value")
        for case in ET.parse(pytester.path / "junit.xml").iter("testcase")
        for p in case.iter("property")
    }
    assert props[("test_allreduce_value", "sprite.mutation.killed")] == "skip_allreduce,allreduce_sum_as_mean"
    assert props[("test_allreduce_ran", "sprite.mutation.score")] == "0.0"


def test_without_the_option_nothing_changes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain=PLAIN.replace("ranks(2)\n    def test_allreduce_ran", "skip\n    def test_x")
    )
    result = run(pytester, "--sprite-report=report.json", "-k", "value")
    result.assert_outcomes(passed=1)
    assert "mutation" not in result.stdout.str()
    assert json.loads((pytester.path / "report.json").read_text())["mutation"] == {}


def test_a_bad_mutant_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN)
    result = pytester.runpytest("--sprite-mutate=skip_all")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--sprite-mutate: 'skip_all' is not a mutant; valid mutants: skip_allreduce, *"]
    )


EACH_MUTANT = """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.ranks(2)
    def test_allreduce_strong(world):
        for step in range(2):
            t = torch.tensor([float(world.rank + 1 + step)])
            dist.all_reduce(t)
            assert t.item() == 3.0 + 2 * step

    @pytest.mark.ranks(2)
    def test_allreduce_first_step_only(world):
        t = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0
        dist.all_reduce(torch.ones(1))

    @pytest.mark.ranks(2)
    def test_allreduce_weak(world):
        t = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(t)
        assert torch.isfinite(t).all()

    @pytest.mark.ranks(2)
    def test_broadcast_strong(world):
        t = torch.tensor([float(world.rank)])
        dist.broadcast(t, src=0)
        assert t.item() == 0.0

    @pytest.mark.ranks(2)
    def test_broadcast_weak(world):
        t = torch.tensor([float(world.rank)])
        dist.broadcast(t, src=0)
        assert t.shape == (1,)

    @pytest.mark.ranks(2)
    def test_allgather_strong(world):
        out = [torch.zeros(1) for _ in range(world.size)]
        dist.all_gather(out, torch.tensor([float(world.rank)]))
        assert [o.item() for o in out] == [0.0, 1.0]

    @pytest.mark.ranks(2)
    def test_allgather_weak(world):
        out = torch.zeros(world.size)
        dist.all_gather_into_tensor(out, torch.tensor([float(world.rank)]))
        assert sorted(out.tolist()) == [0.0, 1.0]

    @pytest.mark.ranks(2)
    def test_reduce_scatter_strong(world):
        out = torch.zeros(1)
        dist.reduce_scatter_tensor(out, torch.tensor([1.0, 2.0]))
        assert out.item() == 2.0 * (world.rank + 1)

    @pytest.mark.ranks(2)
    def test_reduce_scatter_weak(world):
        out = torch.zeros(1)
        dist.reduce_scatter_tensor(out, torch.tensor([1.0, 1.0]))
        assert out.item() == 2.0
"""


def test_each_mutant_is_killed_by_one_test_and_survived_by_another(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_each=EACH_MUTANT)
    result = run(pytester, "--ranks=4", "--sprite-mutate=all,skip_allreduce@rank1:from2")
    result.assert_outcomes(passed=9)
    got = table(result.stdout.str())
    allreduce = [
        "skip_allreduce",
        "allreduce_sum_as_mean",
        "allreduce_mean_of_world_plus_one",
        "stale_allreduce",
    ]
    assert got["test_allreduce_strong"]["killed"] == [*allreduce, "skip_allreduce@rank1:from2"]
    assert got["test_allreduce_first_step_only"]["killed"] == allreduce
    assert got["test_allreduce_first_step_only"]["survived"] == ["skip_allreduce@rank1:from2"]
    assert got["test_allreduce_weak"]["survived"] == allreduce  # one all-reduce: from2 does not apply
    assert "skip_allreduce@rank1:from2" in got["test_allreduce_weak"]["not applicable"]
    for op, mutant in (
        ("broadcast", "broadcast_wrong_source"),
        ("allgather", "allgather_swap"),
        ("reduce_scatter", "reduce_scatter_shift"),
    ):
        assert got[f"test_{op}_strong"]["killed"] == [mutant]
        assert got[f"test_{op}_weak"]["survived"] == [mutant]


USER_SUITE = """
    import math

    import pytest
    import torch
    import torch.distributed as dist

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)

    def rows(rank, world):
        torch.manual_seed(1)
        x = torch.randn(4 * world, 4)
        return x, x[rank * 4 : (rank + 1) * 4]

    @pytest.mark.ranks(2)
    def test_ddp_gradients_match_one_device(world):
        x, mine = rows(world.rank, world.size)
        ref = model()
        ref(x).pow(2).mean().backward()
        ddp = torch.nn.parallel.DistributedDataParallel(model())
        ddp(mine).pow(2).mean().backward()
        for p, q in zip(ddp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)

    @pytest.mark.ranks(2)
    def test_allreduce_value(world):
        t = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0

    @pytest.mark.ranks(2)
    def test_loss_is_finite(world):
        x, mine = rows(world.rank, world.size)
        ddp = torch.nn.parallel.DistributedDataParallel(model())
        loss = ddp(mine).pow(2).mean()
        loss.backward()
        assert math.isfinite(loss.item())

    @pytest.mark.ranks(2)
    def test_allreduce_ran(world):
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()
        assert work.is_completed()
"""

USER_MUTANTS = "skip_allreduce,allreduce_sum_as_mean,allreduce_mean_of_world_plus_one,broadcast_wrong_source"


def user_suite_table(pytester: pytest.Pytester, *args: str) -> dict[str, dict[str, list[str]]]:
    pytester.makepyfile(test_user=USER_SUITE)
    result = run(pytester, f"--sprite-mutate={USER_MUTANTS}", *args)
    result.assert_outcomes(passed=4)
    return table(result.stdout.str())


USER_EXPECTED = {
    "test_ddp_gradients_match_one_device": {
        "killed": ["skip_allreduce", "allreduce_sum_as_mean", "allreduce_mean_of_world_plus_one"],
        "survived": ["broadcast_wrong_source"],  # every rank builds the same seeded model
    },
    "test_allreduce_value": {
        "killed": ["skip_allreduce", "allreduce_sum_as_mean", "allreduce_mean_of_world_plus_one"],
        "not applicable": ["broadcast_wrong_source"],
    },
    "test_loss_is_finite": {
        "survived": [
            "skip_allreduce",
            "allreduce_sum_as_mean",
            "allreduce_mean_of_world_plus_one",
            "broadcast_wrong_source",
        ],
    },
    "test_allreduce_ran": {
        "survived": ["skip_allreduce", "allreduce_sum_as_mean", "allreduce_mean_of_world_plus_one"],
        "not applicable": ["broadcast_wrong_source"],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["--pack=on", "--pack=off"])
def test_a_users_suite_strong_tests_kill_weak_ones_do_not(pytester: pytest.Pytester, pack: str) -> None:
    assert user_suite_table(pytester, "--ranks=4", pack) == USER_EXPECTED


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="MPICH's mpiexec is not on PATH (pip install mpich)"
)
def test_a_users_suite_under_mpiexec(pytester: pytest.Pytester) -> None:
    assert user_suite_table(pytester, "--launcher=mpiexec", "--ranks=2") == USER_EXPECTED


SHARDED = """
    import pytest
    import torch


    @pytest.mark.ranks(2)
    def test_dtensor_redistributes(world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        mesh = init_device_mesh("cpu", (world.size,))
        mine = torch.full((2,), float(world.rank + 1))
        gathered = DTensor.from_local(mine, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        assert gathered.to_local().tolist() == [1.0, 1.0, 2.0, 2.0]
        scattered = DTensor.from_local(torch.arange(4.0), mesh, [Partial()]).redistribute(mesh, [Shard(0)])
        assert scattered.to_local().tolist() == [4.0 * world.rank, 4.0 * world.rank + 2.0]
        summed = DTensor.from_local(mine.clone(), mesh, [Partial()]).redistribute(mesh, [Replicate()])
        assert summed.to_local().tolist() == [3.0, 3.0]


    @pytest.mark.ranks(2)
    def test_fsdp2_gradients_match_one_device(world):
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        reference = torch.nn.Linear(4, 4)
        model = torch.nn.Linear(4, 4)
        model.load_state_dict(reference.state_dict())
        fully_shard(model)
        torch.manual_seed(1)
        x = torch.randn(4 * world.size, 4)
        weights = torch.arange(1.0, 5.0)  # a loss that tells output features apart
        (reference(x) * weights).pow(2).mean().backward()
        (model(x[4 * world.rank : 4 * (world.rank + 1)]) * weights).pow(2).mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad)
"""


@pytest.mark.slow
def test_fsdp2_and_dtensor_redistributions_reach_the_mutants(pytester: pytest.Pytester) -> None:
    """FSDP2's all-gather and reduce-scatter reach the mutants, and so do DTensor's redistributions: its
    all-reduce (Partial to Replicate) through the group, its all-gather and reduce-scatter through torch's
    functional collectives, routed to the group's methods."""
    pytester.makepyfile(test_sharded=SHARDED)
    result = run(pytester, "--sprite-mutate=collective")
    result.assert_outcomes(passed=2)
    allreduce = [
        "skip_allreduce",
        "allreduce_sum_as_mean",
        "allreduce_mean_of_world_plus_one",
        "stale_allreduce",
    ]
    assert table(result.stdout.str()) == {
        "test_dtensor_redistributes": {
            "killed": [*allreduce, "allgather_swap", "reduce_scatter_shift"],
            "not applicable": ["broadcast_wrong_source"],
        },
        "test_fsdp2_gradients_match_one_device": {
            "killed": ["allgather_swap", "reduce_scatter_shift"],
            "not applicable": [*allreduce, "broadcast_wrong_source"],
        },
    }
