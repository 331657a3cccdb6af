"""The recipe's model and rows; imports torch, transformers and peft, so it is loaded only when a recipe runs."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peft
import torch
from transformers import Qwen2Config, Qwen2Model

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.options import QWEN_PATH_ENV
from pytest_sprite.plumbing.dependency_internals import hf_no_split_modules
from pytest_sprite.recipes.constants import LORA_B_SEED, LORA_B_STD, LORA_CONFIG, NUM_CLASSES, TINY_QWEN2

__all__ = [
    "LoraQwenClassifier",
    "Rows",
    "build_lora_qwen",
    "fresh_lora_qwen",
    "keep_spare_lora_qwen",
    "lora_qwen_identity",
    "lora_qwen_vocab",
    "make_rows",
]


class LoraQwenClassifier(torch.nn.Module):
    """PEFT-wrapped Qwen2 backbone plus a linear head on the last token's hidden state.

    ``_no_split_modules`` is the backbone's, so ``shard_model`` shards each decoder layer and then this root,
    which also puts the head under ``fully_shard``.
    """

    def __init__(self, backbone: Any, hidden_size: int, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, num_classes)
        self._no_split_modules = list(hf_no_split_modules(backbone.get_base_model()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape (rows, 2) from the last position (rows have no padding)."""
        hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        logits: torch.Tensor = self.head(hidden[:, -1, :])
        return logits

    backbone_name = "backbone"
    """The module the fp32-backbone fault runs without autocast: everything but the head."""

    def linear_sites(self) -> dict[str, str]:
        """Every Linear module by name, with what it is: ``backbone``, ``lora_A``, ``lora_B`` or ``head``.

        These are the sites the BF16 arms check for BF16 outputs, FP32 weights and autocast at every step
        (361 on Qwen2.5-0.5B: per layer q/k/v/o, their LoRA A and B, and the MLP's three; plus the head).
        """
        sites: dict[str, str] = {}
        for name, module in self.named_modules():
            if isinstance(module, torch.nn.Linear):
                if name == "head":
                    sites[name] = "head"
                elif ".lora_A." in f"{name}.":
                    sites[name] = "lora_A"
                elif ".lora_B." in f"{name}.":
                    sites[name] = "lora_B"
                else:
                    sites[name] = "backbone"
        return sites

    def adapter_tensors(self) -> tuple[str, ...]:
        """The LoRA tensors (trainable parameter names), lora_A and lora_B in parameter order."""
        return tuple(n for n, p in self.named_parameters() if p.requires_grad and ".lora_" in n)

    @property
    def vocab_size(self) -> int:
        """The backbone's vocabulary size (range of the row tokens)."""
        return int(self.backbone.get_base_model().config.vocab_size)


@dataclass(frozen=True, kw_only=True, eq=False)
class Rows:
    """The whole run's rows: row ``i`` is ``(input_ids[i], labels[i])``; step ``s`` trains rows ``s*B .. s*B+B-1``."""

    input_ids: torch.Tensor
    """int64 token ids, shape (rows, seq_len)."""
    labels: torch.Tensor
    """int64 class labels in {0, 1}, shape (rows,)."""
    digest: str
    """SHA-256 over tokens and labels."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"row": i, "input_ids": self.input_ids[i], "labels": self.labels[i]}


def make_rows(*, seed: int, rows: int, seq_len: int, vocab_size: int) -> Rows:
    """Seeded rows: tokens uniform over the vocabulary, labels uniform in {0, 1}, both int64."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (rows, seq_len), generator=gen, dtype=torch.int64)
    labels = torch.randint(0, NUM_CLASSES, (rows,), generator=gen, dtype=torch.int64)
    h = hashlib.sha256()
    h.update(input_ids.numpy().tobytes())
    h.update(labels.numpy().tobytes())
    return Rows(input_ids=input_ids, labels=labels, digest=h.hexdigest())


