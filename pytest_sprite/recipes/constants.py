"""The ``lora_qwen`` recipe's fixed numbers: backbone config, adapter, lora_B draw and run defaults.

Their own module, below the model, the arm and the recipe object that all read them, so no import points up.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_LR",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_STEPS",
    "LORA_B_SEED",
    "LORA_B_STD",
    "LORA_CONFIG",
    "NUM_CLASSES",
    "TINY_QWEN2",
]

TINY_QWEN2: Final[dict[str, Any]] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
"""The in-memory default backbone: Qwen2's architecture (GQA, q/k/v bias, RMSNorm) at toy size."""

LORA_CONFIG: Final[dict[str, Any]] = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "lora_dropout": 0.0,
    "bias": "none",
}
"""The parity recipe's adapter: r=8, alpha=16 on q/k/v/o, no dropout (dropout would make arms draw differently)."""

LORA_B_SEED: Final = 1
"""Seed of the lora_B draw, fixed by the parity recipe independently of the run's seed."""
LORA_B_STD: Final = 0.01
"""Standard deviation of the lora_B draw."""

NUM_CLASSES: Final = 2
"""Classes of the head; labels are uniform in {0, 1}."""
DEFAULT_CLIP: Final = 0.01
"""Global gradient-norm clip, small enough to be active at every step of the tiny model."""
DEFAULT_LR: Final = 1.0
"""SGD learning rate."""
DEFAULT_STEPS: Final = 5
"""Optimizer steps of an arm."""
DEFAULT_SEQ_LEN: Final = 8
"""Tokens per row."""
