"""The process group a test child runs on under ``--sprite-mutate``: a real backend, recorded and mutated.

A Python ``torch.distributed.ProcessGroup`` subclass wraps the backend the rank would have used (gloo, nccl,
xccl or mpi: :data:`INNER_BACKENDS`; only gloo on CPU is run by this project's tests), registered under its
own backend name and made the test's default group, so every caller reaches it: plain ``torch.distributed``
calls, DDP's C++ reducer (through torch's Python trampoline), FSDP2's
all-gather and reduce-scatter and DTensor's redistributions (sub-groups of a device mesh are made through
the same backend name; torch's functional all-gather and reduce-scatter, which DTensor's ``Shard`` and
``Partial`` redistributions call, are routed to this group's methods by
:func:`~pytest_sprite.plumbing.dependency_internals.route_functional_collectives`). Each collective runs
on the real backend and is waited for, then the mutant (if any) changes the result in place, so DDP's
futures see the changed tensors. The clean run records the op names each rank called: the controller runs a
mutant only for a test that called its op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
import torch.distributed as dist

from ..errors import SpriteUsageError
from ..plumbing.mutants import MutantSpec, current_run, start_run
from ..plumbing.python_group import PythonProcessGroup

__all__ = ["BACKEND_NAME", "INNER_BACKENDS", "called_ops", "install"]

BACKEND_NAME: Final = "sprite_mutant"
"""The backend name the test's default group is made with under ``--sprite-mutate``."""


def _options(make: Callable[[], Any], options: Any) -> Any:
    """``make()``'s backend options with the group's timeout, ranks and name, as ``init_process_group``
    sets them."""
    from ..plumbing.dependency_internals import backend_options_timeout

    opts = make()
    backend_options_timeout(opts, options.timeout)
    opts.global_ranks_in_group = options.global_ranks_in_group
    opts.group_name = options.group_id
    return opts


INNER_BACKENDS: Final[Mapping[str, Callable[[Any], Any]]] = {
    "gloo": lambda o: dist.ProcessGroupGloo(o.store, o.group_rank, o.group_size, o.timeout),
    "nccl": lambda o: dist.ProcessGroupNCCL(
        o.store, o.group_rank, o.group_size, _options(dist.ProcessGroupNCCL.Options, o)
    ),
    "xccl": lambda o: dist.ProcessGroupXCCL(
        o.store, o.group_rank, o.group_size, _options(dist.ProcessGroupXCCL.Options, o)
    ),
    "mpi": lambda o: dist.ProcessGroupMPI.create(o.global_ranks_in_group),
}
"""The backends ``--sprite-mutate`` wraps, each made from the options torch hands a registered backend's
creator (store, group rank and size, timeout) with torch's public constructors, as ``init_process_group``
makes them. Only gloo on CPU is run by this project's tests. The devices each serves and its backend type
are torch's own (``Backend.backend_capability``, ``Backend.backend_type_map``)."""


def _devices(name: str) -> list[str]:
    """The device types torch serves with backend ``name``: the wrapper registers the real backend for each,
    so what dispatches by device (object collectives, the functional collectives, barrier's device) finds it."""
    return list(dist.Backend.backend_capability.get(name, ()))


_state: dict[str, Any] = {
    "stale": {},
    "inner": "gloo",
    "registered": False,
}


def called_ops() -> list[str]:
    """What this rank recorded so far, in order: its collectives (the default group and its sub-groups) and
    the Lightning fit steps and restores a fault mutant could be planted in."""
    run = current_run()
    return list(run.ops) if run is not None else []


def install(mutant: str | None, inner_backend: str) -> str:
    """Register the wrapper backend over ``inner_backend`` and plant ``mutant`` (a spec string, or None for
    the recording clean run); the backend name for ``init_process_group``."""

    _inner(inner_backend)
    start_run(mutant).group_backend = functools.partial(install, mutant)
    _state.update(stale={}, inner=inner_backend)
    if not _state["registered"]:  # once per process; a forked child inherits it
        from ..plumbing.dependency_internals import route_functional_collectives

        every = dict.fromkeys(device for name in INNER_BACKENDS for device in _devices(name))
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=list(every))
        route_functional_collectives()
        _state["registered"] = True
    return BACKEND_NAME


def _inner(name: str) -> Callable[[Any], Any]:
    """How to make the backend ``name``; raises where ``--sprite-mutate`` cannot wrap it here."""
    inner = INNER_BACKENDS.get(name)
    if inner is None:
        *rest, last = INNER_BACKENDS
        raise SpriteUsageError(
            f"--sprite-mutate wraps {', '.join(rest)} and {last}; this test's process group uses {name!r}: "
            "run the mutants on one of those (--sprite-device=cpu runs them over gloo) or leave "
            "--sprite-mutate off"
        )
    available = getattr(dist, f"is_{name}_available", None)
    if available is None or not available():
        raise SpriteUsageError(
            f"--sprite-mutate would wrap this test's process group backend {name!r}, but this torch build "
            f"({torch.__version__}) has none (torch.distributed.is_{name}_available() is not True): run the "
            "mutants with a torch built with it, or on the CPU (--sprite-device=cpu runs them over gloo), or "
            "leave --sprite-mutate off"
        )
    return inner


