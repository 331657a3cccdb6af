"""The harness on a real CUDA device (run on a GPU machine; not in CI): device tensors over gloo and nccl."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_ranks_use_the_gpu_with_the_right_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_two_ranks_share_one_gpu_over_gloo(world):
            shared = torch.cuda.device_count() < 2
            assert world.device.type == "cuda"
            assert world.backend == ("gloo" if shared else "nccl")
            t = torch.full((1024,), float(world.rank + 1), device=world.device)
            dist.all_reduce(t)
            assert t.device.type == "cuda" and t[0].item() == 3.0
            gathered = world.gather(torch.arange(3, device=world.device) + world.rank)
            assert [g.tolist() for g in gathered] == [[0, 1, 2], [1, 2, 3]]
            world.collect("on_gpu", t[:2])

        @pytest.mark.ranks(1)
        def test_one_rank_per_gpu_uses_nccl(world):
            assert world.backend == "nccl" and dist.get_backend() == "nccl"
            t = torch.ones(8, device=world.device)
            dist.all_reduce(t)
            assert t.sum().item() == 8.0
        """
    )
    result = pytester.runpytest_subprocess("-v", timeout=300)
    result.assert_outcomes(passed=2)
