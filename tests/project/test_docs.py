"""The docs cannot lie: every Python example in README.md and docs/ runs, and the site builds with -W.

Each fenced ``python`` block is an example. A comment on the line before the fence says how it runs:

- ``<!-- example: run -->`` (the default for a block that defines ``test_`` functions): the block is saved as
  its own test file and run in one pytester session with ``--ranks=4``; every test in it must pass.
- ``<!-- example: slow -->``: the same, in a second session that runs only with ``--run-slow`` (examples that
  train models: minutes on 2 cores). Both sessions pass ``--torch-tests=ranks``, so a torch
  ``MultiProcessTestCase`` class runs on ranks, one test per ``test_`` method.
- ``<!-- example: conftest -->``: the block is the fast session's ``conftest.py`` (a hook example).
- ``<!-- example: fragment -->`` (the default for a block without tests): compiled, its names imported from
  ``pytest_sprite`` checked against ``__all__``, and its imports executed in the slow session.

Options: every option the reference names exists, and every option the plugin registers is documented.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)])
KINDS = ("run", "slow", "conftest", "fragment")
FENCE = re.compile(r"^(`{3,})python\s*$")
DIRECTIVE = re.compile(r"^<!--\s*example:\s*(\w+)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    kind: str
    code: str

    @property
    def name(self) -> str:
        rel = self.page.relative_to(ROOT).with_suffix("")
        return "doc_" + re.sub(r"\W", "_", str(rel)).lower() + f"_l{self.line}"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            start, end = i + 1, i + 1
            while end < len(lines) and lines[end].rstrip() != m.group(1):
                end += 1
            code = "\n".join(lines[start:end]) + "\n"
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            d = DIRECTIVE.match(before)
            kind = d.group(1) if d else ("run" if re.search(r"^def test_", code, re.M) else "fragment")
            found.append(Example(page, start, kind, code))
            i = end + 1
    return found


EXAMPLES = examples()


def by_kind(*kinds: str) -> list[Example]:
    return [e for e in EXAMPLES if e.kind in kinds]


def test_every_example_has_a_known_kind_and_compiles() -> None:
    assert len(EXAMPLES) >= 10, "the collector found almost no examples: has the fence syntax changed?"
    for e in EXAMPLES:
        assert e.kind in KINDS, f"{e.where}: unknown example kind {e.kind!r}; use one of {KINDS}"
        compile(e.code, e.where, "exec")


def test_names_imported_from_pytest_sprite_are_public() -> None:
    import importlib.util

    import pytest_sprite

    for e in EXAMPLES:
        for node in ast.walk(ast.parse(e.code)):
            if isinstance(node, ast.ImportFrom) and node.module == "pytest_sprite":
                for alias in node.names:
                    assert alias.name in pytest_sprite.__all__, (
                        f"{e.where}: pytest_sprite.{alias.name} is not public"
                    )
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pytest_sprite."):
                assert importlib.util.find_spec(node.module), f"{e.where}: no module {node.module}"


def write_examples(pytester: pytest.Pytester, chosen: list[Example]) -> None:
    for e in chosen:
        if e.kind == "conftest":
            pytester.makeconftest(e.code)
        else:
            pytester.makepyfile(**{f"test_{e.name}": e.code})


def run_session(pytester: pytest.Pytester, timeout: float, *args: str) -> pytest.RunResult:
    """``--torch-tests=ranks``: a page's torch ``MultiProcessTestCase`` runs on ranks, as the page says it does."""
    return run_pytest(
        pytester, "--ranks=4", "--sprite-device=cpu", "--torch-tests=ranks", "-rfE", *args, timeout=timeout
    )


def assert_all_passed(result: pytest.RunResult, expected: int) -> None:
    outcomes = result.parseoutcomes()
    bad = {k: v for k, v in outcomes.items() if k not in ("passed", "warnings", "warning")}
    assert not bad and outcomes.get("passed") == expected, result.stdout.str()[-6000:]


def count_tests(chosen: list[Example]) -> int:
    """Tests a set of example files collects at --ranks=4 (a ranks list is one test per size)."""
    total = 0
    for e in chosen:
        for node in ast.parse(e.code).body:
            if isinstance(node, ast.ClassDef):  # a unittest class: one test per test_ method
                total += sum(isinstance(n, ast.FunctionDef) and n.name.startswith("test_") for n in node.body)
                continue
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            n = 1
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith(
                    ("mark.ranks", "mark.parametrize")
                ):
                    arg = deco.args[-1] if ast.unparse(deco.func).endswith("parametrize") else deco.args[0]
                    if isinstance(arg, ast.List | ast.Tuple):
                        n *= len(arg.elts)
            total += n
    return total


@pytest.mark.hypothesis_plugin
def test_fast_examples_pass(pytester: pytest.Pytester) -> None:
    chosen = by_kind("run", "conftest")
    write_examples(pytester, chosen)
    result = run_session(pytester, 300, "--sprite-report=report.json")
    assert_all_passed(result, count_tests(chosen))
    assert json.loads((pytester.path / "report.json").read_text())["schema_version"] == 1


@pytest.mark.slow
def test_slow_examples_pass(pytester: pytest.Pytester) -> None:
    chosen = by_kind("slow")
    write_examples(pytester, chosen)
    for e in by_kind("fragment"):  # the fragments' imports resolve in a real session
        imports = [n for n in ast.parse(e.code).body if isinstance(n, ast.Import | ast.ImportFrom)]
        body = "\n".join(f"    {ast.unparse(n)}" for n in imports) or "    pass"
        pytester.makepyfile(**{f"test_{e.name}_imports": f"def test_imports():\n{body}\n"})
    result = run_session(pytester, 3600)
    assert_all_passed(result, count_tests(chosen) + len(by_kind("fragment")))


def sprite_options_from_help() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    group = out.stdout.split("(pytest-sprite):", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^  (--[\w-]+)", group, re.M))


def test_the_options_reference_lists_exactly_the_plugins_options() -> None:
    text = (DOCS / "reference" / "options.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(--[\w-]+)", text, re.M))
    registered = sprite_options_from_help()
    assert documented - registered == set(), "documented options the plugin does not have"
    assert registered - documented == set(), "options the plugin has that docs/reference/options.md lacks"


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    pytest.importorskip("sphinx", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("myst_parser", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("furo", reason="the docs extra is not installed: pip install -e '.[docs]'")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    import pytest_sprite

    api = (tmp_path / "reference" / "api.html").read_text(encoding="utf-8")
    documented = set(re.findall(r'id="pytest_sprite\.(\w+)"', api))
    assert set(pytest_sprite.__all__) - documented == set(), "public names missing from the API page"
    shutil.rmtree(tmp_path / ".doctrees", ignore_errors=True)


def test_the_readmes_links_lead_to_files() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to nothing"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert missing == []
