"""The accelerator-agnostic training paths on a real CUDA device (GPU machine only; not in CI).

BF16 autocast through XPUMixedPrecision on "cuda", a bf16-mixed single-device Lightning fit with
trainer_kwargs(accelerator="cuda"), and the FP32 parity recipe's single arm on the GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_bf16_autocast_on_cuda_gives_bf16_linear_outputs_with_fp32_weights() -> None:
    from pytest_sprite.lightning import XPUMixedPrecision

    plugin = XPUMixedPrecision("bf16-mixed", device="cuda")
    linear = torch.nn.Linear(16, 16).cuda()
    with plugin.forward_context():
        out = linear(torch.randn(4, 16, device="cuda"))
    assert out.dtype == torch.bfloat16
    assert linear.weight.dtype == torch.float32
    assert out.device.type == "cuda"


def test_bf16_single_device_fit_on_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import lightning as L

    from pytest_sprite.lightning import trainer_kwargs

    seen: list[torch.dtype] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

        def training_step(self, batch, _):  # type: ignore[no-untyped-def]
            x, y = batch
            logits = self.net(x)
            seen.append(logits.dtype)
            return torch.nn.functional.cross_entropy(logits.float(), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randint(0, 2, (64,)))
    model = Model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(
        **trainer_kwargs("single", devices=1, precision="bf16-mixed", accelerator="cuda"),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
    assert seen and all(dtype == torch.bfloat16 for dtype in seen)
    assert next(model.parameters()).device.type == "cuda"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, model.parameters(), strict=True))


def test_parity_recipe_on_the_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import lightning.pytorch, peft, transformers  # noqa: F401
        from pytest_sprite.assertions import assert_parity, expect_fault_rejected

        @pytest.mark.ranks(2)
        def test_single_and_ddp_on_cuda_over_gloo(world, lora_qwen):
            assert world.device.type == "cuda"
            ref = lora_qwen.run("single")
            assert ref.device_type == "cuda"
            result = assert_parity(ref, lora_qwen.run("ddp"))
            print("PARITY", result)
            with expect_fault_rejected("wrong-scale"):
                assert_parity(ref, lora_qwen.run("ddp", fault="wrong-scale"))
        """
    )
    result = pytester.runpytest_subprocess("-v", "-s", timeout=500)
    result.assert_outcomes(passed=1)
