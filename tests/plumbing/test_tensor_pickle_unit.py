"""``plumbing/tensor_pickle.py``: plain CPU tensors travel as their bytes and come back bit for bit; anything else
travels as torch pickles it."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from pytest_sprite.plumbing.tensor_pickle import dumps, rebuild_tensor

pytestmark = pytest.mark.cpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().resolve_conj().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


PLAIN = {
    "float32": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
    "bfloat16": torch.randn(5, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "float8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
    "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    "bool, 0-dim": torch.tensor(True),
    "int64": torch.arange(7),
    "empty": torch.empty(0, 5),
    "strided view": torch.arange(20.0).reshape(4, 5).t()[1:, ::2],
}


@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_cpu_tensor_travels_as_its_bytes_and_comes_back_bit_for_bit(name: str) -> None:
    tensor = PLAIN[name]
    data = dumps({"record": [tensor]})

    back = pickle.loads(data)["record"][0]

    assert b"pytest_sprite.plumbing.tensor_pickle" in data and b"torch._utils" not in data
    assert type(back) is torch.Tensor and back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(_bits(back), _bits(tensor))


def test_what_is_not_a_plain_cpu_tensor_travels_as_torch_pickles_it() -> None:
    noted = torch.ones(2)
    noted.note = "kept"  # type: ignore[attr-defined]
    others = {
        "grad": torch.ones(2, requires_grad=True),
        "conjugate": torch.ones(2, dtype=torch.complex64).conj(),
        "sparse": torch.eye(3).to_sparse(),
        "noted": noted,
    }
    for name, tensor in others.items():
        data = dumps(tensor)

        back = pickle.loads(data)

        assert b"torch._" in data[:40], name  # torch's own reduction on the outside
        assert type(back) is type(tensor) and back.requires_grad == tensor.requires_grad, name
        assert back.is_conj() == tensor.is_conj() and back.layout == tensor.layout, name
        assert torch.equal(back.detach().resolve_conj().to_dense(), tensor.detach().resolve_conj().to_dense())
    assert pickle.loads(dumps(noted)).note == "kept"
    parameter = pickle.loads(dumps(torch.nn.Parameter(torch.ones(2))))  # torch's reduction, its data as bytes
    assert type(parameter) is torch.nn.Parameter and parameter.requires_grad


def test_the_rebuilt_tensor_owns_writable_memory() -> None:
    back = rebuild_tensor(torch.arange(3, dtype=torch.int32).numpy().tobytes(), torch.int32, (3,))

    back += 1

    assert back.tolist() == [1, 2, 3]


def test_importing_it_imports_no_torch() -> None:
    code = "import sys, pytest_sprite.plumbing.tensor_pickle as t; t.dumps({'a': 1}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
