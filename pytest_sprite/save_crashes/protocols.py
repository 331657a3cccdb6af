"""Planted save protocols: small, deterministic training functions whose crash verdicts are known in advance.

They prove the matrix can say both things: ``in_place`` writes ``ckpt-N/`` in place and resumes from the
highest-numbered folder without checking it is complete (the Hugging Face ``get_last_checkpoint`` shape), so a
crash inside a save must come out HARD_FAIL; ``tmp_rename`` writes into ``ckpt-N.tmp/`` and renames it into place,
and its resume skips anything that is not a renamed folder, so every crash point must PASS.

Each trains a seeded ``Linear(4, 2)`` with SGD + momentum for :data:`STEPS` steps on fixed rows, saving model,
optimizer and step every :data:`SAVE_EVERY` steps, and marks its saves and resumes for LOST_WORK.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pytest_sprite.save_crashes.inject import note_resumed_from, note_save_complete

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROTOCOLS",
    "RACE_JITTER_S",
    "RACE_WINDOW_S",
    "SAVE_EVERY",
    "STEPS",
    "train",
    "train_in_place",
    "train_rank0_rename",
    "train_shared_tmp",
    "train_tmp_rename",
]

STEPS = 4
SAVE_EVERY = 2
RACE_JITTER_S = 0.03
"""``shared_tmp``: the most a rank pauses, at random, before it checks the shared folder."""
RACE_WINDOW_S = 0.005
"""``shared_tmp``: seconds from a rank's check of the shared folder to its rename (the race window)."""
Protocol = Literal["in_place", "tmp_rename"]
PROTOCOLS: tuple[str, ...] = ("in_place", "tmp_rename")
_FOLDER = re.compile(r"^ckpt-(\d+)$")


