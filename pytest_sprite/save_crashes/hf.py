"""Hugging Face ``Trainer`` as a crash-matrix target: a tiny in-memory GPT-2, ckpt-chaos's schedule.

``save_steps=5`` and ``max_steps=10``: the run saves ``checkpoint-5`` and ``checkpoint-10``, and a resume is
``trainer.train(resume_from_checkpoint=True)`` (Trainer's own auto-resume, which picks the highest-numbered
``checkpoint-N`` folder) whenever a checkpoint folder exists. A callback marks each save complete (Trainer calls
``on_save`` after the whole checkpoint is written) and the run marks which checkpoint it resumed from, so the
matrix can judge LOST_WORK. No download: the config is built in memory (2 layers, 32 wide, vocabulary 64).

With ``ranks=2`` every rank is a forked process with the launcher variables set, and Trainer (through
accelerate) starts a gloo process group over them: ckpt-chaos's two-rank setup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sprite.plumbing.process import prewarm_training
from pytest_sprite.save_crashes.inject import note_resumed_from, note_save_complete
from pytest_sprite.save_crashes.target_run import RunOutcome, RunRequest, forked_envs

__all__ = ["HF_ENV", "HFTrainerTarget", "train_tiny_gpt2"]

MAX_STEPS = 10
SAVE_STEPS = 5
HF_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
}
"""Environment of every Trainer run: quiet (as ckpt-chaos's harness), offline."""


def _tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class _Rows:
    """32 fixed rows of 16 tokens, the same in every run (a map-style dataset Trainer can sample from)."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (32, 16), generator=g)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_tiny_gpt2(train_dir: Path) -> dict[str, Any]:
    """Train the tiny GPT-2 for 10 steps into ``train_dir``, resuming with ``resume_from_checkpoint=True``."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    class MarkSaves(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            note_save_complete(f"checkpoint-{state.global_step}")

    args = TrainingArguments(
        output_dir=str(train_dir),
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        save_strategy="steps",
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        seed=0,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Rows(), callbacks=[MarkSaves()])
    has_checkpoint = any(p.name.startswith("checkpoint-") for p in Path(train_dir).iterdir())
    if has_checkpoint:
        last = get_last_checkpoint(str(train_dir))  # type: ignore[no-untyped-call]  # what resume_from_checkpoint=True will load
        note_resumed_from(None if last is None else os.path.basename(last))
    else:
        note_resumed_from(None)
    trainer.train(resume_from_checkpoint=True if has_checkpoint else None)
    model = trainer.model
    if model is None:
        raise RuntimeError("Trainer lost its model")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass(frozen=True, kw_only=True)
class HFTrainerTarget:
    """The tiny GPT-2 Trainer job, at 1 rank or more (each a fork with torchrun's variables)."""

    ranks: int = 1

    @property
    def label(self) -> str:
        return "hf_trainer tiny GPT-2"

    def prewarm(self) -> None:
        """Import transformers' Trainer and build the model once here, so forks start warm."""
        prewarm_training()
        import transformers.trainer  # noqa: F401

        _tiny_gpt2()

    def run(self, request: RunRequest) -> RunOutcome:
        return request.in_forks(train_tiny_gpt2, (), forked_envs(self.ranks, HF_ENV))
