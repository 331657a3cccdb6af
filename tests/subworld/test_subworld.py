"""Sub-worlds from a plain test (a world of its own): results, kill points, crashes, timeouts, refusals."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pytest_sprite import KillAt, SubworldError, run_subworld
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.stacks import Frame
from pytest_sprite.subworld import KillPoint, emit, in_subworld, kill_point

pytestmark = pytest.mark.cpu


def where_am_i(world: Any, base: float) -> dict[str, Any]:
    t = torch.tensor([base + world.rank])
    dist.all_reduce(t)
    return {
        "rank": world.rank,
        "size": world.size,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "sum": t.item(),
        "pid": os.getpid(),
        "inside": in_subworld(),
    }


def steps(world: Any, n: int) -> str:
    for step in range(1, n + 1):
        emit("step", (world.rank, step))
        kill_point("step", step)
        dist.barrier()
    return "done"


def files(world: Any, n: int) -> int:
    for i in range(n):
        kill_point("file", detail=f"shard_{i}.distcp")
        emit("file", i)
    return n


def last_words(world: Any, n: int) -> int:
    for i in range(n):
        kill_point("file", i, before_kill=lambda i=i: emit("dying", i))
    return n


def crash(world: Any) -> None:
    dist.barrier()
    if world.rank == 0:
        os._exit(3)
    dist.barrier()


def fail(world: Any) -> None:
    if world.rank == 1:
        raise ValueError(f"boom on rank {world.rank}")
    dist.barrier()


def nest(world: Any) -> Any:
    return run_subworld(where_am_i, args=(0.0,))


def hang(world: Any) -> None:
    time.sleep(60)


def test_results_come_back_from_every_rank() -> None:
    result = run_subworld(where_am_i, args=(1.0,), ranks=3)
    values = result.values()
    assert [v["rank"] for v in values] == [0, 1, 2]
    assert {v["size"] for v in values} == {3}
    assert [v["env"] for v in values] == [("0", "3"), ("1", "3"), ("2", "3")]
    assert {v["sum"] for v in values} == {1.0 + 2.0 + 3.0}
    assert len({v["pid"] for v in values} | {os.getpid()}) == 4  # fresh processes, not this one
    assert all(v["inside"] for v in values) and not in_subworld()
    assert result.ok and result.size == 3 and result.start_s <= result.wall_s
    assert result.report() == "sub-world where_am_i (3 ranks):\n  ranks 0-2: returned"


def test_a_rank_killed_at_a_step_ends_its_sub_world_and_is_reported_by_rank() -> None:
    result = run_subworld(steps, args=(5,), ranks=3, kill=KillAt(event="step", at=3, ranks=(1,)))
    assert result.killed() == [1]
    killed = result.outcomes[1]
    assert killed.killed_at == KillPoint(rank=1, event="step", count=3, index=3, detail="")
    assert killed.signum == 9
    assert killed.emitted("step") == [(1, 1), (1, 2), (1, 3)]  # what it sent before dying came back
    for rank in (0, 2):
        assert result.outcomes[rank].status == "ended"
        assert result.outcomes[rank].error == "rank 1 was killed at step 3"
    assert result.report() == (
        "sub-world steps (3 ranks):\n  ranks 0, 2: ended: rank 1 was killed at step 3\n"
        "  rank 1: killed at step 3 (signal 9)"
    )
    with pytest.raises(SubworldError, match="rank 1: killed at step 3") as info:
        result.values()
    assert info.value.result is result
    # The test that started it carries on, and a next sub-world runs normally.
    assert run_subworld(steps, args=(2,), ranks=2).values() == ["done", "done"]


def test_every_rank_killed_at_the_same_step() -> None:
    result = run_subworld(steps, args=(5,), ranks=2, kill=KillAt(event="step", at=2))
    assert result.killed() == [0, 1]
    assert [o.emitted("step")[-1] for o in result.outcomes] == [(0, 2), (1, 2)]


def lagging_steps(world: Any, n: int, lag: float) -> str:
    """``steps``, but the last rank spends ``lag`` seconds after every barrier (a save, a slow reload)."""
    for step in range(1, n + 1):
        emit("step", (world.rank, step))
        kill_point("step", step)
        dist.barrier()
        if world.rank == world.size - 1:
            time.sleep(lag)
    return "done"


def test_a_rank_that_lags_still_dies_at_the_step_the_plan_kills_every_rank_at() -> None:
    """Rank 0 reaches step 2 and dies 1 s before rank 1 does: rank 1 is killed there too, not ended.

    The resume check's killed role (every rank killed one step past its checkpoint) needs this: a rank
    still finishing the save before the step used to be ended by its peer's death instead.
    """
    result = run_subworld(lagging_steps, args=(5, 1.0), ranks=2, kill=KillAt(event="step", at=2))
    assert result.killed() == [0, 1], result.report()
    assert [o.emitted("step")[-1] for o in result.outcomes] == [(0, 2), (1, 2)]


def test_kill_inside_the_nth_file_event() -> None:
    result = run_subworld(files, args=(5,), ranks=2, kill=KillAt(event="file", at=3, ranks=(0,)))
    killed = result.outcomes[0]
    assert killed.killed_at == KillPoint(rank=0, event="file", count=3, index=None, detail="shard_2.distcp")
    assert killed.emitted("file") == [0, 1]
    assert killed.describe() == "killed at file #3 (shard_2.distcp) (signal 9)"
    assert result.outcomes[1].status in ("returned", "ended")  # it may finish before it hears


def test_before_kill_runs_only_where_the_plan_kills() -> None:
    result = run_subworld(last_words, args=(4,), ranks=2, kill=KillAt(event="file", at=2, ranks=(1,)))
    assert result.outcomes[0].emitted("dying") == []
    assert result.outcomes[1].emitted("dying") == [2]
    assert result.outcomes[1].killed_at == KillPoint(rank=1, event="file", count=3, index=2, detail="")


def test_a_crash_is_reported_with_its_exit_code() -> None:
    result = run_subworld(crash, ranks=2)
    assert result.outcomes[0].status == "crashed"
    assert result.outcomes[0].exitcode == 3
    assert result.outcomes[0].describe() == "crashed (exit code 3)"
    assert result.outcomes[1].status == "ended"


@pytest.mark.slow  # about a minute: the failing rank waits out its peers
def test_an_exception_comes_back_with_its_traceback() -> None:
    result = run_subworld(fail, ranks=2)
    assert result.outcomes[1].status == "raised"
    assert "ValueError: boom on rank 1" in result.outcomes[1].error
    assert result.outcomes[1].describe() == "raised ValueError: boom on rank 1"
    assert result.outcomes[0].status in ("ended", "raised")


def test_nested_sub_worlds_are_refused() -> None:
    result = run_subworld(nest, ranks=1)
    assert result.outcomes[0].status == "raised"
    assert (
        "SpriteUsageError: run_subworld cannot be nested: this process is already a rank of a sub-world. "
        "Start every sub-world from the test itself, one after another"
    ) in result.outcomes[0].error


def test_a_hung_sub_world_times_out_with_its_stacks() -> None:
    result = run_subworld(hang, ranks=1, timeout=8)
    outcome = result.outcomes[0]
    assert outcome.status == "timeout"
    assert outcome.error == "did not finish within the sub-world's timeout of 8 s"
    assert "in hang" in outcome.output  # faulthandler's stack of the rank
    assert result.wall_s < 30


def restore_signals_as_a_lightning_fit_does() -> None:
    """What Lightning's ``_SignalConnector`` does to signals around every ``Trainer.fit``.

    ``register_signal_handlers`` reads every valid signal's handler with ``signal.getsignal`` and installs
    its own SIGTERM handler; ``teardown``, at the end of the fit, puts back every handler it read that is
    not None with ``signal.signal``: SIG_DFL for the dump signal and the fatal ones, which faulthandler
    holds at the C level where ``getsignal`` does not see it.
    """
    import signal

    valid = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    originals = {signum: signal.getsignal(signum) for signum in valid}
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    for signum, handler in originals.items():
        if handler is not None:
            signal.signal(signum, handler)


def hang_after_a_fit(world: Any) -> None:
    restore_signals_as_a_lightning_fit_does()
    time.sleep(60)


HUNG_LINE = hang_after_a_fit.__code__.co_firstlineno + 2


def test_a_sub_world_rank_that_ran_a_fit_and_hangs_gives_its_stack() -> None:
    """A plain test's sub-world keeps its ranks' stack dumps as a ranks test's children do: the handlers a
    fit puts back do not turn the dump signal into a kill, so the timeout names where each rank hung."""
    # 8 s: time for both ranks to start, join and reach the hang on a loaded 2-core machine first.
    result = run_subworld(hang_after_a_fit, ranks=2, timeout=8)
    for outcome in result.outcomes:
        assert outcome.status == "timeout", outcome.describe()
        assert outcome.signum == 9, "the timeout's kill ended it, not the dump signal"
        assert f'File "{__file__}", line {HUNG_LINE} in hang_after_a_fit' in outcome.output
        frames = [f for t in outcome.stacks.threads for f in t.frames]
        assert Frame(__file__, HUNG_LINE, "hang_after_a_fit") in frames
    assert f"  ranks 0-1: elsewhere, in time.sleep (test_subworld.py:{HUNG_LINE})" in result.report()


def fit_then_hang(world: Any) -> None:
    """One step of a real Lightning fit (its signal connector puts every handler back at the end), then a hang."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    class Line(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rows = DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Line(), rows)
    time.sleep(60)


