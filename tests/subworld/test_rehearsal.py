"""Each test rank's warm process: it forks that rank's test zygotes and rehearses what they forked (from the
rank's second test with a sub-world on), its own seat only, so later tests' sub-world ranks inherit what the
rehearsal left (torch's caches)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from sprite_testing import run_pytest

from pytest_sprite.subworld import zygote

pytestmark = pytest.mark.cpu

TIMEOUT = 240

BODY = """
import os
import time
from pathlib import Path

import pytest

from pytest_sprite import run_subworld

REHEARSED = []


def rehearse(seat, marks, wait):
    if not REHEARSED:  # once per warm process, as the resume roles' rehearsal keeps to once per kind of fit
        REHEARSED.append((seat.rank, seat.world_size))
        Path(marks, f"rank{seat.rank}-pid{os.getpid()}").write_text("")


def fit(world, marks, wait):
    # waiting, the test ends only once this rank's warm process has rehearsed: the next test's zygote comes after
    deadline = time.monotonic() + 60
    while wait and not any(p.name.startswith(f"rank{world.rank}-") for p in Path(marks).iterdir()):
        assert time.monotonic() < deadline, "never rehearsed"
        time.sleep(0.01)
    return list(REHEARSED)


fit.subworld_rehearse = rehearse


def marks_of(factory):
    marks = factory.getbasetemp() / "marks"
    marks.mkdir(exist_ok=True)
    return marks


@pytest.mark.ranks(2)
def test_first_is_not_rehearsed(world, tmp_path_factory):
    marks = marks_of(tmp_path_factory)
    assert run_subworld(fit, args=(str(marks), False), ranks=2, timeout=90).values() == [[], []]


@pytest.mark.ranks(2)
def test_second_is_rehearsed_after_its_fork(world, tmp_path_factory):
    marks = marks_of(tmp_path_factory)
    assert list(marks.iterdir()) == []  # the rank's first sub-world test was not rehearsed
    assert run_subworld(fit, args=(str(marks), True), ranks=2, timeout=90).values() == [[], []]


@pytest.mark.ranks(2)
def test_third_inherits_its_own_ranks_rehearsal(world, tmp_path_factory):
    marks = marks_of(tmp_path_factory)
    values = run_subworld(fit, args=(str(marks), False), ranks=2, timeout=90).values()
    assert values == [[(0, 2)], [(1, 2)]]
    assert sorted(p.name.split("-")[0] for p in marks.iterdir()) == ["rank0", "rank1"]
"""


def test_later_tests_ranks_inherit_their_own_ranks_rehearsal(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BODY)
    result = run_pytest(pytester, "--ranks=2", timeout=TIMEOUT)
    result.assert_outcomes(passed=3)


@dataclass(frozen=True)
class _Seat:
    rank: int
    world_size: int = 2


@dataclass(frozen=True)
class _Spec:
    seat: _Seat
    join: bool = True
    group_backend: Any = None


CALLS: list[tuple[int, str]] = []


def _rank_fn(world: Any, tag: str) -> None:
    """Never run: only its rehearsal is."""


def _record(seat: _Seat, tag: str) -> None:
    if tag == "raise":
        raise RuntimeError("a failed rehearsal")
    CALLS.append((seat.rank, tag))


_rank_fn.subworld_rehearse = _record  # type: ignore[attr-defined]


def _payload(rank: int, tag: str, **spec: Any) -> bytes:
    return pickle.dumps((_Spec(_Seat(rank), **spec), _rank_fn, (tag,), {}))


def _rehearse(payload: bytes, rank: int) -> int:
    """Run a rehearsal to its end, as the warm process does between requests; its steps."""
    return len(list(zygote._rehearsal(payload, rank)))


def test_a_warm_process_rehearses_its_own_test_ranks_seat_only() -> None:
    CALLS.clear()
    _rehearse(_payload(1, "other rank"), rank=0)
    _rehearse(_payload(0, "mutated", group_backend="sprite_mutant"), rank=0)
    _rehearse(_payload(0, "no world", join=False), rank=0)
    _rehearse(_payload(0, "raise"), rank=0)  # its error is the real rank's to report, not the warm's
    _rehearse(b"not a pickle", rank=0)
    assert CALLS == []
    _rehearse(_payload(0, "own"), rank=0)
    assert CALLS == [(0, "own")]


def _in_steps(seat: _Seat, tag: str) -> Any:
    for step in range(3):
        if tag == "raise" and step == 1:
            raise RuntimeError("a failed step")
        CALLS.append((seat.rank, f"{tag}{step}"))
        yield


def _stepped_fn(world: Any, tag: str) -> None:
    """Never run: only its rehearsal is, in steps."""


_stepped_fn.subworld_rehearse = _in_steps  # type: ignore[attr-defined]


def test_a_rehearsal_in_steps_is_advanced_one_step_at_a_time() -> None:
    """Between two steps the warm process serves a test waiting for its zygote; a failed step ends it."""
    CALLS.clear()
    steps = zygote._rehearsal(pickle.dumps((_Spec(_Seat(0)), _stepped_fn, ("s",), {})), 0)
    assert CALLS == []  # nothing runs before the first step
    next(steps)
    assert CALLS == [(0, "s0")]
    assert list(steps) == [None, None] and CALLS == [(0, "s0"), (0, "s1"), (0, "s2")]
    CALLS.clear()
    assert _rehearse(pickle.dumps((_Spec(_Seat(0)), _stepped_fn, ("raise",), {})), 0) == 1
    assert CALLS == [(0, "raise0")]


DRY = """
import json, os, torch, torch.distributed as dist
import lightning.pytorch  # a zygote has it loaded (its preparation): importing it sets variables of its own
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from pytest_sprite.subworld.join import Seat
from pytest_sprite.subworld.dry_world import rehearsing
from pytest_sprite.world import current_world

