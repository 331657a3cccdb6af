"""No private name of a dependency outside the modules that keep them (issue 20).

pytest's private names live in ``_pytest_internals.py``; hypothesis', torch's, transformers' and coverage's in
``_dependency_internals.py``. Each there is version-gated with a fallback, and the second half of this
file runs them against the installed (newest) releases.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pytest_sprite

pytestmark = pytest.mark.cpu

PACKAGE = Path(pytest_sprite.__file__).parent
STDLIB = {"_exit", "_getframe", "_current_frames", "_asdict", "_replace", "_fields", "_make"}
"""Public names of the standard library that start with an underscore (``os._exit``, namedtuple's)."""
KEEPERS = {"pytest_internals.py", "dependency_internals.py", "_internals.py"}
DEPENDENCIES = {
    "_pytest",
    "pytest",
    "pluggy",
    "torch",
    "lightning",
    "hypothesis",
    "transformers",
    "peft",
    "mpi4py",
    "coverage",
    "pytest_cov",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(sources: list[str]) -> set[str]:
    """Every private name the package defines itself: functions, classes, attributes, modules."""
    names = {path.stem for path in PACKAGE.rglob("*.py")} | {
        path.name for path in PACKAGE.rglob("*") if path.is_dir()
    }
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return {name for name in names if _private(name)}


def private_uses(source: str, own: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Each ``line name`` where ``source`` reaches a private name it did not define (``own``)."""
    tree = ast.parse(source)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in DEPENDENCIES and (
                    root == "_pytest" or any(_private(part) for part in alias.name.split("."))
                ):
                    found.append(f"{node.lineno} import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            root = node.module.split(".")[0]
            if root not in DEPENDENCIES:
                continue
            if root == "_pytest" or any(_private(part) for part in node.module.split(".")):
                found.append(f"{node.lineno} from {node.module}")
            found.extend(
                f"{node.lineno} from {node.module} import {alias.name}"
                for alias in node.names
                if _private(alias.name)
            )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
        ):
            found.append(f"{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own | STDLIB:
            found.append(f"{node.lineno} .{node.attr}")
    return found


def test_the_scan_finds_each_kind_of_private_use() -> None:
    source = (
        "import torch\nimport torch._dynamo\nfrom _pytest.runner import x\n"
        "from lightning.fabric.utilities.types import _PATH\nimport torch.distributed as dist\n"
        "dist._store_based_barrier()\nfrom pytest_sprite import _ranges\ntorch.__version__\n"
    )
    assert [use.split()[0] for use in private_uses(source)] == ["2", "3", "4", "6"]
    assert [use.split()[0] for use in private_uses(source, own={"_ranges", "_store_based_barrier"})] == [
        "2",
        "3",
        "4",
    ]


def test_no_module_outside_the_keepers_reaches_a_private_name_of_a_dependency() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    own = own_names([path.read_text() for path in paths if path.name not in KEEPERS])
    offenders = {
        str(path.relative_to(PACKAGE)): uses
        for path in paths
        if path.name not in KEEPERS and (uses := private_uses(path.read_text(), own))
    }
    assert offenders == {}, (
        "reach a dependency's private names through _pytest_internals.py or _dependency_internals.py "
        f"(version-gated, with a fallback): {offenders}"
    )


# --- the kept private reaches, against the installed (newest) releases ---------------------------------


def test_hypothesis_settings_and_seed_are_read_and_replaced_on_this_release() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from pytest_sprite.plumbing.dependency_internals import (
        hypothesis_explicit_seed,
        hypothesis_test_settings,
        replace_hypothesis_settings,
    )

    @hypothesis.seed(7)
    @settings(max_examples=3, deadline=200, database=None)
    @given(st.integers())
    def test(x: int) -> None:
        pass

    assert hypothesis_test_settings(test).max_examples == 3
    assert hypothesis_explicit_seed(test) == 7
    assert replace_hypothesis_settings(test, settings(max_examples=2, deadline=None, database=None))
    assert hypothesis_test_settings(test).max_examples == 2
    test()  # the replaced settings are the ones hypothesis runs with


def test_ddp_comm_hooks_are_named_on_this_release() -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pytest_sprite.plumbing.dependency_internals import ddp_comm_hook_names

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        assert ddp_comm_hook_names(ddp) == []
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        assert ddp_comm_hook_names(ddp) == ["allreduce_hook"]
    finally:
        dist.destroy_process_group()
    assert ddp_comm_hook_names(torch.nn.Linear(2, 2)) == []


def test_hf_no_split_modules_are_read_on_this_release() -> None:
    transformers = pytest.importorskip("transformers")

    from pytest_sprite.plumbing.dependency_internals import hf_no_split_modules

    config = transformers.Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.Qwen2ForCausalLM(config)
    assert "Qwen2DecoderLayer" in hf_no_split_modules(model)


def test_a_coverage_configuration_is_copied_for_one_file_per_process_on_this_release(tmp_path: Path) -> None:
    coverage = pytest.importorskip("coverage")

    from pytest_sprite.plumbing.dependency_internals import coverage_config_data, coverage_from_config_data

    cov = coverage.Coverage(data_file=str(tmp_path / ".coverage"), branch=True, source=["mylib"])
    assert cov.config.parallel is False
    data = coverage_config_data(cov, data_file=str(tmp_path / "ranks" / ".coverage"))
    assert data is not None, f"coverage {coverage.__version__} (7.10.4 or newer serializes its configuration)"
    copy = coverage_from_config_data(data)
    assert (copy.config.parallel, copy.config.branch, copy.config.source) == (True, True, ["mylib"])
    assert copy.config.data_file == str(tmp_path / "ranks" / ".coverage")
    assert cov.config.parallel is False, "the measuring process's own configuration is left alone"


def test_torch_distributed_breakpoint_takes_the_debugger_made_for_it_on_this_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist

    from pytest_sprite.plumbing.dependency_internals import replace_distributed_pdb

    made: list[str] = []

    class Stops:
        def message(self, text: str) -> None:
            made.append(text)

        def set_trace(self) -> None:
            made.append("set_trace")

    monkeypatch.setattr(dist, "_make_distributed_pdb", dist._make_distributed_pdb)  # restored after the test
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    assert replace_distributed_pdb(Stops)
    dist.breakpoint(timeout_s=None)
    assert made[-1] == "set_trace"


ROUTED = """
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pytest_sprite.rank.mutant_backend import called_ops, install

dist.init_process_group(install(None, "gloo"), store=dist.HashStore(), rank=0, world_size=1)
x = torch.arange(4.0)
assert funcol.all_gather_tensor(x, 0, dist.group.WORLD).tolist() == x.tolist()
assert funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD).tolist() == x.tolist()
assert [t.tolist() for t in funcol.all_gather_into_tensor_coalesced([x, x], dist.group.WORLD)] == [x.tolist()] * 2
assert [t.tolist() for t in funcol.reduce_scatter_tensor_coalesced([x], "sum", [0], dist.group.WORLD)] == [
    x.tolist()
]
print(called_ops())
dist.destroy_process_group()
"""


def test_functional_collectives_reach_a_python_process_group_on_this_release() -> None:
    """Run in a child: the routing is for the whole process once made."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ROUTED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == str(
        ["allgather", "reduce_scatter", "allgather", "allgather", "reduce_scatter"]
    )


SCOPED = """
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pytest_sprite.plumbing.dependency_internals import device_stand_in, functional_collectives_routed
from pytest_sprite.subworld.dry_world import BACKEND_NAME, DryProcessGroup, _register

calls = []
answer = DryProcessGroup._allgather_base
DryProcessGroup._allgather_base = lambda self, *args: calls.append("allgather") or answer(self, *args)
assert device_stand_in(0, 2) is not None
_register()
dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=2)
x = torch.arange(4.0)
with functional_collectives_routed() as routed:  # the dry group answers: every rank holds this rank's tensor
    assert routed
    print(funcol.all_gather_single(x, 0, dist.group.WORLD).tolist())
    print(funcol.all_reduce(x, "sum", dist.group.WORLD).tolist())
print(calls)
funcol.all_gather_single(x, 0, dist.group.WORLD).wait()  # torch's own kernel again: the group's CPU backend
print(calls)
dist.destroy_process_group()
"""


def test_functional_collectives_are_routed_for_a_scope_only_on_this_release() -> None:
    """Run in a child: the dry world's backend is registered for the whole process."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SCOPED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines == [
        str([0.0, 1.0, 2.0, 3.0] * 2),
        str([0.0, 1.0, 2.0, 3.0]),
        "['allgather']",
        "['allgather']",
    ]