def build_lora_qwen(
    *, seed: int, qwen_path: str | os.PathLike[str] | None = None
) -> tuple[LoraQwenClassifier, str]:
    """Build the classifier on CPU in FP32 with seeded weights; return it and its model identity string.

    The global RNG state is left as it was, so building the model does not shift a test's own randomness.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if qwen_path is None:
            config = Qwen2Config(**TINY_QWEN2)
            backbone = Qwen2Model(config)
            where = "tiny-qwen2"
        else:
            path = Path(qwen_path)
            if not (path / "config.json").is_file():
                raise SpriteUsageError(
                    f"--qwen-path / {QWEN_PATH_ENV}: {str(qwen_path)!r} is not a model directory (no config.json); "
                    "pass a directory written by save_pretrained (for example a Qwen2.5-0.5B download), "
                    "or leave it unset for the tiny in-memory model"
                )
            backbone = Qwen2Model.from_pretrained(path, dtype=torch.float32, local_files_only=True)
            config = backbone.config
            where = str(path.resolve())
        # transformers wraps PreTrainedModel.to in a decorator whose type mypy reads as taking a model.
        backbone = backbone.to(torch.float32)  # type: ignore[arg-type]
        with warnings.catch_warnings():
            # peft 0.21's PeftModel reads transformers 5's deprecated ``is_gradient_checkpointing``
            # (huggingface/peft): upstream's to change, not ours to avoid.
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            adapted = peft.get_peft_model(backbone, peft.LoraConfig(**LORA_CONFIG))
        model = LoraQwenClassifier(adapted, config.hidden_size)
    gen = torch.Generator().manual_seed(LORA_B_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * LORA_B_STD)
    model.train()
    config_json = json.dumps(config.to_diff_dict(), sort_keys=True, default=str)
    identity = f"{where}:{hashlib.sha256(config_json.encode()).hexdigest()[:16]}"
    return model, identity


_PRISTINE: dict[tuple[int, str | None], tuple[LoraQwenClassifier, str]] = {}

_SPARE: dict[tuple[int, str | None], tuple[int, LoraQwenClassifier]] = {}
"""A copy made ahead, by the process that forks the ones that train (``warm``), with the pid that made it:
a process forked after it takes that copy as its first model instead of copying (in a fresh fork the copy
costs more than the steps of a small role); the maker itself never takes it."""


def _key(seed: int, qwen_path: str | os.PathLike[str] | None) -> tuple[int, str | None]:
    return seed, None if qwen_path is None else str(qwen_path)


def _pristine(seed: int, qwen_path: str | os.PathLike[str] | None) -> tuple[LoraQwenClassifier, str]:
    """The model as first built in this process, and its identity; never handed out, only copied."""
    key = _key(seed, qwen_path)
    if key not in _PRISTINE:
        _PRISTINE[key] = build_lora_qwen(seed=seed, qwen_path=qwen_path)
    return _PRISTINE[key]


def fresh_lora_qwen(*, seed: int, qwen_path: str | os.PathLike[str] | None = None) -> LoraQwenClassifier:
    """A model equal to ``build_lora_qwen(seed=seed, qwen_path=qwen_path)[0]``, built once per process.

    Later calls return deep copies of the first build, so processes forked after it (sub-world roles,
    crash-matrix runs) copy the model instead of building it again: PEFT's adapter injection alone takes
    0.3-0.7 s per build on a 2-core machine. A process forked after :func:`keep_spare_lora_qwen` takes the
    spare copy it inherited as its first model. The global RNG is untouched either way.
    """
    spare = _SPARE.pop(_key(seed, qwen_path), None)
    if spare is not None and spare[0] != os.getpid():
        return spare[1]
    return copy.deepcopy(_pristine(seed, qwen_path)[0])


def keep_spare_lora_qwen(*, seed: int, qwen_path: str | os.PathLike[str] | None = None) -> None:
    """Build the model into this process's copy-once cache and, for the tiny in-memory model, keep one copy
    ready for each process forked from here (its first :func:`fresh_lora_qwen` takes it). A model loaded
    from disk keeps no spare: that would hold a second copy of real weights in every forking process."""
    _pristine(seed, qwen_path)
    key = _key(seed, qwen_path)
    if qwen_path is None and key not in _SPARE:
        _SPARE[key] = (os.getpid(), copy.deepcopy(_PRISTINE[key][0]))


def lora_qwen_identity(*, seed: int, qwen_path: str | os.PathLike[str] | None = None) -> str:
    """``build_lora_qwen``'s identity string of the model, from the same once-per-process build."""
    return _pristine(seed, qwen_path)[1]


def lora_qwen_vocab(*, seed: int, qwen_path: str | os.PathLike[str] | None = None) -> int:
    """The model's vocabulary size (the range of its row tokens), without copying the model."""
    return _pristine(seed, qwen_path)[0].vocab_size
