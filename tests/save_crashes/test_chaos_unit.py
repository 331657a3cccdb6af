"""The crash matrix's parts: the event recorder, crashing and tearing, the pure verdict rules, out_dir refusal."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_sprite.assertions.crash_consistency import (
    SCRATCH,
    CrashMatrix,
    CrashRow,
    judge_crash_matrix,
    judge_matrix,
    judge_row,
)
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.save_crashes.events import FileEvent, read_event_log
from pytest_sprite.save_crashes.inject import CRASH_EXIT_CODE, PLAN_ENV, Plan
from pytest_sprite.save_crashes.matrix import CrashPoint, crash_points, prepare_out_dir
from pytest_sprite.save_crashes.target_run import run_ranks
from pytest_sprite.save_crashes.targets import weight_diff, write_sitecustomize
from pytest_sprite.subworld import KillAt, KillPoint

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    """Import torch and safetensors here once, as the matrix does, so that no forked run imports them cold."""
    pytest.importorskip("safetensors.torch")
    from pytest_sprite.plumbing.process import prewarm_training

    prewarm_training()


def _file_work(root: Path) -> dict[str, Any]:
    """Every kind of file event the recorder knows, plus operations it must ignore."""
    import io

    import torch
    from safetensors.torch import save_file

    outside = root.parent / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "x.txt").write_text("ignored: outside the watched folder")
    (root / "d").mkdir()
    os.makedirs(root / "d", exist_ok=True)  # exists already: changes nothing, not an event
    with open(root / "d" / "a.txt", "w") as f:
        f.write("0123456789" * 10)
    (root / "d" / "a.txt").read_text()  # reading is not an event
    torch.save({"w": torch.arange(1000.0)}, root / "d" / "t.pt")
    torch.save({"w": torch.zeros(3)}, io.BytesIO())  # not a file: not an event
    save_file({"w": torch.ones(1000)}, str(root / "d" / "s.safetensors"))
    os.rename(root / "d" / "a.txt", root / "d" / "b.txt")
    os.replace(root / "d" / "b.txt", root / "d" / "c.txt")
    os.remove(root / "d" / "c.txt")
    (root / "e").mkdir()
    (root / "e" / "f.txt").write_text("x")
    shutil.rmtree(root / "e")
    return {"done": 1}


EXPECTED = [
    ("mkdir", "d", None),
    ("open", "d/a.txt", None),
    ("torch.save", "d/t.pt", None),
    ("safetensors", "d/s.safetensors", None),
    ("rename", "d/a.txt", "d/b.txt"),
    ("rename", "d/b.txt", "d/c.txt"),
    ("remove", "d/c.txt", None),
    ("mkdir", "e", None),
    ("open", "e/f.txt", None),
    ("rmtree", "e", None),
]


def _crash(index: int, *, torn: bool = False) -> KillAt:
    """The kill plan the matrix builds for a crash at rank 0's event ``index``."""
    return CrashPoint(event=FileEvent(index=index, rank=0, kind="open", path="-"), torn=torn).kill_plan()


def _run(tmp_path: Path, name: str, kill: KillAt | None = None) -> tuple[Path, Any]:
    root = tmp_path / name
    root.mkdir()
    log = tmp_path / f"{name}.events"
    outcome = run_ranks(
        _file_work,
        (root,),
        plans=[Plan(root=str(root), log=str(log))],
        envs=[{}],
        logs=[tmp_path / f"{name}.out"],
        timeout=120,
        kill=kill,
    )
    return root, (outcome, read_event_log(log))