def _create(options: Any, _backend_options: Any) -> Any:
    from ..plumbing.dependency_internals import process_group_device_backend

    name = _state["inner"]
    inner = _inner(name)(options)
    group = MutantProcessGroup(inner, options.group_rank, options.group_size, str(options.group_id))
    # what dispatches by device (torch's c10d ops) reaches the real backend; the functional collectives do not
    kind = dist.Backend.backend_type_map[name].name
    process_group_device_backend(group, inner, _devices(name), kind)
    return group


class MutantProcessGroup(PythonProcessGroup):
    """Every collective on the real backend, recorded, waited for, then mutated in place."""

    backend_name = BACKEND_NAME

    def __init__(self, inner: Any, rank: int, size: int, name: str) -> None:
        super().__init__(rank, size, name)
        self.inner = inner

    def getGroupDesc(self) -> str:
        return f"{BACKEND_NAME} over {_state['inner']}"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _allreduce(self, tensors, lambda ts: self.inner.allreduce(ts, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _allreduce(self, tensors, lambda ts: self.inner.allreduce_coalesced(ts, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        spec = _acting("broadcast", self)
        if spec is not None and opts is not None:
            opts.rootRank = (opts.rootRank + 1) % self.size()
        return _done(self.inner.broadcast(tensors, opts))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        spec = _acting("allgather", self)
        work = _done(self.inner.allgather(outputs, inputs, opts))
        if spec is not None and self.size() > 1:
            for out in outputs:
                a, b = out[0].clone(), out[1].clone()
                out[0].copy_(b)
                out[1].copy_(a)
        return work

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        spec = _acting("allgather", self)
        work = _done(self.inner._allgather_base(output, input, opts))
        if spec is not None and self.size() > 1:
            shards = output.view(self.size(), -1)
            a = shards[0].clone()
            shards[0].copy_(shards[1])
            shards[1].copy_(a)
        return work

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        spec = _acting("reduce_scatter", self)
        if spec is None:
            return _done(self.inner.reduce_scatter(outputs, inputs, opts))

        full = torch.stack([t.clone() for t in inputs[0]])
        work = _done(self.inner.allreduce([full]))
        outputs[0].copy_(full[_shifted(self, spec)])
        return work

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        spec = _acting("reduce_scatter", self)
        if spec is None:
            return _done(self.inner._reduce_scatter_base(output, input, opts))
        full = input.clone()
        work = _done(self.inner.allreduce([full]))
        output.copy_(full.view(self.size(), *output.shape)[_shifted(self, spec)])
        return work

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def barrier(self, opts: Any = None) -> Any:
        return _done(self.inner.barrier(opts) if opts is not None else self.inner.barrier())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.inner.recv(tensors, src, tag)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return _done(self.inner.gather(outputs, inputs, opts))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return _done(self.inner.scatter(outputs, inputs, opts))

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        return _done(self.inner.reduce(tensors, opts))

    def alltoall_base(self, *args: Any) -> Any:
        return _done(self.inner.alltoall_base(*args))

    def alltoall(self, *args: Any) -> Any:
        return _done(self.inner.alltoall(*args))


def _done(work: Any) -> Any:
    """Wait for the real collective, so a mutant changes its result before anyone reads it."""
    work.wait()
    return work


def _acting(op: str, group: Any) -> MutantSpec | None:
    """Record one call of ``op``; the spec when the planted mutant changes this call on this rank."""
    run = current_run()
    if run is None:
        return None
    spec = run.acting(op, group.rank(), group.size())
    planted = run.spec
    if spec is None and planted is not None and planted.mutant.name == "broadcast_wrong_source":
        # every rank must join a broadcast from the same source: the wrong source acts on all ranks
        if planted.mutant.op == op and run.counts[op] >= planted.start:
            return planted
    return spec


def _shifted(group: Any, spec: MutantSpec) -> int:
    """The shard a rank receives: the next rank's where the shift acts on it, its own elsewhere."""
    rank, size = group.rank(), group.size()
    shard: int = (rank + 1) % size if spec.acts_on(rank, size) else rank
    return shard


def _allreduce(group: Any, tensors: list[torch.Tensor], run: Callable[[list[torch.Tensor]], Any]) -> Any:
    """An all-reduce: the stale rank contributes an old copy, then the result is skipped or scaled."""
    spec = _acting("allreduce", group)
    name = spec.mutant.name if spec is not None else None
    mutation = current_run()
    planted = mutation.spec if mutation is not None else None
    keeps_inputs = planted is not None and planted.mutant.name == "stale_allreduce"
    own = [t.clone() for t in tensors] if name == "skip_allreduce" or keeps_inputs else []
    stale: dict[tuple[Any, ...], Any] = _state["stale"]
    if name == "stale_allreduce":
        for t, mine in zip(tensors, own, strict=True):
            old = stale.get((tuple(t.shape), t.dtype))
            t.copy_(old if old is not None else mine.new_zeros(mine.shape))
    if keeps_inputs:  # this call's input is the next call's stale copy
        stale.update(((tuple(t.shape), t.dtype), mine) for t, mine in zip(tensors, own, strict=True))
    work = _done(run(tensors))
    if name == "skip_allreduce":
        for t, mine in zip(tensors, own, strict=True):
            t.copy_(mine)
    elif name == "allreduce_sum_as_mean":
        for t in tensors:
            t.div_(group.size())
    elif name == "allreduce_mean_of_world_plus_one":
        for t in tensors:
            t.mul_(group.size() / (group.size() + 1))
    return work
