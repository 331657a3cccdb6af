"""Every import inside pytest_sprite points down, and no module or function outgrows one concern.

Read from the source with ast, no module imported.

The rules: each package imports only the packages its entry in ``RULES`` names, and no module reaches
itself through its imports (0 import circles). Lazy imports inside functions and ``TYPE_CHECKING`` imports
count as arrows too: a loop that only a lazy import keeps from crashing is still a loop.
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


RULES: dict[str, tuple[str, ...]] = {
    # Stdlib-only plumbing both sides share: frames, clock, ranges, tails, processes, placement.
    "plumbing": (),
    # The rank environment: every launcher's variables read once, and the device chooser.
    "env": ("errors",),
    # Records and the fault registry are plain data.
    "records": ("errors",),
    "planted_faults": ("errors",),
    # Old names kept for one release: each only asks the plumbing to alias it.
    "faults": ("plumbing",),
    "chaos": ("plumbing",),
    # The in-rank world knows nothing of the harness around it; it pickles with the plumbing's tensor bytes.
    "world": ("plumbing",),
    # The pytest glue: options, markers, tmp_path, results kept with items, pytest's internals.
    "glue": ("env", "errors", "plumbing", "world"),
    # The code under test never imports the plugin: only rank detection, the device chooser and errors.
    "lightning": ("env", "errors"),
    # Sub-worlds fork fresh ranks and hand them a world.
    "subworld": ("env", "errors", "plumbing", "world"),
    # The assertions judge records and the fault registry; never the recipes or the harness.
    "assertions": ("errors", "planted_faults", "glue", "plumbing", "records"),
    # The recipes train arms with the code under test; never the assertions.
    "recipes": (
        "env",
        "errors",
        "planted_faults",
        "glue",
        "lightning",
        "plumbing",
        "records",
        "subworld",
        "world",
    ),
    # A test child and its agent: one side of the protocol (and the fault registry's planters as mutants).
    "rank": ("env", "errors", "planted_faults", "glue", "plumbing", "subworld", "world"),
    # The controller side: launchers, the pool, the scheduler, merging reports.
    "launch": ("env", "errors", "glue", "plumbing", "rank"),
    # Crash consistency: targets that train with the recipes, judged by the assertions.
    "save_crashes": ("assertions", "env", "errors", "lightning", "plumbing", "recipes", "subworld", "world"),
    # Reports render the assertions' results and re-judge stored records.
    "report": ("assertions", "errors", "glue", "plumbing", "recipes", "records"),
    # torch's multiprocess test classes as ranks tests.
    "torch_tests": ("errors", "glue", "plumbing"),
    # Hosts on one machine: namespaces and a launcher, nothing of the harness but where the package lives.
    "hosts": ("errors", "plumbing"),
}
"""One rule per package: what it may import from the rest of pytest_sprite."""

FACES = (
    "__init__",
    "__main__",
    "plugin",
    "hookspecs",
    "fixtures",
    "errors",
    "world",
    "planted_faults",
    "faults",
    "chaos",
)
"""The modules at the root: the faces a user meets (two of them old names of renamed ones). Everything else lives
in a package named for its role."""


def test_the_root_holds_only_the_faces_a_user_meets() -> None:
    root = Path(pytest_sprite.__file__).parent
    modules = sorted(p.stem for p in root.glob("*.py"))
    assert modules == sorted(FACES)


def test_every_package_has_a_rule() -> None:
    root = Path(pytest_sprite.__file__).parent
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists() and p.name != "suite")
    assert packages == sorted(area for area in RULES if area not in FACES)


@pytest.mark.parametrize(("area", "allowed"), sorted(RULES.items()))
def test_area_imports_only_what_lies_below_it(area: str, allowed: tuple[str, ...]) -> None:
    members = [m for m in MODULES if _in(m, _p(area))]
    assert members, f"no module in {area}"
    bad = {
        m: sorted(t for t in imports(m) if not _in(t, *map(_p, allowed)) and not _in(t, _p(area)))
        for m in members
    }
    assert {m: t for m, t in bad.items() if t} == {}


def _private_module(module: str) -> bool:
    return module.rpartition(".")[2].startswith("_") and not module.endswith("__init__")


def test_a_leading_underscore_module_is_imported_only_inside_its_package() -> None:
    """The rule CONTRIBUTING.md states: ``_x.py`` is private to the package that holds it."""
    outside = {
        m: sorted(t for t in imports(m) if _private_module(t) and not _in(m, t.rpartition(".")[0]))
        for m in MODULES
    }
    assert {m: t for m, t in outside.items() if t} == {}


def test_the_underscore_rule_sees_a_reach_into_another_package() -> None:
    assert _private_module("pytest_sprite.recipes._arm")
    assert not _private_module("pytest_sprite.recipes.fit_kit")
    assert not _in("pytest_sprite.report.terminal", "pytest_sprite.assertions")


def test_assertions_and_recipes_never_import_each_other() -> None:
    for side, other in (("assertions", "recipes"), ("recipes", "assertions")):
        for m in MODULES:
            if _in(m, _p(side)):
                assert not any(_in(t, _p(other)) for t in imports(m)), (m, sorted(imports(m)))


def test_no_import_loop_through_the_recipes_assertions_or_lightning() -> None:
    graph = {m: imports(m) & set(MODULES) for m in MODULES}
    mine = ("recipes", "assertions", "lightning", "records", "planted_faults", "_device")
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


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles_anywhere() -> None:
    """No module reaches itself through its imports, lazy ones included: 0 import circles in the package."""
    graph = {m: {t for t in imports(m) if t in MODULES} for m in MODULES}
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    assert _p("recipes._arm") in imports(_p("recipes.recipe"))  # imported inside run_recipe()
    assert _p("recipes.constants") in imports(_p("recipes._model"))
    assert _p("errors") in imports(_p("records"))


MODULE_LINES = 600
"""A module longer than this holds more than one concern: split it by what each part decides."""
FUNCTION_LINES = 60
"""A function longer than this does more than one thing: name the parts."""


def _sizes() -> tuple[list[str], list[str]]:
    modules, functions = [], []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT.parent)
        if len(text.splitlines()) > MODULE_LINES:
            modules.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_LINES:
                    functions.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return modules, functions


def test_no_module_over_600_lines_and_no_function_over_60() -> None:
    modules, functions = _sizes()
    assert not modules, f"modules over {MODULE_LINES} lines: {modules}"
    assert not functions, f"functions over {FUNCTION_LINES} lines: {functions}"