def test_recorder_sees_every_file_event_under_the_root_and_nothing_else(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    _, (outcome, log) = _run(tmp_path, "rec")
    assert outcome.ranks[0].status == "returned", (tmp_path / "rec.out").read_text()
    events = [(e.kind, e.path, e.dest) for e in log.events]
    # shutil.rmtree's own unlinks follow its event; only the events up to it are the protocol's
    assert events[: len(EXPECTED)] == EXPECTED
    assert all(e.startswith("e") for _, e, _ in events[len(EXPECTED) :]), events
    assert [e.index for e in log.events] == list(range(len(log.events)))


def test_a_planned_crash_dies_inside_the_event_before_it_takes_effect(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    root, (outcome, log) = _run(tmp_path, "crash", _crash(4))  # the first rename
    assert outcome.ranks[0].status == "crashed"
    assert outcome.ranks[0].crashed_at == 4  # where the sub-world says its kill plan struck
    assert log.events[-1].describe() == "rename d/a.txt -> d/b.txt"
    assert (root / "d" / "a.txt").exists() and not (root / "d" / "b.txt").exists()
    root, (outcome, _) = _run(tmp_path, "crash-save", _crash(2))  # torch.save: the file never appears
    assert outcome.ranks[0].status == "crashed" and not (root / "d" / "t.pt").exists()


@pytest.mark.parametrize(
    ("index", "name"),
    [(1, "a.txt"), (2, "t.pt"), (3, "s.safetensors")],
    ids=["open", "torch.save", "safetensors"],
)
def test_a_torn_crash_leaves_the_file_cut_to_half(tmp_path: Path, index: int, name: str) -> None:
    pytest.importorskip("safetensors")
    full_root, (full, _) = _run(tmp_path, "full")
    assert full.ranks[0].status == "returned"
    full_size = {"a.txt": 100}.get(name) or (full_root / "d" / name).stat().st_size
    root, (outcome, log) = _run(tmp_path, "torn", _crash(index, torn=True))
    assert outcome.ranks[0].status == "crashed" and outcome.ranks[0].crashed_at == index
    assert (root / "d" / name).stat().st_size == full_size // 2
    assert log.events[index].path == f"d/{name}"


def test_marks_and_the_planned_crash(tmp_path: Path) -> None:
    def work(root: Path) -> int:
        from pytest_sprite.save_crashes import note_resumed_from, note_save_complete

        note_resumed_from(None)
        (root / "ckpt-1").mkdir()
        note_save_complete("ckpt-1")
        (root / "ckpt-2").mkdir()
        return 0

    log_path = tmp_path / "m.events"
    outcome = run_ranks(
        work,
        (tmp_path,),
        plans=[Plan(root=str(tmp_path), log=str(log_path))],
        envs=[{}],
        logs=[tmp_path / "m.out"],
        timeout=60,
        kill=_crash(1),
    )
    assert outcome.ranks[0].status == "crashed" and outcome.ranks[0].crashed_at == 1
    log = read_event_log(log_path)
    assert log.completed_saves() == ("ckpt-1",)
    assert log.resumed_from() == SCRATCH
    assert [(m.mark, m.after) for m in log.marks] == [("resumed_from", 0), ("save_complete", 1)]


def test_the_matrix_plans_a_crash_at_the_file_point_and_a_torn_one_at_the_written_point() -> None:
    event = FileEvent(index=3, rank=1, kind="torch.save", path="ckpt-2/model.pt")
    untorn = CrashPoint(event=event, torn=False).kill_plan()
    torn = CrashPoint(event=event, torn=True).kill_plan()

    def point(event: str, rank: int = 1, index: int = 3) -> KillPoint:
        return KillPoint(rank=rank, event=event, count=index + 1, index=index, detail="ckpt-2/model.pt")

    assert untorn.should_kill(point("file")) and not untorn.should_kill(point("written"))
    assert torn.should_kill(point("written")) and not torn.should_kill(point("file"))
    assert not untorn.should_kill(point("file", rank=0)) and not untorn.should_kill(point("file", index=2))
    plan = Plan(root="/r", log="/l", rank=1, kill=torn)
    assert Plan.from_json(plan.to_json()) == plan  # the command form's interpreter gets the same plan


def _planned_work(root: Path) -> None:
    from pytest_sprite.save_crashes import inject

    inject.install(Plan(root=str(root), log=str(root / "x.events"), kill=_crash(0)))


def test_in_a_sub_world_rank_the_kill_plan_is_the_sub_worlds(tmp_path: Path) -> None:
    outcome = run_ranks(
        _planned_work, (tmp_path,), plans=[None], envs=[{}], logs=[tmp_path / "x.out"], timeout=60
    )
    assert outcome.ranks[0].status == "raised"
    assert "the kill plan is the sub-world's; pass it as run_subworld(..., kill=...)" in (
        outcome.ranks[0].error or ""
    )


def test_a_command_interpreter_asks_the_same_plan_and_exits_with_the_crash_status(tmp_path: Path) -> None:
    """Not a sub-world rank: the plan travels in the environment and the process ends with the crash status."""
    inject_dir = write_sitecustomize(tmp_path / "inject").parent
    root = tmp_path / "run"
    root.mkdir()
    script = (
        f"open({str(root / 'a.txt')!r}, 'w').write('0123456789' * 10)\nopen({str(root / 'b.txt')!r}, 'w')\n"
    )
    plan = Plan(root=str(root), log=str(tmp_path / "c.events"), kill=_crash(0, torn=True))
    env = {**os.environ, "PYTHONPATH": str(inject_dir), PLAN_ENV: plan.to_json()}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert done.returncode == CRASH_EXIT_CODE, done.stderr.decode()[-2000:]
    assert (root / "a.txt").stat().st_size == 50 and not (root / "b.txt").exists()
    assert [e.path for e in read_event_log(tmp_path / "c.events").events] == ["a.txt"]


def test_event_log_ignores_a_line_cut_by_a_dying_process_and_rejects_garbage(tmp_path: Path) -> None:
    log = tmp_path / "x.events"
    line = json.dumps(FileEvent(index=0, rank=0, kind="mkdir", path="a").to_dict())
    log.write_text(line + '\n{"i": 1, "ra')
    assert len(read_event_log(log).events) == 1
    log.write_text('{"i": 1, "ra\n' + line + "\n")
    with pytest.raises(ValueError, match=r"x.events:1: not an event log line"):
        read_event_log(log)


def test_crash_points_tear_only_file_writes_and_sample_evenly() -> None:
    from pytest_sprite.save_crashes.events import EventLog

    events = tuple(
        FileEvent(index=i, rank=0, kind=k, path=f"f{i}")
        for i, k in enumerate(["mkdir", "open", "rename", "torch.save"])
    )
    points = crash_points(EventLog(events=events, marks=()), 1)
    assert [(p.event.kind, p.torn) for p in points] == [
        ("mkdir", False),
        ("open", False),
        ("open", True),
        ("rename", False),
        ("torch.save", False),
        ("torch.save", True),
    ]
    sampled = crash_points(EventLog(events=events, marks=()), 1, max_points=3)
    assert [(p.event.index, p.torn) for p in sampled] == [(0, False), (1, True), (3, True)]


# --- verdict rules (pure) ------------------------------------------------------------------------------


def _row(**kw: Any) -> CrashRow:
    base: dict[str, Any] = dict(
        point=1,
        rank=0,
        event="open",
        file="ckpt-2/x",
        torn=False,
        crashed=True,
        resume_status="returned",
        weight_diff=0.0,
    )
    base.update(kw)
    return CrashRow(**base)


SAVES = ("ckpt-1", "ckpt-2")


@pytest.mark.parametrize(
    ("facts", "verdict"),
    [
        ({}, "PASS"),
        ({"resume_status": "raised", "weight_diff": None, "error": "FileNotFoundError: x"}, "HARD_FAIL"),
        ({"resume_status": "died", "weight_diff": None}, "HARD_FAIL"),
        ({"resume_status": "timeout", "weight_diff": None}, "HARD_FAIL"),
        ({"weight_diff": 1.65e-4}, "SILENT_DIVERGENCE"),
        ({"weight_diff": math.nan}, "SILENT_DIVERGENCE"),
        ({"weight_diff": math.inf}, "SILENT_DIVERGENCE"),
        ({"newest_complete": "ckpt-2", "resumed_from": "ckpt-1"}, "LOST_WORK"),
        ({"newest_complete": "ckpt-1", "resumed_from": SCRATCH}, "LOST_WORK"),
        ({"newest_complete": "ckpt-2", "resumed_from": "ckpt-2"}, "PASS"),
        ({"newest_complete": "ckpt-2", "resumed_from": None}, "PASS"),  # completeness unknown: no LOST_WORK
        ({"newest_complete": "ckpt-2", "resumed_from": "ckpt-1", "weight_diff": 1.0}, "SILENT_DIVERGENCE"),
    ],
)
def test_judge_row(facts: dict[str, Any], verdict: str) -> None:
    assert judge_row(_row(**facts), atol=0.0, saves=SAVES) == verdict


def test_judge_row_atol() -> None:
    assert judge_row(_row(weight_diff=1e-7), atol=1e-6, saves=()) == "PASS"
    assert judge_row(_row(weight_diff=1e-5), atol=1e-6, saves=()) == "SILENT_DIVERGENCE"


def _matrix(rows: list[CrashRow], **kw: Any) -> CrashMatrix:
    base: dict[str, Any] = dict(
        target="t",
        ranks=1,
        atol=0.0,
        allow_lost_work=True,
        fault_free_diff=0.0,
        flake_runs=0,
        flake_failures=(),
        saves=SAVES,
        control=_row(point=0, rank=None, event="control", file="-", crashed=False),
        rows=tuple(rows),
    )
    base.update(kw)
    return judge_matrix(CrashMatrix(**base))


def test_matrix_problems() -> None:
    lost = _row(point=2, newest_complete="ckpt-2", resumed_from="ckpt-1")
    ok = _matrix([_row(), lost])
    assert ok.passed and ok.counts["LOST_WORK"] == 1 and ok.kind == "crash_consistency"
    strict = _matrix([_row(), lost], allow_lost_work=False)
    assert strict.problems == ("1 LOST_WORK of 2 crash points",)
    bad = _matrix([_row(resume_status="raised", weight_diff=None), _row(point=2, weight_diff=0.5)])
    assert bad.problems == ("1 HARD_FAIL + 1 SILENT_DIVERGENCE of 2 crash points",)
    assert bad.summary() == "1 HARD_FAIL + 1 SILENT_DIVERGENCE of 2 crash points (control PASS)"
    noisy = _matrix([_row()], fault_free_diff=2.5e-3)
    assert noisy.problems[0].startswith(
        "two fault-free runs already differ (max weight diff 2.50e-3 > atol 0)"
    )
    flaky = _matrix([_row()], flake_runs=25, flake_failures=("flake-3: FileNotFoundError: x", "flake-9: y"))
    assert flaky.problems == (
        "2 of 25 repeated fault-free runs failed: flake-3: FileNotFoundError: x; flake-9: y",
    )
    control = _matrix(
        [_row()], control=_row(point=0, rank=None, resume_status="raised", weight_diff=None, error="E")
    )
    assert control.problems == ("the control run (no crash) came back HARD_FAIL: E",)


def test_stored_matrix_is_judged_again_and_copied_directories_judge_the_same(tmp_path: Path) -> None:
    matrix = _matrix([_row(), _row(point=2, newest_complete="ckpt-2", resumed_from="ckpt-1")])
    out = tmp_path / "a"
    out.mkdir()
    matrix.write(out)
    data = json.loads((out / "matrix.json").read_text())
    assert data["kind"] == "crash_consistency" and data["counts"]["LOST_WORK"] == 1
    data["rows"][1]["verdict"] = "PASS"  # a stored verdict is never trusted
    data["allow_lost_work"] = False
    (out / "matrix.json").write_text(json.dumps(data))
    shutil.copytree(out, tmp_path / "b")
    judged = judge_crash_matrix(tmp_path / "b")
    assert judged.rows[1].verdict == "LOST_WORK" and not judged.passed
    assert judged.to_dict()["rows"] == matrix.to_dict()["rows"]
    with pytest.raises(SpriteUsageError, match=r"holds no matrix.json; pass the out_dir of a finished"):
        judge_crash_matrix(tmp_path)


def test_table_lists_control_first_with_relative_files() -> None:
    matrix = _matrix(
        [_row(file="ckpt-2/model.pt", torn=True, resume_status="raised", weight_diff=None, error="E: x")]
    )
    lines = matrix.table().splitlines()
    assert lines[0].split() == [
        "Point",
        "Rank",
        "File",
        "Event",
        "Torn",
        "Verdict",
        "Newest",
        "complete",
        "Resumed",
        "from",
        "Weight",
        "diff",
        "Error",
    ]
    assert lines[2].split()[:2] == ["control", "-"]
    assert lines[3].split() == [
        "1",
        "0",
        "ckpt-2/model.pt",
        "open",
        "torn",
        "HARD_FAIL",
        "-",
        "-",
        "-",
        "E:",
        "x",
    ]


def test_out_dir_that_exists_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("user data")
    with pytest.raises(SpriteUsageError) as info:
        prepare_out_dir(tmp_path / "mine")
    assert str(info.value) == (
        f"out_dir {str(tmp_path / 'mine')!r} exists; the crash matrix writes only into a directory it creates "
        "itself. Pass a path that does not exist yet, e.g. tmp_path / 'chaos'"
    )
    assert os.listdir(tmp_path / "mine") == ["keep.txt"]


def test_a_failed_run_names_the_rank_whose_own_error_broke_its_peers() -> None:
    """A rank that raised first ends its peers' collectives; their transport errors are the consequence."""
    from pytest_sprite.save_crashes.target_run import RankOutcome, RunOutcome

    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45258"
    cause = "FileNotFoundError: [Errno 2] No such file or directory: 'ckpt-2.tmp'"
    hung = "still running after 120 s; killed"

    def run(*ranks: tuple[Any, str]) -> RunOutcome:
        outcomes = (RankOutcome(rank=r, status=s, error=e) for r, (s, e) in enumerate(ranks))
        return RunOutcome(ranks=tuple(outcomes), wall_s=1.0)

    assert run(("raised", lost), ("raised", cause)).first_error() == f"rank 1: {cause}"
    assert run(("timeout", hung), ("raised", cause)).first_error() == f"rank 1: {cause}"
    assert run(("raised", lost), ("timeout", hung)).first_error() == f"rank 1: {hung}"
    assert run(("raised", lost), ("raised", lost)).first_error() == f"rank 0: {lost}"
    assert run(("raised", cause), ("returned", "")).first_error() == f"rank 0: {cause}"
    assert run(("returned", "")).first_error() is None


def test_weight_diff() -> None:
    torch = pytest.importorskip("torch")
    a = {"w": torch.tensor([1.0, 2.0])}
    assert weight_diff(a, {"w": torch.tensor([1.0, 2.5])}) == 0.5
    assert weight_diff(a, {"v": torch.tensor([1.0, 2.0])}) == math.inf
    assert weight_diff(a, {"w": torch.tensor([1.0])}) == math.inf
    assert weight_diff({"w": [1, 2.0]}, {"w": [1, 2.25]}) == 0.25


def _parallel_work() -> int:
    import torch

    return int(torch.nn.functional.relu(torch.randn(4_000_000)).gt(0).any())


def test_a_run_forked_after_parallel_work_in_this_process_does_not_hang(tmp_path: Path) -> None:
    """GNU OpenMP hangs a child forked after the parent's parallel region; earlier tests leave one behind."""
    torch = pytest.importorskip("torch")
    torch.nn.functional.relu(torch.randn(4_000_000))
    outcome = run_ranks(_parallel_work, (), plans=[None], envs=[{}], logs=[tmp_path / "run.out"], timeout=60)
    assert outcome.ranks[0].status == "returned", (tmp_path / "run.out").read_text()
    assert outcome.value(0) == 1
