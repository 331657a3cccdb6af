"""The parity recipe: a Qwen2 decoder with a PEFT LoRA adapter and a 2-class head, trained three ways.

This is the lightning-sprite seed's FP32 parity recipe: LoRA (r=8, alpha=16, q/k/v/o) on a Qwen2 backbone,
a linear head on the last token, int64 labels uniform in {0, 1}, mean cross-entropy, SGD with an active
global-norm clip, FP32 with TF32 off, identical seeded weights and rows in every arm. lora_B starts from a
seeded normal draw (std 0.01, seed 1) instead of PEFT's zeros so every trainable tensor has a nonzero
gradient at step 0 (with zeros every lora_A gradient is exactly zero there and a bug in it goes unseen).

By default the backbone is a tiny Qwen2 config built in memory (no download, seconds on CPU);
``qwen_path`` loads real weights such as Qwen2.5-0.5B through the same code.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any, Literal, overload

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.constants import DEFAULT_CLIP, DEFAULT_LR, DEFAULT_SEQ_LEN, DEFAULT_STEPS
from pytest_sprite.recipes.recipe import Recipe
from pytest_sprite.records import ArmRecord, Bf16ArmRecord, ResumeRun

if TYPE_CHECKING:
    import torch
    from lightning.pytorch.strategies import Strategy

    from pytest_sprite.recipes._model import LoraQwenClassifier, Rows
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.world import World

__all__ = ["LoraQwen", "lora_loss"]


class LoraQwen:
    """The ``lora_qwen`` fixture's object: the shipped :class:`Recipe` bound to the test's world, with its
    model and rows, and ``run(arm)`` to train one arm (through ``Recipe``'s code, as a project's own model).

    Every rank of a test builds the same model from the same seed; each arm trains a fresh copy.
    """

    def __init__(
        self,
        *,
        world: World,
        qwen_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
        seq_len: int = DEFAULT_SEQ_LEN,
        lr: float = DEFAULT_LR,
        artifacts: ArtifactDir | None = None,
    ) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise SpriteUsageError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise SpriteUsageError(f"seq_len must be a positive int, got {seq_len!r}")
        if not lr > 0:
            raise SpriteUsageError(f"lr must be positive, got {lr!r}")
        self.world = world
        self.qwen_path = qwen_path
        self.seed = seed
        self.seq_len = seq_len
        self.lr = float(lr)
        self.artifacts = artifacts
        self._model: LoraQwenClassifier | None = None
        self._model_id = ""
        self.records: list[ArmRecord | Bf16ArmRecord] = []
        """Every record this object produced, in order (for reports)."""
        self._recipe: Recipe | None = None

    def build_model(self) -> LoraQwenClassifier:
        """A fresh copy of the recipe's model (CPU, FP32, seeded), identical on every rank and every call."""
        return copy.deepcopy(self._pristine())

    def _pristine(self) -> LoraQwenClassifier:
        """The model as built, kept untouched: every arm trains a copy of it."""
        if self._model is None:
            from pytest_sprite.recipes._model import build_lora_qwen

            self._model, self._model_id = build_lora_qwen(seed=self.seed, qwen_path=self.qwen_path)
        return self._model

    @property
    def model_id(self) -> str:
        """Identity of the backbone: ``tiny-qwen2:<config digest>`` or the real weights' path and digest."""
        self._pristine()
        return self._model_id

    def rows(self, *, steps: int, global_batch: int) -> Rows:
        """The rows of a run of ``steps`` steps of ``global_batch`` rows."""
        from pytest_sprite.recipes._model import make_rows

        vocab = self._pristine().vocab_size
        return make_rows(seed=self.seed, rows=steps * global_batch, seq_len=self.seq_len, vocab_size=vocab)

    @overload
    def run(
        self,
        arm: Literal["single"],
        *,
        precision: str = ...,
        steps: int = ...,
        clip: float = ...,
        global_batch: int | None = ...,
        accumulate: int = ...,
        fault: str | None = ...,
        strategy: Strategy | None = ...,
    ) -> ArmRecord: ...

    @overload
    def run(
        self,
        arm: Literal["ref32", "ref", "split", "split_premul"],
        *,
        precision: str = ...,
        steps: int = ...,
        clip: float = ...,
        global_batch: int | None = ...,
        accumulate: int = ...,
        fault: str | None = ...,
        strategy: Strategy | None = ...,
    ) -> Bf16ArmRecord: ...

    @overload
    def run(
        self,
        arm: str,
        *,
        precision: str = ...,
        steps: int = ...,
        clip: float = ...,
        global_batch: int | None = ...,
        accumulate: int = ...,
        fault: str | None = ...,
        strategy: Strategy | None = ...,
    ) -> ArmRecord | Bf16ArmRecord: ...

    def run(
        self,
        arm: str,
        *,
        precision: str = "32-true",
        steps: int = DEFAULT_STEPS,
        clip: float = DEFAULT_CLIP,
        global_batch: int | None = None,
        accumulate: int = 1,
        fault: str | None = None,
        strategy: Strategy | None = None,
    ) -> ArmRecord | Bf16ArmRecord:
        """Train one arm and return its record, the same on every rank (through :meth:`Recipe.run`'s code).

        FP32 parity (``precision="32-true"``, an :class:`ArmRecord`): ``single`` trains the full global batch
        on one device (rank 0; the other ranks wait and receive the record); ``ddp`` and ``fsdp`` run the
        code-under-test strategies on every rank of the test, or ``strategy`` when given (a fresh Lightning
        strategy object per call). The default global batch is 2 x the test's world size; each optimizer
        step trains ``accumulate`` micro-batches per rank.

        BF16 criterion v2 (``precision="bf16-mixed"``, a :class:`Bf16ArmRecord` for ``assert_criterion_v2``):
        the arms ``ref32`` (FP32, TF32 off; it runs FP32 whatever the run's precision), ``ref``, ``split``
        and ``split_premul`` on one device (rank 0, shared), and ``ddp`` and ``fsdp`` on every rank.
        """
        from pytest_sprite.recipes.recipe import run_recipe

        record = run_recipe(
            self.recipe,
            world=self.world,
            arm=arm,
            precision=precision,
            steps=steps,
            clip=clip,
            global_batch=global_batch,
            accumulate=accumulate,
            fault=fault,
            strategy=strategy,
            artifacts=self.artifacts,
            model_id=self.model_id,
            seq_len=self.seq_len,
        )
        self.records.append(record)
        return record

    def resume_roles(
        self,
        *,
        strategy: str,
        precision: str = "32-true",
        reshard: bool = False,
        export: bool | None = None,
        fault: str | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> ResumeRun:
        """Every role of the checkpoint resume check, each in its own sub-world (``assert_resume_bitexact``).

        The seed's Checkpoints recipe on this model and seed: AdamW, a per-step LR schedule, global-norm
        clipping, 2 epochs of 3 steps, global batch 2 x the test's ranks. Call it on every rank. Rank 0
        stores the run (``resume-run.pt``) under this object's artifact directory, else beside the checkpoints.
        """
        from pytest_sprite.recipes.resume import resume_roles

        return resume_roles(
            self,
            strategy=strategy,
            precision=precision,
            reshard=reshard,
            export=export,
            fault=fault,
            directory=directory,
            world=self.world,
            artifacts=self.artifacts,
        )

    @property
    def recipe(self) -> Recipe:
        """This object as a :class:`Recipe`: the shipped recipe, run through the same code as a project's own."""
        if self._recipe is None:
            self._recipe = Recipe(
                name="lora_qwen",
                model=self.build_model,
                rows=self._recipe_rows,
                loss=lora_loss,
                backbone="backbone",
                seed=self.seed,
                lr=self.lr,
            )
        return self._recipe

    def _recipe_rows(self, n: int) -> list[dict[str, Any]]:
        vocab = self._pristine().vocab_size
        from pytest_sprite.recipes._model import make_rows

        rows = make_rows(seed=self.seed, rows=n, seq_len=self.seq_len, vocab_size=vocab)
        return [{"input_ids": rows.input_ids[i], "labels": rows.labels[i]} for i in range(n)]


def lora_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the classifier's logits (taken in FP32) over the batch's rows."""
    import torch.nn.functional as F

    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.float(), batch["labels"])
