"""The real backend ``--sprite-mutate``'s group wraps: gloo for real, nccl and xccl through fakes."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.distributed as dist

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing import dependency_internals, mutants
from pytest_sprite.rank import mutant_backend
from pytest_sprite.rank.mutant_backend import INNER_BACKENDS, MutantProcessGroup, _create, called_ops, install

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def fresh_mutation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mutation run of this test only; torch's functional collectives are not routed for the session."""
    monkeypatch.setattr(mutants, "_RUN", [])
    monkeypatch.setattr(dependency_internals, "route_functional_collectives", lambda: True)
    for key in ("stale", "inner", "registered"):
        monkeypatch.setitem(mutant_backend._state, key, mutant_backend._state[key])
    monkeypatch.setitem(mutant_backend._state, "registered", False)


def test_torch_names_the_devices_and_type_of_every_backend_in_the_table() -> None:
    assert list(INNER_BACKENDS) == ["gloo", "nccl", "xccl", "mpi"]
    for name in INNER_BACKENDS:
        assert dist.Backend.backend_capability[name], name
        assert dist.Backend.backend_type_map[name].name == name.upper()
    assert dist.Backend.backend_capability["gloo"][0] == "cpu"


@pytest.mark.parametrize(
    ("mutant", "expected"), [(None, [1.0, 2.0, 3.0]), ("allreduce_mean_of_world_plus_one", [0.5, 1.0, 1.5])]
)
def test_a_one_rank_group_runs_over_a_real_gloo_backend(mutant: str | None, expected: list[float]) -> None:
    backend = install(mutant, "gloo")
    assert dist.Backend.backend_capability[backend] == ["cpu", "cuda", "xpu"]
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        group: Any = dist.group.WORLD
        assert isinstance(group, MutantProcessGroup)
        assert isinstance(group.inner, dist.ProcessGroupGloo)
        assert dist.get_backend() == backend
        assert sorted(device.type for device in group._device_types) == ["cpu", "cuda"]
        tensor = torch.tensor([1.0, 2.0, 3.0])
        dist.all_reduce(tensor)
        assert tensor.tolist() == expected
        assert called_ops() == ["allreduce"]
    finally:
        dist.destroy_process_group()


def _options() -> Any:
    """What torch hands a registered backend's creator (``_DistributedBackendOptions``)."""
    return SimpleNamespace(
        store=object(),
        group_rank=1,
        group_size=4,
        timeout=timedelta(seconds=77),
        group_id="7",
        global_ranks_in_group=[0, 1, 2, 3],
    )


def _fake_backend(made: list[dict[str, Any]]) -> type:
    class FakeBackend:
        """Records what it is made with, as ``ProcessGroupNCCL`` / ``ProcessGroupXCCL`` take it."""

        class Options:
            _timeout: Any = None

        def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
            made.append(
                {
                    "store": store,
                    "rank": rank,
                    "size": size,
                    "timeout": options._timeout,
                    "ranks": options.global_ranks_in_group,
                    "name": options.group_name,
                }
            )

    return FakeBackend


@pytest.mark.parametrize(
    ("name", "cls", "device", "backend_type"),
    [("nccl", "ProcessGroupNCCL", "cuda", "NCCL"), ("xccl", "ProcessGroupXCCL", "xpu", "XCCL")],
)
def test_an_accelerator_backend_is_made_with_the_groups_store_rank_size_and_timeout(
    monkeypatch: pytest.MonkeyPatch, name: str, cls: str, device: str, backend_type: str
) -> None:
    made: list[dict[str, Any]] = []
    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(dist, cls, _fake_backend(made), raising=False)
    monkeypatch.setattr(dist, f"is_{name}_available", lambda: True)

    def register(group: Any, backend: Any, devices: Any, kind: str) -> bool:
        registered.append((group, backend, tuple(devices), kind))
        return True

    monkeypatch.setattr(dependency_internals, "process_group_device_backend", register)
    assert install(None, name) == mutant_backend.BACKEND_NAME
    options = _options()
    group = _create(options, None)

    assert made == [
        {
            "store": options.store,
            "rank": 1,
            "size": 4,
            "timeout": timedelta(seconds=77),
            "ranks": [0, 1, 2, 3],
            "name": "7",
        }
    ]
    assert isinstance(group, MutantProcessGroup)
    assert (group.rank(), group.size(), group.getGroupDesc()) == (1, 4, f"sprite_mutant over {name}")
    assert registered == [(group, group.inner, (device,), backend_type)]


@pytest.mark.parametrize("name", ["ucc", "bogus"])
def test_a_backend_the_wrapper_does_not_know_is_refused_by_name(name: str) -> None:
    with pytest.raises(SpriteUsageError) as refused:
        install(None, name)
    message = str(refused.value)
    assert f"uses {name!r}" in message
    assert "--sprite-mutate wraps gloo, nccl, xccl and mpi" in message
    assert "leave --sprite-mutate off" in message
    assert mutant_backend._state["registered"] is False


def test_a_backend_this_torch_lacks_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(SpriteUsageError) as refused:
        install(None, "nccl")
    message = str(refused.value)
    assert "'nccl'" in message
    assert f"torch build ({torch.__version__}) has none" in message
    assert "--sprite-device=cpu" in message
    assert "leave --sprite-mutate off" in message


def test_the_real_backend_is_registered_for_each_device_it_serves() -> None:
    store = dist.HashStore()
    inner = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    group = MutantProcessGroup(inner, 0, 1, "registered")
    assert dependency_internals.process_group_device_backend(group, inner, ("cpu", "cuda"), "GLOO")
    assert sorted(device.type for device in group._device_types) == ["cpu", "cuda"]
    assert group._get_backend(torch.device("cpu")) is not None


def test_backend_options_take_the_timeout_on_this_release() -> None:
    """NCCL's and XCCL's options share ``Backend.Options`` with gloo's, which a CPU build has."""
    options = dist.ProcessGroupGloo._Options()
    assert dependency_internals.backend_options_timeout(options, timedelta(seconds=5))
    assert options._timeout == timedelta(seconds=5)
    assert not dependency_internals.backend_options_timeout(object(), timedelta(seconds=5))
