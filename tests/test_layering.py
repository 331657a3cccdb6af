"""Every import inside pytest_sprite points down (issue 8): read from the source with ast, no module imported.

Lazy imports inside functions and ``TYPE_CHECKING`` imports count as arrows too: a loop that only a lazy
import keeps from crashing is still a loop.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_sprite

pytestmark = pytest.mark.cpu

ROOT = Path(pytest_sprite.__file__).parent
PACKAGE = "pytest_sprite"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> Iterator[str]:
    """The pytest_sprite modules an import statement loads (a package's submodule when it names one)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        yield sub if sub in MODULES else target


def imports(module: str) -> set[str]:
    """Every pytest_sprite module that ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _resolve(module, node, path.name == "__init__.py"):
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    found.add(target)
    found.discard(module)
    return found


def _in(module: str, *areas: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in areas)


def _p(name: str) -> str:
    return f"{PACKAGE}.{name}"


@pytest.mark.parametrize(
    ("area", "allowed"),
    [
        # The code under test never imports the plugin: only rank detection, the device chooser and errors.
        ("lightning", ("lightning", "_rankenv", "_device", "errors")),
        # The assertions judge records and the fault registry; they never reach the recipes or the harness.
        # ... and record their results through the one results module (issue 13).
        ("assertions", ("assertions", "records", "faults", "errors", "_ranges", "_timing", "_results")),
        # The recipes train arms: records, faults, the code under test, the world; never the assertions.
        (
            "recipes",
            (
                "recipes",
                "records",
                "faults",
                "errors",
                "lightning",
                "world",
                "subworld",
                "_device",
                "_process",
                "_settings",
                "_timing",
                "_results",
            ),
        ),
        # Results and progress lines: stdlib and pytest, plus the in-rank world to know the rank.
        ("_results", ("world",)),
        # Sub-worlds fork fresh ranks: the world they hand the function, device choice, rank variables,
        # the process plumbing every fork shares, the one frame module and the one tail reader (issue 21).
        (
            "subworld",
            (
                "world",
                "errors",
                "_device",
                "_rankenv",
                "_ranges",
                "_timing",
                "_process",
                "_placement",
                "protocol",
                "_output",
            ),
        ),
        ("records", ("errors",)),
        ("faults", ("errors",)),
        ("_device", ()),
    ],
)
def test_area_imports_only_what_lies_below_it(area: str, allowed: tuple[str, ...]) -> None:
    members = [m for m in MODULES if _in(m, _p(area))]
    assert members, f"no module in {area}"
    bad = {
        m: sorted(t for t in imports(m) if not _in(t, *map(_p, allowed)) and not _in(t, _p(area)))
        for m in members
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_assertions_and_recipes_never_import_each_other() -> None:
    for side, other in (("assertions", "recipes"), ("recipes", "assertions")):
        for m in MODULES:
            if _in(m, _p(side)):
                assert not any(_in(t, _p(other)) for t in imports(m)), (m, sorted(imports(m)))


def test_no_import_loop_through_the_recipes_assertions_or_lightning() -> None:
    graph = {m: imports(m) & set(MODULES) for m in MODULES}
    mine = ("recipes", "assertions", "lightning", "records", "faults", "_device")
    loops = []
    for start in (m for m in MODULES if _in(m, *map(_p, mine))):
        stack: list[tuple[str, tuple[str, ...]]] = [(start, (start,))]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    loops.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert loops == []


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    assert _p("recipes._arm") in imports(_p("recipes.recipe"))  # imported inside run_recipe()
    assert _p("recipes.constants") in imports(_p("recipes._model"))
    assert _p("errors") in imports(_p("records"))
