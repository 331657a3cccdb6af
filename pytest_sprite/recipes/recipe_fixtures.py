"""The recipe fixtures: ``lora_qwen`` (the parity recipe) and ``xpu_mesh`` (a data-parallel DeviceMesh).

A pytest plugin module (registered from ``pytest_sprite.plugin``); torch is imported inside the fixtures,
so loading it costs nothing in the controller.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pytest_sprite.recipes.lora_qwen import LoraQwen
    from pytest_sprite.world import World

__all__ = ["lora_qwen", "pytest_sprite_before_fork", "xpu_mesh"]

RECIPE_MODULES = (
    "pytest_sprite.recipes._arm",
    "pytest_sprite.recipes._resume",
    "pytest_sprite.recipes.artifacts",
    "pytest_sprite.recipes.resume_roles",
)
"""The recipe's modules its checks import on first use: imported before the first fork, not in each test child."""


def _setting(config: pytest.Config, name: str) -> Any:
    """A session setting as the plugin resolved it (command line > environment > ini)."""
    from pytest_sprite.glue.options import settings_key

    return getattr(config.stash[settings_key], name)


def pytest_sprite_before_fork(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Build the ``lora_qwen`` model once where the ranks are forked from, when a collected test uses it.

    Each test child (and each test's sub-world zygote) would otherwise build it again: 0.3-0.7 s of a
    2-core machine per rank of every test, the main job's largest fixed cost. A build that
    fails here (a ``--qwen-path`` without weights) is left to the tests that use the fixture, which
    report it; every other test runs as before.
    """
    if not any("lora_qwen" in getattr(item, "fixturenames", ()) for item in items):
        return
    from pytest_sprite.plumbing.process import prewarm_fit
    from pytest_sprite.recipes.lora_qwen import LoraQwen

    prewarm_fit()  # what its fits import late, once here instead of in every test's sub-world zygote
    for name in RECIPE_MODULES:
        importlib.import_module(name)
    try:
        LoraQwen(qwen_path=_setting(config, "qwen_path")).model.warm()
    except Exception:
        pass


@pytest.fixture
def lora_qwen(request: pytest.FixtureRequest, world: World) -> LoraQwen:
    """The parity recipe on this test's ranks: ``lora_qwen.run("single" | "ddp" | "fsdp", ...)``.

    A tiny in-memory Qwen2 by default; ``--qwen-path PATH`` (or ``SPRITE_QWEN_PATH``) loads real weights.
    With ``--sprite-artifacts DIR`` every arm's record is written under ``DIR/<test id>/``.
    """
    from pytest_sprite.recipes.artifacts import test_artifacts
    from pytest_sprite.recipes.lora_qwen import LoraQwen

    qwen_path = _setting(request.config, "qwen_path")
    return LoraQwen(world=world, qwen_path=qwen_path, artifacts=test_artifacts(request.node))


@pytest.fixture
def xpu_mesh(world: World) -> Iterator[DeviceMesh]:
    """A 1-D DeviceMesh named ``data_parallel`` over every rank of the test (``mesh.device_type`` says where).

    XPU when present, else CUDA, else CPU (gloo). Without the ranks marker it is a one-rank mesh over a
    private in-memory process group, destroyed after the test, so nothing can wait for a peer that never comes.
    """
    from pytest_sprite.env.device import BACKENDS, accelerator_type
    from pytest_sprite.recipes.mesh import DATA_PARALLEL, data_parallel_mesh

    if world.distributed:
        yield data_parallel_mesh(world)
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip(
            "xpu_mesh: this test has no ranks marker but a default process group already exists in the "
            "process (not created by pytest-sprite); mark the test @pytest.mark.ranks(n)"
        )
    device_type = accelerator_type()
    # torch.distributed re-exports HashStore from its C extension without marking it public for type checkers.
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(BACKENDS[device_type], store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh(device_type, (1,), mesh_dim_names=(DATA_PARALLEL,))
    finally:
        dist.destroy_process_group()


def _store_counts(config: pytest.Config) -> dict[str, int] | None:
    """The arm and role runs the session computed (the session store's count), None if it computed none."""
    from pytest_sprite.glue.pytest_internals import tmp_path_factory
    from pytest_sprite.recipes.clean_references import STORE_DIR, run_counts

    try:
        root = Path(tmp_path_factory(config).getbasetemp()) / STORE_DIR
    except Exception:  # no basetemp (pytest's tmpdir plugin disabled): nothing was counted
        return None
    counts = run_counts(root)
    return counts if any(counts.values()) else None


def pytest_sprite_report(report: dict[str, Any], config: pytest.Config) -> None:
    """The JSON report's ``sprite_reuse``: the reuse mode and the arm and role runs the session computed."""
    counts = _store_counts(config)
    if counts is not None:
        report["sprite_reuse"] = {
            "mode": _setting(config, "reuse"),
            **{k.replace(" ", "_"): v for k, v in counts.items()},
        }


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """With ``-v``: one line saying how many arm and role runs the session computed."""
    if config.get_verbosity() < 1 or getattr(config.option, "sprite_agent", None):
        return
    from pytest_sprite.recipes.clean_references import tally

    counts = _store_counts(config)
    if counts is not None:
        terminalreporter.write_line(f"sprite: {tally(counts)} (--sprite-reuse={_setting(config, 'reuse')})")