@pytest.mark.slow  # imports Lightning in the rank and fits: the fast sibling does what the fit does to signals
def test_a_sub_world_rank_that_ran_a_real_lightning_fit_and_hangs_gives_its_stack() -> None:
    result = run_subworld(fit_then_hang, ranks=1, timeout=60)  # the import and the fit come first
    outcome = result.outcomes[0]
    assert outcome.status == "timeout", outcome.describe() + outcome.output
    assert outcome.signum == 9, "the timeout's kill ended it, not the dump signal"
    assert any(f.function == "fit_then_hang" for t in outcome.stacks.threads for f in t.frames), (
        outcome.output
    )
    assert "elsewhere, in time.sleep (test_subworld.py:" in result.report()


def one_rank_silent(world: Any) -> None:
    """Rank 1 ignores the dump signal and sleeps; rank 0 waits for it in an all-reduce."""
    import signal

    if world.rank == 1:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


WAITING_LINE = one_rank_silent.__code__.co_firstlineno + 7


def test_a_timed_out_sub_world_has_a_roll_call_and_says_why_a_rank_gave_no_stack() -> None:
    """As a ranks test's timeout: where each rank was, from its stack, and for the silent one why it gave none."""
    result = run_subworld(one_rank_silent, ranks=2, timeout=8)  # as above: both reach their place first
    assert [o.status for o in result.outcomes] == ["timeout", "timeout"]
    silent = result.outcomes[1].stacks.missing
    assert silent is not None and silent.startswith(
        "the test replaced the SIGUSR1 handler that dumps its stack (state "  # then what /proc says of it
    ), silent
    lines = result.report().splitlines()
    start = lines.index("where the 2 ranks were:")
    assert lines[start + 1 : start + 3] == [
        f"  rank 0: waiting in all_reduce (test_subworld.py:{WAITING_LINE})",
        f"  rank 1: no stack: {silent}",
    ]
    assert f"sprite: no stack: {silent}" in result.outcomes[1].output


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SpriteUsageError, match=r"must be picklable.*use a module-level function"):
        run_subworld(lambda world: None)
    with pytest.raises(SpriteUsageError, match=r"run_subworld\(ranks=0\): a positive int"):
        run_subworld(where_am_i, args=(0.0,), ranks=0)
    with pytest.raises(SpriteUsageError, match=r"kill= must be a kill plan with should_kill\(point\)"):
        run_subworld(where_am_i, args=(0.0,), kill="step 3")  # type: ignore[arg-type]
    with pytest.raises(SpriteUsageError, match=r"KillAt\(at=-1\): a non-negative int"):
        KillAt(event="step", at=-1)


