"""Another checkout of the plugin beside this one in the same bench run (``--baseline CHECKOUT``), and the two
sessions' reports compared.

The benches that time a change read it side by side, not across days: ``bench/dispatch.py``,
``bench/suite.py`` and ``bench/cells.py`` run the baseline's sessions with the same Python, the checkout first
on ``PYTHONPATH`` (``git worktree add /tmp/base <commit>``, then ``--baseline /tmp/base``). A checkout is
refused before anything is measured when its plugin would not be the one a session imports, or when it
lacks a module that this installation's entry points name (Lightning loads ``callbacks_factory`` entry
points in every fit: a checkout older than one of them would fail every fit, not measure it); such a
checkout runs from its own environment (``bench/suite.py --baseline-python``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "baseline_env",
    "checkout_of",
    "comparable",
    "first_difference",
    "on_path",
    "print_comparison",
    "takes_option",
    "verdicts",
]

_CHECK = """
import importlib.metadata, importlib.util, sys
import pytest_sprite.plugin as p
print(p.__file__)
for ep in importlib.metadata.distribution("pytest-sprite").entry_points:
    if importlib.util.find_spec(ep.module) is None:
        print(f"entry point {ep.group} {ep.name} = {ep.value}", file=sys.stderr)
        sys.exit(3)
"""


def on_path(folder: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``folder`` first on ``PYTHONPATH``."""
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, (str(folder), env.get("PYTHONPATH")))))


def baseline_env(checkout: Path, env: dict[str, str], cwd: Path) -> tuple[dict[str, str], str]:
    """The environment that runs another checkout's plugin, and what to call it (its commit where git knows it).

    The checkout goes first on ``PYTHONPATH``, ahead of the installed plugin; a checkout that does not hold
    the plugin, whose plugin a Python started in ``cwd`` (where the sessions run: ``python -m`` puts it
    first on the path) does not import from there, or that lacks a module an installed entry point names,
    is refused before anything is measured.
    """
    checkout = checkout.resolve()
    if not (checkout / "pytest_sprite" / "plugin.py").is_file():
        raise SystemExit(
            f"--baseline {checkout}: no pytest_sprite/plugin.py there; give the root of a pytest-sprite "
            "checkout, e.g. `git worktree add /tmp/base <commit>` and `--baseline /tmp/base`"
        )
    with_base = on_path(checkout, env)
    found = subprocess.run(
        [sys.executable, "-c", _CHECK], env=with_base, cwd=cwd, capture_output=True, text=True
    )
    if found.returncode == 3:
        raise SystemExit(
            f"--baseline {checkout}: it has no module for the installed pytest-sprite's "
            f"{found.stderr.strip().splitlines()[-1]}, so its sessions would fail, not be measured; run it "
            "from an environment of its own (`pip install -e` of the checkout in a venv, then "
            "`--baseline-python VENV/bin/python` where the bench has it)"
        )
    if (
        found.returncode != 0
        or Path(found.stdout.strip()).resolve() != checkout / "pytest_sprite" / "plugin.py"
    ):
        raise SystemExit(
            f"--baseline {checkout}: Python imported pytest_sprite from "
            f"{found.stdout.strip() or found.stderr.strip()[-300:]!r}, not from the checkout"
        )
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return with_base, commit.stdout.strip() if commit.returncode == 0 else str(checkout)


def checkout_of(python: str, env: dict[str, str] | None = None) -> Path:
    """The folder that holds the ``pytest_sprite`` which ``python`` imports (a checkout, or site-packages).

    Asked from ``/``: ``python -c`` puts the working folder first on its path, so asked from this checkout
    it answered this checkout, and the bench passed a baseline options it lacks.
    """
    found = subprocess.run(
        [python, "-c", "import pytest_sprite as p; print(p.__file__)"],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(found.stdout.strip()).resolve().parents[1]


def takes_option(checkout: Path, option: str) -> bool:
    """Whether the plugin in ``checkout`` registers ``option`` (an earlier commit may not have it)."""
    return any(
        f'"{option}"' in p.read_text(errors="replace") for p in (checkout / "pytest_sprite").rglob("*.py")
    )


VOLATILE = (
    "profile",
    "wall",
    "duration",
    "time",
    "timing",
    "start",
    "stop",
    "source",
    "path",
    "dir",
    "created",
    "pid",
    "host",
    "busy",
)
"""Report keys whose values differ between two runs of the same checks (left out of the comparison)."""


def comparable(value: Any) -> Any:
    """The report without the values that differ between two runs of the same checks."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if not any(word in k.lower() for word in VOLATILE)}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def verdicts(report: Path) -> dict[str, Any]:
    """Each test of a ``--sprite-report`` document by node id: its outcome and figures, nothing volatile."""
    document = json.loads(report.read_text())
    return {t["nodeid"]: comparable(t) for t in document.get("tests", [])}


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two report values first differ, as a key path with both values (shortened)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path or '.'}: first {str(a)[:120]!r} / second {str(b)[:120]!r}"


def print_comparison(first: Path, second: Path, indent: str = "  ") -> bool:
    """Print whether two sessions' reports hold the same outcomes and figures (and where they first differ)."""
    before, after = verdicts(first), verdicts(second)
    differing = sorted(n for n in set(before) | set(after) if after.get(n) != before.get(n))
    print(
        f"{indent}verdicts and figures: "
        + ("the same" if not differing else f"DIFFER in {len(differing)} tests: {differing[:5]}")
    )
    for nodeid in differing[:3]:
        print(
            f"{indent}  {nodeid}: first difference at {first_difference(before.get(nodeid), after.get(nodeid))}"
        )
    return not differing
