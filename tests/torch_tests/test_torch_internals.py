"""Every reach of ``--torch-tests=ranks`` into ``torch.testing._internal`` (``plumbing/dependency_internals.py``),
run against the installed torch: the names exist, take the arguments we pass and mean what we read them as.
torch moves its test support every release; CI runs this with its torch (2.13.0) and ``nox -s torch-newest``
with torch 2.14.1 (docs/tested.md)."""

from __future__ import annotations

import inspect

import pytest

from pytest_sprite.plumbing import dependency_internals as internals

pytestmark = pytest.mark.cpu

common = pytest.importorskip("torch.testing._internal.common_distributed", reason="torch's test support")
dtensor = pytest.importorskip("torch.testing._internal.distributed._tensor.common_dtensor")


def test_the_multiprocess_module_and_its_rank_entry() -> None:
    assert internals.torch_multiprocess_module() is common
    params = list(inspect.signature(common.MultiProcessTestCase._run).parameters)
    assert params[:4] == ["rank", "test_name", "file_name", "parent_pipe"], params
    assert any(
        p.kind is p.VAR_KEYWORD
        for p in inspect.signature(common.MultiProcessTestCase._run).parameters.values()
    )


def test_requires_world_size_is_read_back() -> None:
    @common.requires_world_size(3)
    def test_x(self: object) -> None: ...

    assert internals.torch_required_world_size(test_x) == 3
    assert internals.torch_required_world_size(lambda: None) is None


def test_classes_torch_runs_in_its_own_process_are_told_apart() -> None:
    base = common.MultiProcessTestCase
    assert not internals.torch_multiprocess_in_process(dtensor.DTensorTestBase, base)
    assert internals.torch_multiprocess_in_process(dtensor.LocalDTensorTestBase, base)
    continuous = internals.torch_continuous_base()
    assert continuous is common.MultiProcContinuousTest
    assert not internals.torch_continuous_in_process(dtensor.DTensorContinuousTestBase, continuous)
    assert internals.torch_continuous_in_process(dtensor.LocalDTensorContinuousTestBase, continuous)


def test_a_continuous_class_world_and_its_worker_entries() -> None:
    class FourRanks(dtensor.DTensorContinuousTestBase):  # type: ignore[misc]
        world_size = 4

    assert internals.torch_continuous_world_size(FourRanks) == 4
    for name in ("_init_pg", "_run_test_given_id"):
        assert isinstance(inspect.getattr_static(common.MultiProcContinuousTest, name), classmethod), name
    assert list(inspect.signature(common.MultiProcContinuousTest._init_pg).parameters) == [
        "rank",
        "world_size",
        "rdvz_file",
    ]
