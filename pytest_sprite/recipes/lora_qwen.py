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
import dataclasses
import os
import weakref
from typing import TYPE_CHECKING, Any, Literal, overload

from pytest_sprite._timing import perf_counter
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.faults import PlantSite, get_fault
from pytest_sprite.recipes.constants import DEFAULT_CLIP, DEFAULT_LR, DEFAULT_SEQ_LEN, DEFAULT_STEPS
from pytest_sprite.records import (
    ARMS,
    BF16_ARMS,
    BF16_PRECISION,
    BF16_SINGLE_DEVICE_ARMS,
    DISTRIBUTED_ARMS,
    FP32_PRECISION,
    ArmRecord,
    Bf16ArmRecord,
    RecipeIdentity,
)

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
        self.records: list[ArmRecord | Bf16ArmRecord] = []
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
        """Train one arm and return its record, the same on every rank.

        FP32 parity (``precision="32-true"``, an :class:`ArmRecord`): ``single`` trains the full global batch
        on one device (rank 0; the other ranks wait and receive the record); ``ddp`` and ``fsdp`` run the
        code-under-test strategies on every rank of the test, or ``strategy`` when given (a fresh Lightning
        strategy object per call). The default global batch is 2 x the test's world size; each optimizer
        step trains ``accumulate`` micro-batches per rank.

        BF16 criterion v2 (``precision="bf16-mixed"``, a :class:`Bf16ArmRecord` for ``assert_criterion_v2``):
        the arms ``ref32`` (FP32, TF32 off; it runs FP32 whatever the run's precision), ``ref``, ``split``
        and ``split_premul`` on one device (rank 0, shared), and ``ddp`` and ``fsdp`` on every rank.
        """
        if arm in BF16_ARMS and (arm in BF16_SINGLE_DEVICE_ARMS or _is_bf16(precision)):
            return self._run_bf16(arm, precision, steps, clip, global_batch, accumulate, fault, strategy)
        global_batch = self._check_run(arm, steps, clip, global_batch, accumulate, fault, strategy, precision)
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

    def _run_bf16(
        self,
        arm: str,
        precision: str,
        steps: int,
        clip: float,
        global_batch: int | None,
        accumulate: int,
        fault: str | None,
        strategy: Strategy | None,
    ) -> Bf16ArmRecord:
        """One arm of criterion v2: the same recipe, recorded at every step."""
        if arm != "ref32" and not _is_bf16(precision):
            raise SpriteUsageError(
                f"arm {arm!r} is a BF16 arm of criterion v2 and runs precision='bf16-mixed', got {precision!r}; "
                f'pass precision="bf16-mixed" (ref32 is its FP32 reference and runs FP32 either way)'
            )
        if arm == "ref32" and not (_is_bf16(precision) or precision == FP32_PRECISION):
            raise SpriteUsageError(
                f"arm 'ref32' is criterion v2's FP32 reference; pass precision='bf16-mixed' (the run's precision) "
                f"or '32-true', got {precision!r}"
            )
        if accumulate != 1:
            raise SpriteUsageError(
                f"the BF16 arms take no accumulate= (got {accumulate}): criterion v2 trains one shard per rank "
                "and step, and loss/N accumulation would change BF16 backward rounding"
            )
        if strategy is not None and arm not in DISTRIBUTED_ARMS:
            raise SpriteUsageError(f"strategy= applies to the ddp and fsdp arms, not {arm!r}")
        n = self.world.size
        ran = FP32_PRECISION if arm == "ref32" else BF16_PRECISION
        if arm in DISTRIBUTED_ARMS and n < 2:
            raise SpriteUsageError(
                f"arm {arm!r} needs the ranks of a test marked @pytest.mark.ranks(n) with n >= 2; this test runs "
                f"on {n} process"
            )
        global_batch = self._check_run(
            "ddp" if arm in DISTRIBUTED_ARMS else "single", steps, clip, global_batch, 1, None, strategy, ran
        )
        if global_batch % n:
            raise SpriteUsageError(
                f"global_batch={global_batch} must be a multiple of the world size {n}: every BF16 arm trains "
                f"(or, on one device, emulates) the {n} rank shards"
            )
        if fault is not None:
            site = PlantSite(
                arm=arm,
                rank=self.world.rank,
                world_size=n if arm in DISTRIBUTED_ARMS else 1,
                accumulate=1,
                precision=ran,
            )
            get_fault(fault).check(site)
        rows = self.rows(steps=steps, global_batch=global_batch)
        identity = self._identity(rows.digest, steps, global_batch, clip)
        from pytest_sprite.recipes import _bf16_arm

        plan = _bf16_arm.Bf16Plan(arm=arm, identity=identity, precision=ran, fault=fault, shards=n)
        target = None
        if self.artifacts is not None:
            target = self.world.run_on_rank(0, self.artifacts.next_arm_dir, arm=arm, fault=fault)
        model = self.build_model()
        sites = _bf16_arm.Bf16Sites(
            linear=model.linear_sites(), backbone=model.backbone_name, adapters=model.adapter_tensors()
        )
        start = perf_counter()
        if arm in DISTRIBUTED_ARMS:
            record = _bf16_arm.run_bf16_distributed(
                plan, net=model, rows=rows, world=self.world, sites=sites, strategy=strategy
            )
        else:
            record = self.world.run_on_rank(
                0,
                lambda: _bf16_arm.run_bf16_single(plan, net=model, rows=rows, world=self.world, sites=sites),
            )
        elapsed = self.world.broadcast_object(perf_counter() - start)
        record = dataclasses.replace(record, wall_s=elapsed)
        if self.artifacts is not None and target is not None:
            self.world.run_on_rank(0, self.artifacts.write, target, record)
        self.records.append(record)
        return record

    def _identity(self, rows_digest: str, steps: int, global_batch: int, clip: float) -> RecipeIdentity:
        return RecipeIdentity(
            model=self.model_id,
            seed=self.seed,
            rows=steps * global_batch,
            rows_digest=rows_digest,
            seq_len=self.seq_len,
            steps=steps,
            global_batch=global_batch,
            lr=self.lr,
            clip=float(clip),
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
        precision: str,
    ) -> int:
        """Refuse bad ``run`` arguments before anything trains; return the global batch to use."""
        if arm not in ARMS:
            raise SpriteUsageError(
                f"unknown arm {arm!r}; arms: {', '.join(ARMS)} (FP32 parity) and {', '.join(BF16_ARMS)} "
                "(BF16 criterion v2, precision='bf16-mixed')"
            )
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
            site = PlantSite(
                arm=arm, rank=self.world.rank, world_size=ranks, accumulate=accumulate, precision=precision
            )
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


def _is_bf16(precision: object) -> bool:
    """Whether ``precision`` names bf16-mixed, in any of Lightning's spellings ("bf16-mixed", "bf16")."""
    return isinstance(precision, str) and precision.strip().lower() in ("bf16-mixed", "bf16")