seat = Seat(rank=1, world_size=4, master_addr="127.0.0.1", master_port=1, device="cpu", timeout=60.0, node=0,
            local_rank=1, local_size=4, local_devices=(0, 1, 2, 3), device_index=1)
env, rng, threads = dict(os.environ), torch.get_rng_state(), torch.get_num_threads()
out = {}
with rehearsing(seat) as world:
    out["world"] = [world.rank, world.size, dist.get_rank(), dist.get_world_size(), os.environ["RANK"]]
    gathered = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(gathered, torch.tensor([7.0]))
    out["all_gather"] = [t.item() for t in gathered]
    objects = ["mine"]
    dist.broadcast_object_list(objects, src=0)
    out["broadcast_object_list"] = objects
    mesh = init_device_mesh("cpu", (4,))
    out["coordinate"] = mesh.get_coordinate()
    local = torch.tensor([[1.0, 2.0]])
    out["shard_full"] = DTensor.from_local(local, mesh, [Shard(0)]).full_tensor().tolist()
    out["partial_full"] = DTensor.from_local(local, mesh, [Partial()]).full_tensor().tolist()
    out["dry_name"] = dist.group.WORLD.group_name
    torch.manual_seed(123)
out["after"] = [dist.is_initialized(), dict(os.environ) == env, torch.equal(torch.get_rng_state(), rng),
                torch.get_num_threads() == threads, current_world() is None]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out["real_name"] = dist.group.WORLD.group_name
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_dry_world_answers_as_if_every_rank_held_this_ranks_data_and_leaves_nothing_behind() -> None:
    done = subprocess.run([sys.executable, "-c", DRY], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["world"] == [1, 4, 1, 4, "1"]
    assert out["all_gather"] == [7.0] * 4
    assert out["broadcast_object_list"] == ["mine"]  # a non-source rank keeps its own objects
    assert out["coordinate"] == [1]  # the rank rehearsed is the rank whose caches are kept
    assert out["shard_full"] == [[1.0, 2.0]] * 4  # the functional all-gather, routed to the dry group
    assert out["partial_full"] == [[1.0, 2.0]]  # the functional all-reduce too
    assert out["after"] == [False, True, True, True, True]
    assert out["real_name"] == out["dry_name"]  # groups are numbered again: cached meshes name the real ones


def test_a_checks_first_role_rehearses_every_kind_its_own_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume check's fit announces a session of checks: its own kind, then the others, one step each;
    a later role rehearses its own kind only."""
    from pytest_sprite import LoraQwen
    from pytest_sprite.recipes import _resume
    from pytest_sprite.recipes.resume_spec import ResumeRecipe, RoleSpec
    from pytest_sprite.subworld.join import Seat

    asked: list[tuple[str, str]] = []

    def kind(seat: Seat, spec: RoleSpec) -> bool:
        asked.append((spec.strategy, spec.precision))
        return spec.strategy != "fsdp"  # as if fsdp's were rehearsed before: no step

    monkeypatch.setattr(_resume, "_rehearse_kind", kind)
    recipe = ResumeRecipe(source=LoraQwen(), global_batch=4)
    spec = RoleSpec(role="fit", strategy="fsdp_file", precision="bf16-mixed", recipe=recipe, directory="d")
    seat = Seat.__new__(Seat)
    assert len(list(_resume._rehearse(seat, spec))) == 3
    assert asked == [("fsdp_file", "bf16-mixed"), *_resume.REHEARSED_KINDS]
    asked.clear()
    assert len(list(_resume._rehearse(seat, dataclasses.replace(spec, role="resume")))) == 1
    assert asked == [("fsdp_file", "bf16-mixed")]
