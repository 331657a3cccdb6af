"""A dry world: one process playing one rank of a world whose collectives answer at once, for rehearsing a fit.

torch keeps per-process caches a fit fills the first time it runs: DTensor works out each operator's sharding
once per shape, and a fresh process pays every miss again (about 0.7 s of a 4-rank FSDP2 fit's 0.9 s on the
2-core test machine). A process forked from one that ran the same fit inherits them filled. A sub-world's
ranks are fresh forks, so a long-lived process that forks only test rank r's sub-world ranks (the warm
process, ``subworld/zygote.py``) rehearses each kind of fit once here, as rank r of a world of its size.

The cached results carry the device mesh they were worked out on, and a mesh holds its rank's coordinate and
names its groups: a rehearsal is only sound as the same rank of a world of the same size, with groups made in
the same order (destroying the world restarts torch's group numbering, so the real world's groups get the
rehearsal's names and a cached mesh resolves to the real groups by name).

Every rank holds this rank's data: a broadcast keeps it, a gather repeats it, a reduction leaves it and a
reduce-scatter keeps this rank's part; an object collective keeps each rank's own objects. Nothing is sent.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist

from pytest_sprite.plumbing.dependency_internals import (
    device_stand_in,
    functional_collectives_routed,
    process_group_device_backend,
)
from pytest_sprite.plumbing.process import computing_before_fork
from pytest_sprite.plumbing.python_group import PythonProcessGroup
from pytest_sprite.world import World, _set_current, current_world

from .join import Seat, join_world

__all__ = ["BACKEND_NAME", "DryProcessGroup", "rehearsing"]

BACKEND_NAME: Final = "sprite_dry"
"""The backend name a dry world's groups are made with."""

_registered: list[bool] = []


class _Done(dist.Work):
    """A collective that has finished: its future holds the tensors it answered with."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class DryProcessGroup(PythonProcessGroup):
    """Every collective answered at once, as if every rank held this rank's tensors."""

    backend_name = BACKEND_NAME

    def getGroupDesc(self) -> str:
        return "dry"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _Done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _Done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _Done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _Done(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, mine in zip(outputs, inputs, strict=True):
            mine = mine.clone()
            for t in out:
                t.copy_(mine)
        return _Done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        output.view(self.size(), -1).copy_(input.reshape(1, -1).clone())
        return _Done([output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, mine in zip(outputs, inputs, strict=True):
            out.view(self.size(), -1).copy_(mine.reshape(1, -1).clone())
        return _Done(outputs)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        for out, parts in zip(outputs, inputs, strict=True):
            out.copy_(parts[self.rank()])
        return _Done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        output.copy_(input.reshape(self.size(), *output.shape)[self.rank()].clone())
        return _Done([output])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, mine in zip(outputs, inputs, strict=True):
            out.copy_(mine.reshape(self.size(), *out.shape)[self.rank()].clone())
        return _Done(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather(outputs, inputs, opts) if outputs and outputs[0] else _Done(inputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        if inputs and inputs[0]:
            for out, parts in zip(outputs, inputs, strict=True):
                out.copy_(parts[self.rank()])
        return _Done(outputs)

    def barrier(self, opts: Any = None) -> Any:
        return _Done([])


def _create(options: Any, _backend_options: Any) -> Any:
    group = DryProcessGroup(options.group_rank, options.group_size, str(options.group_id))
    # what picks a device from the group's backends (object collectives, barrier) finds the CPU
    stand_in = device_stand_in(options.group_rank, options.group_size)
    if stand_in is not None:
        process_group_device_backend(group, stand_in, ["cpu"], "CUSTOM")
    return group


def _register() -> None:
    if not _registered:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
        _registered.append(True)


@contextlib.contextmanager
def _own_objects_kept() -> Iterator[None]:
    """Object collectives keep each rank's own objects (a broadcast's non-source rank has none to receive)."""

    def broadcast_object_list(
        objects: list[Any], src: int | None = None, group: Any = None, **_: Any
    ) -> None:
        return None

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        out[:] = [obj] * len(out)

    def gather_object(obj: Any, out: list[Any] | None = None, dst: int | None = None, **_: Any) -> None:
        if out is not None:
            out[:] = [obj] * len(out)

    replacements = {
        "broadcast_object_list": broadcast_object_list,
        "all_gather_object": all_gather_object,
        "gather_object": gather_object,
    }
    modules = [dist, sys.modules["torch.distributed.distributed_c10d"]]
    saved = [(m, name, getattr(m, name)) for m in modules for name in replacements]
    try:
        for module in modules:
            for name, fn in replacements.items():
                setattr(module, name, fn)
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


@contextlib.contextmanager
def _nothing_changes() -> Iterator[None]:
    """What a fit sets for the process (environment, random generators, thread count, current world,
    Lightning's rank) is as it was afterwards, and what it prints goes nowhere."""
    from lightning.pytorch.utilities import rank_zero_only

    env = dict(os.environ)
    states = (random.getstate(), torch.get_rng_state(), torch.get_num_threads())
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    world = current_world()
    lightning_rank = getattr(rank_zero_only, "rank", None)
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        os.close(kept[0])
        os.close(kept[1])
        os.environ.clear()
        os.environ.update(env)
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        torch.set_num_threads(states[2])
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        _set_current(world)
        if lightning_rank is not None:
            rank_zero_only.rank = lightning_rank  # type: ignore[attr-defined]


@contextlib.contextmanager
def rehearsing(seat: Seat) -> Iterator[World]:
    """Inside: this process is rank ``seat.rank`` of a dry world of ``seat.world_size`` on the CPU, as a
    sub-world rank joins its world (the same variables, device and default group, made the same way).

    On the way out the world is destroyed and the process is as before but for what torch cached. Raises
    when this process already has a default process group.
    """
    if dist.is_initialized():
        raise RuntimeError("a dry world needs a process without a default process group")
    _register()
    with _nothing_changes(), computing_before_fork(), functional_collectives_routed(), _own_objects_kept():
        seat.export_env()
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        # one thread, whatever Lightning or join_world would choose: a parallel region here would hang the forks
        os.environ["OMP_NUM_THREADS"] = "1"
        world, _ = join_world(
            seat,
            connect=lambda _timeout: getattr(dist, "HashStore")(),  # noqa: B009 (no stub)
            sink=lambda _name, _rank, _tensor: None,
            group_prefix="pg",
            group_backend=lambda _device_backend: BACKEND_NAME,
        )
        try:
            yield world
        finally:
            dist.destroy_process_group()
