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
import weakref
from typing import TYPE_CHECKING, Any

from pytest_sprite._timing import perf_counter
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.faults import PlantSite, get_fault
from pytest_sprite.recipes.constants import DEFAULT_CLIP, DEFAULT_LR, DEFAULT_SEQ_LEN, DEFAULT_STEPS
from pytest_sprite.records import ARMS, DISTRIBUTED_ARMS, ArmRecord, RecipeIdentity, ResumeRun

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

    from pytest_sprite.recipes._model import LoraQwenClassifier, Rows
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.world import World

__all__ = ["LoraQwen"]


class LoraQwen:
    """The ``lora_qwen`` fixture's object: the recipe's model and rows, and ``run(arm)`` to train one arm.

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
        self.records: list[ArmRecord] = []
        """Every record this object produced, in order (for reports)."""
        self._used_strategies: weakref.WeakSet[Any] = weakref.WeakSet()

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
    ) -> ArmRecord:
        """Train one arm and return its record, the same on every rank.

        ``single`` trains the full global batch on one device (rank 0; the other ranks wait and receive the
        record); ``ddp`` and ``fsdp`` run the code-under-test strategies on every rank of the test, or
        ``strategy`` when given (a fresh Lightning strategy object per call). The default global batch is
        2 x the test's world size; each optimizer step trains ``accumulate`` micro-batches per rank.
        """
        global_batch = self._check_run(arm, steps, clip, global_batch, accumulate, fault, strategy)
        rows = self.rows(steps=steps, global_batch=global_batch)
        identity = RecipeIdentity(
            model=self.model_id,
            seed=self.seed,
            rows=steps * global_batch,
            rows_digest=rows.digest,
            seq_len=self.seq_len,
            steps=steps,
            global_batch=global_batch,
            lr=self.lr,
            clip=float(clip),
        )
        from pytest_sprite.recipes import _arm

        plan = _arm.ArmPlan(
            arm=arm,
            identity=identity,
            precision=precision,
            accumulate=accumulate,
            fault=fault,
        )
        target = None
        if self.artifacts is not None:
            target = self.world.run_on_rank(
                0, self.artifacts.next_arm_dir, arm=arm, accumulate=accumulate, fault=fault
            )
        start = perf_counter()
        if arm == "single":
            record = self.world.run_on_rank(
                0,
                lambda: _arm.run_single(
                    plan, model=self.build_model(), rows=rows, world=self.world, strategy=strategy
                ),
            )
        else:
            record = _arm.run_distributed(
                plan, model=self.build_model(), rows=rows, world=self.world, strategy=strategy
            )
        # Rank 0's wall time, so the record stays identical on every rank.
        elapsed = self.world.broadcast_object(perf_counter() - start)
        record = _arm.with_wall_time(record, elapsed)
        if self.artifacts is not None and target is not None:
            self.world.run_on_rank(0, self.artifacts.write, target, record)
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
        clipping, 2 epochs of 3 steps, global batch 2 x the test's ranks. Call it on every rank.
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
        )

    def _check_run(
        self,
        arm: str,
        steps: int,
        clip: float,
        global_batch: int | None,
        accumulate: int,
        fault: str | None,
        strategy: Strategy | None,
    ) -> int:
        """Refuse bad ``run`` arguments before anything trains; return the global batch to use."""
        if arm not in ARMS:
            raise SpriteUsageError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
        for name, value in (("steps", steps), ("accumulate", accumulate)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpriteUsageError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(clip, (int, float)) or not clip > 0:
            raise SpriteUsageError(
                f"clip must be a positive number, got {clip!r}; the recipe needs an active global-norm clip"
            )
        world_size = self.world.size
        if global_batch is None:
            global_batch = 2 * world_size
        ranks = 1 if arm == "single" else world_size
        if not isinstance(global_batch, int) or global_batch < 1 or global_batch % (ranks * accumulate):
            raise SpriteUsageError(
                f"global_batch={global_batch!r} must be a positive multiple of ranks x accumulate = "
                f"{ranks} x {accumulate} = {ranks * accumulate} for arm {arm!r}"
            )
        if fault is not None:
            site = PlantSite(arm=arm, rank=self.world.rank, world_size=ranks, accumulate=accumulate)
            get_fault(fault).check(site)
        if arm in DISTRIBUTED_ARMS and not self.world.distributed:
            raise SpriteUsageError(
                f"arm {arm!r} needs the ranks of a test marked @pytest.mark.ranks(n); this test runs on one "
                "process without a process group"
            )
        if strategy is not None:
            from lightning.pytorch.strategies import Strategy

            if not isinstance(strategy, Strategy):
                raise SpriteUsageError(
                    f"strategy= must be a Lightning Strategy object, got {type(strategy).__name__}; "
                    "pass for example MyDDPStrategy() (a fresh object per run)"
                )
            if strategy in self._used_strategies:
                raise SpriteUsageError(
                    f"strategy= got a {type(strategy).__name__} object that an earlier arm already ran with; "
                    "Lightning strategies keep state from their fit, so pass a fresh object per run"
                )
            self._used_strategies.add(strategy)
        return global_batch