def train(out_dir: str | os.PathLike[str], protocol: Protocol) -> dict[str, torch.Tensor]:
    """Train to :data:`STEPS`, resuming from the newest checkpoint the protocol trusts; return the final weights."""
    import torch

    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; protocols: {', '.join(PROTOCOLS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, opt, xs, ys = _job()
    start = _resume(out, model, opt, "optim.pt")
    for step in range(start, STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[step]), ys[step])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if (step + 1) % SAVE_EVERY == 0:
            _save(out, step + 1, model, opt, protocol)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _job() -> tuple[torch.nn.Linear, torch.optim.SGD, torch.Tensor, torch.Tensor]:
    """The seeded model, its optimizer and every step's batch: the same on every rank and every run."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 8, 4, generator=g)
    ys = torch.randn(STEPS, 8, 2, generator=g)
    return model, opt, xs, ys


def _resume(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, optim_file: str) -> int:
    """Load the newest checkpoint the protocol trusts (if any) and note it; the step to go on from."""
    import torch

    start = 0
    latest = _latest(out)
    if latest is not None:
        model.load_state_dict(torch.load(latest / "model.pt", weights_only=True))
        opt.load_state_dict(torch.load(latest / optim_file, weights_only=True))
        start = int(json.loads((latest / "state.json").read_text())["step"])
    note_resumed_from(None if latest is None else latest.name)
    return start


def _latest(out: Path) -> Path | None:
    """The highest-numbered ``ckpt-N`` folder (never checked for completeness; ``.tmp`` folders never match)."""
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _FOLDER.match(p.name))]
    return max(found)[1] if found else None


def _save(
    out: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, protocol: Protocol
) -> None:
    import torch

    final = out / f"ckpt-{step}"
    folder = final if protocol == "in_place" else out / f"ckpt-{step}.tmp"
    if protocol == "tmp_rename" and folder.exists():
        shutil.rmtree(folder)  # left over by a crash during an earlier attempt at this save
    folder.mkdir(exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pt")
    torch.save(opt.state_dict(), folder / "optim.pt")
    with open(folder / "state.json", "w", encoding="utf-8") as f:
        json.dump({"step": step}, f)
    if protocol == "tmp_rename":
        os.replace(folder, final)
    note_save_complete(final.name)


def train_in_place(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Checkpoint folders written in place; resume from the highest-numbered one without checking it."""
    return train(out_dir, "in_place")


def train_tmp_rename(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Checkpoint folders written under ``.tmp`` and renamed into place; resume skips the unrenamed."""
    return train(out_dir, "tmp_rename")


def train_shared_tmp(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every rank writes its part into one shared ``ckpt-N.tmp/`` and then every rank renames it into place.

    The shape of the temporary-folder save Hugging Face merged and reverted (#35580, #36076): each rank checks
    that the folder is complete and still there, then renames it, so when both pass the check before either
    renames, the loser's rename (or its check) raises ``FileNotFoundError``. A race: it fails only sometimes,
    which is what ``flake=`` counts. Each rank reaches its check at its own pace (a random pause of up to
    :data:`RACE_JITTER_S`) and takes :data:`RACE_WINDOW_S` from the check to the rename, so the losing
    interleaving comes in about half of the runs on any machine, not at the mercy of its scheduler (bare, it
    came in 5-20% of the runs here, depending on the load). Runs under torchrun's variables
    (``assert_crash_consistent(..., ranks=2)``) or in a sub-world; gradients are averaged over ranks, rank 0
    writes the model, every rank its optimizer.
    """
    return _train_ranks(out_dir, installer="every_rank")


def train_rank0_rename(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """As :func:`train_shared_tmp`, but after a barrier rank 0 alone renames the folder into place: sound."""
    return _train_ranks(out_dir, installer="rank0")


def _train_ranks(out_dir: str | os.PathLike[str], *, installer: str) -> dict[str, torch.Tensor]:
    import torch
    import torch.distributed as dist

    own_group = not dist.is_initialized()  # a sub-world has started one already
    if own_group:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = Path(out_dir)
        model, opt, xs, ys = _job()
        start = _resume(out, model, opt, f"optim-{rank}.pt")
        for step in range(start, STEPS):
            opt.zero_grad()
            part = slice(rank * 8 // world, (rank + 1) * 8 // world)
            loss = torch.nn.functional.mse_loss(model(xs[step][part]), ys[step][part])
            loss.backward()  # type: ignore[no-untyped-call]
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            if (step + 1) % SAVE_EVERY == 0:
                final = out / f"ckpt-{step + 1}"
                tmp = out / f"ckpt-{step + 1}.tmp"
                if rank == 0 and tmp.exists():
                    shutil.rmtree(tmp)  # left over by a crash during an earlier attempt at this save
                dist.barrier()
                tmp.mkdir(exist_ok=True)
                if rank == 0:
                    torch.save(model.state_dict(), tmp / "model.pt")
                    with open(tmp / "state.json", "w", encoding="utf-8") as f:
                        json.dump({"step": step + 1}, f)
                torch.save(opt.state_dict(), tmp / f"optim-{rank}.pt")
                dist.barrier()
                if installer == "rank0":
                    if rank == 0:
                        os.rename(tmp, final)
                else:
                    _install_unguarded(tmp, final, parts=world + 2)
                dist.barrier()
                note_save_complete(final.name)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        if own_group:
            dist.destroy_process_group()


def _install_unguarded(tmp: Path, final: Path, *, parts: int) -> None:
    """Every rank: when the shared folder is complete and still there, rename it into place (a check-then-act race)."""
    time.sleep(random.SystemRandom().uniform(0.0, RACE_JITTER_S))  # not the forked, shared seed of random
    if tmp.exists() and len(os.listdir(tmp)) == parts:  # every part is there: install it
        time.sleep(RACE_WINDOW_S)
        os.rename(tmp, final)


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_sprite.save_crashes.protocols PROTOCOL OUT``: train, then ``torch.save`` the weights to OUT/final.pt.

    An ordinary script for the command form (it knows nothing of the crash matrix).
    """
    import torch

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m pytest_sprite.save_crashes.protocols {in_place|tmp_rename} OUT_DIR",
            file=sys.stderr,
        )
        return 2
    weights = train(args[1], args[0])  # type: ignore[arg-type]
    torch.save(weights, Path(args[1]) / "final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
