"""Load, in a process that others are forked from, what a Lightning fit under the shipped strategies loads late.

A fit imports parts of torch on first use: DDP's communication hooks when the strategy wraps the model,
``torch.distributed.checkpoint.state_dict`` and its fsspec writer at an FSDP2 save, torch's serialization
config at the first ``torch.save``. Each fresh fork that trains pays for them again: measured on a 2-core
machine, 0.7 s of a 2-rank DDP fit of 1.4 s went to importing ``ddp_comm_hooks``. Importing them once in
the process the forks come from (a sub-world's zygote, a crash matrix's test process) makes every fork start
warm. No device is touched and no process group is made: imports only.
"""

from __future__ import annotations

import importlib

__all__ = ["LATE_IMPORTS", "import_late_modules"]

LATE_IMPORTS: tuple[str, ...] = (
    "pytest_sprite.lightning",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.serialization",
    "torch.profiler",
    "torch.profiler._cupti_monitor",
    "fsspec.implementations.chained",
)
"""Modules a fit under XPUDDPStrategy or FSDP2Strategy imported on first use (found by diffing ``sys.modules``
before and after a fit in a fork, torch 2.13 and Lightning 2.6.6). Private names may move between versions:
a module that is not there is skipped."""


def import_late_modules() -> None:
    """Import :data:`LATE_IMPORTS`, skipping those this installation does not have."""
    for name in LATE_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
