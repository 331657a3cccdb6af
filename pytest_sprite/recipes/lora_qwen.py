"""The parity recipe: a Qwen2 decoder with a PEFT LoRA adapter and a 2-class head, trained three ways.

This is the lightning-sprite procedure's FP32 parity recipe: LoRA (r=8, alpha=16, q/k/v/o) on a Qwen2 backbone,
a linear head on the last token, int64 labels uniform in {0, 1}, mean cross-entropy, SGD with an active
global-norm clip, FP32 with TF32 off, identical seeded weights and rows in every arm. lora_B starts from a
seeded normal draw (std 0.01, seed 1) instead of PEFT's zeros so every trainable tensor has a nonzero
gradient at step 0 (with zeros every lora_A gradient is exactly zero there and a bug in it goes unseen).

By default the backbone is a tiny Qwen2 config built in memory (no download, seconds on CPU);
``qwen_path`` loads real weights such as Qwen2.5-0.5B through the same code.

:class:`LoraQwen` is a :class:`~pytest_sprite.Recipe`: its ``run`` and ``resume_roles`` are the recipe's,
and its model, rows and loss are picklable top-level objects, so the resume roles and the crash target
train it in fresh processes as they train a project's own recipe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.constants import DEFAULT_SEQ_LEN
from pytest_sprite.recipes.recipe import Recipe
from pytest_sprite.records import ArmRecord, Bf16ArmRecord

if TYPE_CHECKING:
    import torch

    from pytest_sprite.recipes._model import LoraQwenClassifier, Rows
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.world import World

__all__ = ["LoraModel", "LoraQwen", "LoraRows", "lora_loss"]


@dataclass(frozen=True, kw_only=True)
class LoraModel:
    """lora_qwen's model factory: the classifier from its fixed seed, built once per process and copied on every call."""

    seed: int = 0
    qwen_path: str | None = None

    def __call__(self) -> LoraQwenClassifier:
        from pytest_sprite.recipes._model import fresh_lora_qwen

        return fresh_lora_qwen(seed=self.seed, qwen_path=self.qwen_path)

    def warm(self) -> None:
        """Build the model into this process's copy-once cache now, so processes forked later only copy it
        (the tiny model: take a copy made here)."""
        from pytest_sprite.recipes._model import keep_spare_lora_qwen

        keep_spare_lora_qwen(seed=self.seed, qwen_path=self.qwen_path)


@dataclass(frozen=True, kw_only=True)
class LoraRows:
    """lora_qwen's rows: ``rows(n)`` gives n rows ``{"input_ids", "labels"}`` (the recipe's form), and
    ``rows(steps=, global_batch=)`` the whole run's :class:`Rows` as stacked tensors."""

    seed: int = 0
    seq_len: int = DEFAULT_SEQ_LEN
    qwen_path: str | None = None

    @overload
    def __call__(self, n: int) -> list[dict[str, Any]]: ...

    @overload
    def __call__(self, *, steps: int, global_batch: int) -> Rows: ...

    def __call__(
        self, n: int | None = None, *, steps: int | None = None, global_batch: int | None = None
    ) -> list[dict[str, Any]] | Rows:
        from pytest_sprite.recipes._model import lora_qwen_vocab, make_rows

        count = n if n is not None else int(steps or 0) * int(global_batch or 0)
        vocab = lora_qwen_vocab(seed=self.seed, qwen_path=self.qwen_path)
        rows = make_rows(seed=self.seed, rows=count, seq_len=self.seq_len, vocab_size=vocab)
        if n is None:
            return rows
        return [{"input_ids": rows.input_ids[i], "labels": rows.labels[i]} for i in range(n)]


def lora_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the classifier's logits (taken in FP32) over the batch's rows."""
    import torch.nn.functional as F

    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.float(), batch["labels"])


@dataclass(frozen=True, kw_only=True, eq=False)
class LoraQwen(Recipe):
    """The ``lora_qwen`` fixture's object: the shipped :class:`Recipe`, bound to the test's world.

    ``run(arm)`` trains one arm and ``resume_roles(...)`` runs the resume check through ``Recipe``'s code,
    as for a project's own model. Every rank of a test builds the same model from the same seed; each arm
    trains a fresh copy. Pickled (for a role in fresh processes) it travels without its world, artifacts
    and records, which belong to the test that made it.
    """

    name: str = field(default="lora_qwen", init=False)
    model: LoraModel = field(init=False)
    rows: LoraRows = field(init=False)
    loss: Any = field(init=False)
    backbone: str | None = field(default="backbone", init=False)
    world: World | None = None
    """The test's world; None: the running test's, as for any recipe."""
    qwen_path: str | os.PathLike[str] | None = None
    """Real Qwen2 weights (a ``save_pretrained`` directory), or None for the tiny in-memory model."""
    seq_len: int = DEFAULT_SEQ_LEN
    """Tokens per row."""
    artifacts: ArtifactDir | None = None
    """Where rank 0 writes every record (``--sprite-artifacts``), or None."""
    records: list[ArmRecord | Bf16ArmRecord] = field(default_factory=list, init=False)
    """Every record this object produced, in order (for reports)."""

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise SpriteUsageError(f"seed must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise SpriteUsageError(f"seq_len must be a positive int, got {self.seq_len!r}")
        if not self.lr > 0:
            raise SpriteUsageError(f"lr must be positive, got {self.lr!r}")
        path = None if self.qwen_path is None else str(self.qwen_path)
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "model", LoraModel(seed=self.seed, qwen_path=path))
        object.__setattr__(self, "rows", LoraRows(seed=self.seed, seq_len=self.seq_len, qwen_path=path))
        object.__setattr__(self, "loss", lora_loss)
        super().__post_init__()

    def __reduce__(self) -> tuple[Any, ...]:
        path = None if self.qwen_path is None else str(self.qwen_path)
        return (_portable_lora_qwen, (self.seed, path, self.seq_len, self.lr))

    def build_model(self) -> LoraQwenClassifier:
        """A fresh copy of the recipe's model (CPU, FP32, seeded), identical on every rank and every call."""
        return self.model()

    @property
    def model_id(self) -> str:
        """Identity of the backbone: ``tiny-qwen2:<config digest>`` or the real weights' path and digest."""
        from pytest_sprite.recipes._model import lora_qwen_identity

        return lora_qwen_identity(seed=self.seed, qwen_path=self.model.qwen_path)

    @property
    def recipe(self) -> Recipe:
        """This object as a :class:`Recipe` (it is one): the shipped recipe, run through a project's code."""
        return self

    # --- what a bound recipe changes in Recipe's run -------------------------------------------------

    def _bound_world(self) -> World | None:
        return self.world if self.world is not None else super()._bound_world()

    def _artifacts(self, *, resume: bool) -> ArtifactDir | None:
        return self.artifacts

    def _identity(self, model: torch.nn.Module) -> tuple[str, int]:
        return self.model_id, self.seq_len

    def _keep(self, record: ArmRecord | Bf16ArmRecord) -> None:
        self.records.append(record)


def _portable_lora_qwen(seed: int, qwen_path: str | None, seq_len: int, lr: float) -> LoraQwen:
    """A pickled :class:`LoraQwen`, rebuilt in another process without the world it was bound to."""
    return LoraQwen(seed=seed, qwen_path=qwen_path, seq_len=seq_len, lr=lr)