def test_kill_point_and_emit_do_nothing_outside_a_sub_world() -> None:
    emit("x", 1)
    kill_point("step", 1)
    assert not in_subworld()


def parallel_work(world: Any) -> int:
    return int(torch.nn.functional.relu(torch.randn(4_000_000)).gt(0).any())


def test_a_fork_after_parallel_work_in_this_process_does_not_hang() -> None:
    """GNU OpenMP hangs a child forked after the parent's parallel region; earlier tests leave one behind."""
    torch.nn.functional.relu(torch.randn(4_000_000))  # a parallel region in the pytest process
    threads = torch.get_num_threads()
    assert run_subworld(parallel_work, ranks=2, timeout=60).values() == [1, 1]
    assert torch.get_num_threads() == threads  # only the children run on one thread


def test_ranks_fork_before_the_store_starts_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork taken while the store's server thread is inside the C library's resolver (torch names every
    peer that connects with getnameinfo) leaves the rank holding the resolver's lock: its own first lookup
    then waits for ever, and the sub-world hangs (seen once in CI, and under gdb in ``resolv_conf.c``).
    """
    from pytest_sprite.subworld.zygote import DirectForker

    spawn = DirectForker.spawn
    threads_at_fork: list[set[str]] = []

    def noting_threads(self: DirectForker, *args: Any, **kwargs: Any) -> int:
        threads_at_fork.append(set(os.listdir("/proc/self/task")))
        return spawn(self, *args, **kwargs)

    monkeypatch.setattr(DirectForker, "spawn", noting_threads)
    before = set(os.listdir("/proc/self/task"))
    assert run_subworld(where_am_i, args=(0.0,), ranks=3, timeout=60).ok
    assert len(threads_at_fork) == 3
    for threads in threads_at_fork:
        assert threads <= before, f"threads started by run_subworld before a fork: {threads - before}"
