"""The accelerator-agnostic training paths on a real CUDA device (GPU machine only; not in CI).

BF16 autocast through XPUMixedPrecision on "cuda", a bf16-mixed single-device Lightning fit with
trainer_kwargs(accelerator="cuda"), and the parity recipe's single arm on the GPU in FP32 and BF16.
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
    devices: list[str] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

        def training_step(self, batch, _):  # type: ignore[no-untyped-def]
            x, y = batch
            logits = self.net(x)
            seen.append(logits.dtype)
            devices.append(self.net[0].weight.device.type)
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
    assert devices and set(devices) == {"cuda"}  # Lightning moves the model back to the CPU after fit
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, model.parameters(), strict=True))


def test_parity_recipe_single_arm_on_the_gpu(pytester: pytest.Pytester) -> None:
    # One GPU: Lightning's CUDA accelerator refuses devices=2 on it, so the distributed arms need a
    # machine with at least two GPUs; the single-device reference runs here, in FP32 and in BF16.
    pytester.makepyfile(
        """
        import math
        import pytest
        import lightning.pytorch, peft, transformers  # noqa: F401

        @pytest.mark.ranks(1)
        def test_single_arm_on_cuda(world, lora_qwen):
            assert world.device.type == "cuda"
            for precision in ("32-true", "bf16-mixed"):
                ref = lora_qwen.run("single", precision=precision)
                assert ref.device_type == "cuda" and ref.precision == precision
                print("SINGLE", precision, ref.pre_clip_norms, ref.post_clip_norms)
                assert all(math.isfinite(x) for step in ref.pre_clip_norms for x in step)
        """
    )
    result = pytester.runpytest_subprocess("-v", "-s", timeout=300)
    result.assert_outcomes(passed=1)
