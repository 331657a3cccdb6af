"""Every reach into a private name of hypothesis, torch, transformers or coverage, in one file.

The plugin uses only public APIs, except where none exists; each such use lives here, says which
private name it touches, why no public API serves, and which versions it is tested with
(``tests/project/test_private_apis.py`` runs every function against the installed, newest release).
Each is gated: when the name is absent (a release that removed it), a documented fallback runs
instead of an ``AttributeError``. pytest's own private names are in ``glue/pytest_internals.py``; the
code under test keeps Lightning's in ``pytest_sprite/lightning/_internals.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "backend_options_timeout",
    "coverage_config_data",
    "coverage_from_config_data",
    "ddp_comm_hook_names",
    "ddp_ignore_parameters",
    "ddp_logging_data",
    "device_stand_in",
    "fsdp_mixed_precision",
    "functional_collectives_routed",
    "hf_no_split_modules",
    "hypothesis_explicit_seed",
    "hypothesis_test_settings",
    "prewarm_hypothesis_patching",
    "process_group_device_backend",
    "replace_distributed_pdb",
    "replace_hypothesis_settings",
    "route_functional_collectives",
    "torch_continuous_base",
    "torch_continuous_in_process",
    "torch_continuous_init",
    "torch_continuous_run",
    "torch_continuous_world_size",
    "torch_multiprocess_in_process",
    "torch_multiprocess_module",
    "torch_required_world_size",
    "torch_run_rank",
]

_HYPOTHESIS_SETTINGS = "_hypothesis_internal_use_settings"
_HYPOTHESIS_SEED = "_hypothesis_internal_use_seed"


def hypothesis_test_settings(test: Any) -> Any:
    """The settings a ``@given`` test runs with.

    Hypothesis (6.x, tested 6.100 - 6.170) keeps them on the test as ``_hypothesis_internal_use_settings``
    and offers no public reader. Fallback: ``settings.default``, what an undecorated test runs with.
    """
    from hypothesis import settings

    return getattr(test, _HYPOTHESIS_SETTINGS, None) or settings.default


def replace_hypothesis_settings(test: Any, new: Any) -> bool:
    """Make the ``@given`` test ``test`` run with ``new``; False when this hypothesis gives no way to.

    The public ``@settings`` decorator refuses a test that already has settings ("applying @settings
    twice"), and a ranks test must turn off the per-rank clock checks of a test that set its own.
    Hypothesis 6.x reads ``_hypothesis_internal_use_settings`` from the test when it runs; without that
    name, the fallback is the public decorator, which serves tests without settings of their own.
    """
    from hypothesis.errors import InvalidArgument

    if hasattr(test, _HYPOTHESIS_SETTINGS):
        setattr(test, _HYPOTHESIS_SETTINGS, new)
        return True
    try:
        new(test)
    except InvalidArgument:
        return False
    return True


def hypothesis_explicit_seed(test: Any) -> object | None:
    """The hypothesis seed a test pinned with ``@hypothesis.seed(...)``, else None.

    Read from ``_hypothesis_internal_use_seed`` (hypothesis 6.x), where ``@seed`` puts it; there is no
    public reader. Fallback: None, so the harness pins its own seed (every rank still draws alike).
    """
    return getattr(test, _HYPOTHESIS_SEED, None)


_COVERAGE_CONFIG_DATA = ":data:"
"""What coverage (7.10.4+) puts before a serialized configuration given as ``config_file`` (``CONFIG_DATA_PREFIX``)."""


def coverage_config_data(cov: Any, *, data_file: str) -> str | None:
    """``cov``'s whole configuration, changed to write one data file per process under ``data_file``.

    A rank of a session measured into one data file (``coverage run`` without ``parallel = True``) must
    write a file of its own, measuring what the session measures. coverage 7.10.4 - 7.18 hands a
    configuration to the processes it starts itself as ``CoverageConfig.serialize()`` (read back from
    ``COVERAGE_PROCESS_CONFIG`` by ``coverage.process_startup``); the format is not documented and no public
    API copies a running configuration. Fallback: None (older coverage): such ranks are not measured.
    """
    config = cov.config
    serialize = getattr(config, "serialize", None)
    deserialize = getattr(type(config), "deserialize", None)
    if serialize is None or deserialize is None:
        return None
    copy = deserialize(serialize())
    copy.parallel = True
    copy.data_file = data_file
    return str(copy.serialize())


def coverage_from_config_data(data: str) -> Any:
    """A new ``coverage.Coverage`` (not started) with the configuration :func:`coverage_config_data` made.

    coverage 7.10.4 - 7.18 takes a serialized configuration as ``config_file=":data:" + data`` (what its own
    ``patch = fork`` does in a forked process); only called with data that function returned, so on those
    releases.
    """
    import coverage

    prefix = getattr(coverage.control, "CONFIG_DATA_PREFIX", _COVERAGE_CONFIG_DATA)
    return coverage.Coverage(config_file=prefix + data, data_suffix=True)


def ddp_comm_hook_names(ddp: Any) -> list[str]:
    """The names of the communication hooks registered on a ``DistributedDataParallel`` module.

    torch (2.6 - 2.13) keeps them in ``DistributedDataParallel._comm_hooks`` as ``(hook, state)`` pairs
    and has no public getter. Fallback: an empty list (the record then names no hook).
    """
    hooks = getattr(ddp, "_comm_hooks", None) or []
    return [getattr(hook, "__name__", repr(hook)) for hook, _ in hooks]


def hf_no_split_modules(module: Any) -> tuple[str, ...]:
    """The block class names a Hugging Face model declares as its unsplittable units.

    ``PreTrainedModel._no_split_modules`` (transformers 4.45 - 5.x) is what accelerate and PEFT read
    to place and shard models; there is no public accessor. Fallback: none declared.
    """
    return tuple(getattr(module, "_no_split_modules", None) or ())


def ddp_ignore_parameters(module: Any, names: list[str]) -> None:
    """Make DDP leave the parameters ``names`` of ``module`` out of its gradient all-reduce.

    Planting the ``local-adapter`` fault needs a trainable parameter that DDP does not synchronize;
    torch (2.6 - 2.13) does this only through the static
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (what FSDP and torchrec use).
    No fallback can plant that fault without it, so a torch without it gets a clear error.
    """
    from torch.nn.parallel import DistributedDataParallel

    ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is None:
        import torch

        raise RuntimeError(
            f"torch {torch.__version__} has no DistributedDataParallel._set_params_and_buffers_to_ignore_"
            "for_model: the local-adapter fault cannot be planted; use torch 2.6 - 2.13"
        )
    ignore(module, names)


def prewarm_hypothesis_patching() -> None:
    """Import what hypothesis imports when a test fails (``hypothesis.extra._patching``), ahead of time.

    Done in the rank agent before it forks children, so a failing child does not spend seconds
    importing it while its peers wait. A hypothesis without that module needs no pre-warming.
    """
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:
        pass


def ddp_logging_data(ddp: Any) -> dict[str, Any]:
    """What a ``DistributedDataParallel`` module reports about itself (its reducer's dtypes among it).

    torch (2.6 - 2.13) exposes it only as ``DistributedDataParallel._get_ddp_logging_data()``, the
    data of its usage logger. Fallback: an empty dict (the record then names no reducer dtype).
    """
    get = getattr(ddp, "_get_ddp_logging_data", None)
    return dict(get()) if get is not None else {}


def fsdp_mixed_precision(module: Any) -> Any:
    """The mixed-precision policy of a ``fully_shard`` module (``param_dtype``, ``reduce_dtype``), or None.

    torch (2.6 - 2.13) keeps it on the module's private state, ``_get_fsdp_state()._mp_policy``; no public
    getter exists. Fallback: None (the record then names no FSDP dtypes).
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    return getattr(get_state(), "_mp_policy", None) if get_state is not None else None


def replace_distributed_pdb(make: Any) -> bool:
    """Make ``torch.distributed.breakpoint()`` stop in the debugger ``make()`` returns; False where it cannot.

    torch makes its pdb with the private module function ``torch.distributed._make_distributed_pdb`` (torch
    2.2 - 2.13), which reads ``/dev/stdin``: a test child has none. Only a process that has imported
    ``torch.distributed`` is changed (a test child imports it before its test). Fallback: nothing changes,
    and ``dist.breakpoint()`` reads the child's empty stdin and quits.
    """
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not callable(getattr(dist, "_make_distributed_pdb", None)):
        return False
    setattr(dist, "_make_distributed_pdb", make)  # noqa: B010 (a private name: mypy knows no such attribute)
    return True


TORCH_COMMON_DISTRIBUTED = "torch.testing._internal.common_distributed"
"""torch's test-support module of ``MultiProcessTestCase``, ``TEST_SKIPS`` and ``get_timeout``."""


def torch_multiprocess_module() -> Any | None:
    """``torch.testing._internal.common_distributed``, once a test module imported it; else None.

    torch ships its multiprocess test classes only there (tested with torch 2.13 and 2.14.1);
    ``--torch-tests=ranks`` looks it up in ``sys.modules`` so that nothing imports torch for a session without
    such tests. Fallback: None, and no test is taken for a torch test.
    """
    import sys

    return sys.modules.get(TORCH_COMMON_DISTRIBUTED)


def torch_required_world_size(method: Any) -> int | None:
    """The ``n`` of torch's ``@requires_world_size(n)`` on a test method, else None.

    The decorator stores it as ``_required_world_size`` (torch 2.13, 2.14.1) and torch reads it back with
    ``get_required_world_size``, which needs an instance; this reads the attribute. Fallback: None (the
    class's ``world_size``).
    """
    value = getattr(method, "_required_world_size", None)
    return None if value is None else int(value)


def torch_run_rank(cls: Any, rank: int, test_name: str, file_name: str, pipe: Any, *, fake_pg: bool) -> None:
    """What torch's spawned process ``rank`` runs: the class's ``_run`` (a classmethod subclasses override).

    ``MultiProcessTestCase._start_processes`` targets ``cls._run(rank, test_name, file_name, pipe,
    fake_pg=...)``; there is no public entry (torch 2.6 - 2.14.1). It ends with ``sys.exit`` or returns.
    """
    cls._run(rank, test_name, file_name, pipe, fake_pg=fake_pg)


def torch_multiprocess_in_process(cls: Any, base: type) -> bool:
    """True for a ``MultiProcessTestCase`` subclass whose tests torch runs in its own process, spawning none.

    ``LocalDTensorTestBase`` (torch 2.9 - 2.14.1) overrides ``join_or_run`` to call the test in the parent
    (with a ``LocalTensorMode`` for every rank) and ``_spawn_processes`` to do nothing; run per rank it
    would mean something else. Fallback: False when the class has no ``join_or_run``.
    """
    own = getattr(cls, "join_or_run", None)
    return own is not None and own is not getattr(base, "join_or_run", None)


def torch_continuous_base() -> type | None:
    """torch's ``MultiProcContinuousTest`` (one world per class), once a test module imported its module; else None.

    Public name in torch's test-support module (torch 2.7 - 2.14.1). Fallback: None, and no class is taken
    for a class-world test.
    """
    base = getattr(torch_multiprocess_module(), "MultiProcContinuousTest", None)
    return base if isinstance(base, type) else None


def torch_continuous_in_process(cls: Any, base: type) -> bool:
    """True for a ``MultiProcContinuousTest`` subclass that runs its tests in torch's own process.

    ``LocalDTensorContinuousTestBase`` (torch 2.10 - 2.14.1) overrides the private classmethod
    ``_ensure_processes_spawned`` to make a fake group in the parent instead of spawning workers.
    Fallback: False when the name is absent.
    """
    own = getattr(cls, "_ensure_processes_spawned", None)
    theirs = getattr(base, "_ensure_processes_spawned", None)
    return own is not None and getattr(own, "__func__", own) is not getattr(theirs, "__func__", theirs)


def torch_continuous_world_size(cls: Any) -> int:
    """The world size torch's ``MultiProcContinuousTest`` spawns for ``cls``, as its ``_ensure_processes_spawned``
    decides it (torch 2.10 - 2.14.1): the class's ``device_type`` (a classmethod, a property read on the
    class, or a string ``instantiate_device_type_tests`` set), then the private
    ``_get_world_size(device_type)`` (the class's ``world_size``; unset: the device count). Raises ``unittest.SkipTest`` as torch does: no
    device, or a backend that is not available. Fallback without ``_get_world_size``: the class's ``world_size``.
    """
    import unittest

    attr = cls.__dict__.get("device_type", getattr(cls, "device_type", None))
    if isinstance(attr, classmethod):
        device_type = attr.__func__(cls)
    elif isinstance(attr, property):
        device_type = attr.fget(cls) if attr.fget is not None else "cpu"
    elif callable(attr):
        device_type = attr()
    else:
        device_type = attr
    get_world_size = getattr(cls, "_get_world_size", None)
    size = int(get_world_size(device_type) if get_world_size is not None else cls.world_size)
    backend_str = getattr(cls, "backend_str", None)
    backend = backend_str() if callable(backend_str) else backend_str
    if backend is not None:
        import torch.distributed as dist

        check = getattr(dist, f"is_{backend}_available", None)
        if callable(check) and not check():
            raise unittest.SkipTest(f"Backend '{backend}' is not available")
    return size


def torch_continuous_init(cls: Any, rank: int, world_size: int, rdvz_file: str) -> None:
    """What a ``MultiProcContinuousTest`` worker does before its first test (``_worker_loop``, torch 2.7 -
    2.14.1): set the class's ``rank`` and ``world_size``, then the private classmethod
    ``_init_pg(rank, world_size, rdvz_file)`` (subclasses override it: ``DTensorContinuousTestBase`` picks the device first). No public
    entry. May raise ``SystemExit`` with one of torch's skip codes, as natively.
    """
    cls.rank = rank
    cls.world_size = world_size
    cls._init_pg(rank, world_size, rdvz_file)


def torch_continuous_run(cls: Any, test_id: str) -> None:
    """What a ``MultiProcContinuousTest`` worker does for each test it is sent: the private classmethod
    ``_run_test_given_id(test_id)`` (a fresh instance with the class's rank and world size, torch's seed,
    the method; torch 2.7 - 2.14.1). No public entry.
    """
    cls._run_test_given_id(test_id)


def process_group_device_backend(group: Any, backend: Any, devices: Iterable[str], backend_type: str) -> bool:
    """Give the Python process group ``group`` the real ``backend`` for tensors on ``devices``; False where
    torch cannot. ``backend_type`` names its ``ProcessGroup.BackendType`` member (``GLOO``, ``NCCL``, ...).

    ``--sprite-mutate``'s group is a ``ProcessGroup`` made in Python: torch's own Python and C++ callers reach
    its methods, but the functional collectives (DTensor's redistributions) dispatch to the group's backend for
    the tensor's device, which a Python group has none of, and the object collectives and barrier pick their
    device from the devices a group has backends for. torch 2.13 offers only the private
    ``ProcessGroup._register_backend(device, type, backend)`` for that (``init_process_group`` uses it).
    Fallback: none registered; those collectives then fail with torch's "No backend type associated" error.
    """
    import torch
    import torch.distributed as dist

    register = getattr(group, "_register_backend", None)
    if register is None:
        return False
    for device in devices:
        register(torch.device(device), getattr(dist.ProcessGroup.BackendType, backend_type), backend)
    return True


def device_stand_in(rank: int, size: int) -> Any | None:
    """A backend that stands for a Python process group's devices and is never called: torch's
    ``FakeProcessGroup`` (the private ``torch._C._distributed_c10d.FakeProcessGroup._create_internal``, torch
    2.13; the public ``fake`` backend makes only whole groups of its own).

    A dry world's group (``subworld/dry_world.py``) answers every collective itself, but what picks a device
    from a group's backends (object collectives, ``barrier``) finds none on a Python group without one.
    Fallback: None; those then fail in a dry world with torch's "No backend type associated" error, and a
    rehearsal that reaches them ends there (the real fit is unaffected).
    """
    import torch

    fake = getattr(torch._C._distributed_c10d, "FakeProcessGroup", None)
    create = getattr(fake, "_create_internal", None)
    if create is None:
        return None
    return create(rank, size)


def backend_options_timeout(options: Any, timeout: Any) -> bool:
    """Set the timeout of a backend's ``options`` (``ProcessGroupNCCL.Options``, ``ProcessGroupXCCL.Options``)
    before the backend is made with them; False where torch offers no way to.

    Those options take no timeout when made, and torch 2.13 exposes it only as the private ``_timeout``
    property, which ``init_process_group`` sets the same way. Fallback: the backend's own default timeout
    (10 minutes for NCCL): a hung collective under ``--sprite-mutate`` then waits that long, not the test's.
    """
    if not hasattr(options, "_timeout"):
        return False
    options._timeout = timeout
    return True


_FUNCTIONAL_OPS = "_c10d_functional"
_functional_library: list[Any] = []
"""The ``torch.library.Library`` that routes the functional collectives, kept alive once made."""


def route_functional_collectives() -> bool:
    """Send torch's functional all-gather and reduce-scatter of CPU tensors through their group's methods.

    DTensor's ``Shard`` to ``Replicate`` and ``Partial`` to ``Shard`` redistributions call the ops of torch's
    private ``_c10d_functional`` namespace, whose C++ kernels go straight to the group's backend for the
    tensor's device: a ``ProcessGroup`` made in Python (``--sprite-mutate``'s) never sees them. The public
    ``torch.library`` registers a CPU kernel for those ops that resolves the group by name (the private
    ``distributed_c10d._resolve_process_group``) and calls its ``_allgather_base`` / ``_reduce_scatter_base``
    and waits, so the Python group records and mutates them like its other collectives. Tested with torch
    2.13. Fallback (a release without those names): nothing is routed, False; those redistributions then
    reach the real backend unrecorded and their mutants are reported not applicable.
    """
    if _functional_library:
        return True
    library = _functional_routing(all_reduce=False)
    if library is None:
        return False
    _functional_library.append(library)
    return True


@contextlib.contextmanager
def functional_collectives_routed() -> Iterator[bool]:
    """Inside, every functional collective of CPU tensors (all-reduce too) goes through its group's methods,
    as :func:`route_functional_collectives` routes some for good; on the way out torch's own kernels are back.

    A dry world's Python group (``subworld/dry_world.py``) answers them itself. Undoing a registration takes
    the private ``Library._destroy()`` (torch 2.13; public: only the library's garbage collection, whose
    time is not the caller's). Yields False, routing nothing, where torch lacks the names.
    """
    if _functional_library:  # routed for good in this process already: leave it so
        yield False
        return
    library = _functional_routing(all_reduce=True)
    try:
        yield library is not None
    finally:
        destroy = getattr(library, "_destroy", None)
        if callable(destroy):
            destroy()


def _functional_routing(*, all_reduce: bool) -> Any | None:
    """A ``torch.library.Library`` whose CPU kernels route the functional collectives; None where torch
    lacks the names this needs."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    resolve = getattr(c10d, "_resolve_process_group", None)
    options = getattr(torch._C._distributed_c10d, "AllgatherOptions", None)
    if resolve is None or options is None or not hasattr(torch.ops, _FUNCTIONAL_OPS):
        return None

    def gather(tensor: Any, group_size: int, group_name: str) -> Any:
        out = tensor.new_empty((group_size * tensor.shape[0], *tensor.shape[1:]))
        resolve(group_name)._allgather_base(out, tensor.contiguous(), options()).wait()
        return out

    def scatter(tensor: Any, reduce_op: str, group_size: int, group_name: str) -> Any:
        out = tensor.new_empty((tensor.shape[0] // group_size, *tensor.shape[1:]))
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, reduce_op.upper())
        resolve(group_name)._reduce_scatter_base(out, tensor.contiguous(), opts).wait()
        return out

    def reduce_(tensor: Any, reduce_op: str, group_name: str) -> Any:
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, reduce_op.upper())
        resolve(group_name).allreduce([tensor], opts).wait()
        return tensor

    def reduce(tensor: Any, reduce_op: str, group_name: str) -> Any:
        return reduce_(tensor.clone(memory_format=torch.contiguous_format), reduce_op, group_name)

    def each(one: Any) -> Any:  # a coalesced op: the single one over its tensors
        return lambda tensors, *rest: [one(t, *rest) for t in tensors]

    library: Any = torch.library.Library(_FUNCTIONAL_OPS, "IMPL")  # type: ignore[no-untyped-call]
    kernels: dict[str, Any] = {
        "all_gather_into_tensor": gather,
        "all_gather_into_tensor_coalesced": each(gather),
        "reduce_scatter_tensor": scatter,
        "reduce_scatter_tensor_coalesced": each(scatter),
    }
    if all_reduce:
        kernels |= {
            "all_reduce": reduce,
            "all_reduce_": reduce_,
            "all_reduce_coalesced": each(reduce),
            "all_reduce_coalesced_": each(reduce_),
        }
    for name, kernel in kernels.items():
        library.impl(name, kernel, "CPU")
    return library
