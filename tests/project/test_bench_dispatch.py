"""``bench/dispatch.py`` without its sessions: the ways of the marginal cost run in turns, and ``--baseline``.

The bench itself runs for minutes; these tests check how it orders its sessions and which checkout a
baseline's sessions load, with stand-in commands, in a few seconds.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dispatch(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("dispatch")


def _note(log: Path, line: str) -> list[str]:
    return [sys.executable, "-c", f"open({str(log)!r}, 'a').write({line + chr(10)!r})"]


def test_each_round_runs_one_pair_of_every_way_in_turn(dispatch: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "log"
    ways = [
        dispatch.Sessions(name, _note(log, f"{name} short"), _note(log, f"{name} long"), {})
        for name in ("a", "b")
    ]
    spawned: list[int] = []

    def spawn() -> float:
        spawned.append(1)
        log.open("a").write("spawn\n")
        return 1.0

    marginals = dispatch.marginal_of(2, ways, tmp_path, extra_tests=10, spawn=spawn, spawns=1)

    assert log.read_text().splitlines() == ["a short", "a long", "spawn", "b short", "b long", "spawn"] * 2
    assert set(marginals) == {"a", "b"}
    assert all(len(m.round_spawns_per_test) == 2 and len(m.spawns) == 2 for m in marginals.values())


def test_a_baseline_must_be_a_checkout_that_holds_the_plugin(dispatch: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--baseline .*no pytest_sprite/plugin\.py there.*git worktree add"):
        dispatch.baseline_env(tmp_path, {}, tmp_path)


def test_a_baseline_checkout_goes_first_on_the_path(dispatch: ModuleType, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(ROOT / "pytest_sprite", base / "pytest_sprite")

    env, name = dispatch.baseline_env(base, {"PYTHONPATH": "/elsewhere"}, tmp_path)

    assert env["PYTHONPATH"].split(":") == [str(base.resolve()), "/elsewhere"]
    assert name == str(base.resolve())  # not a git checkout: named by its path


def test_a_baseline_that_the_sessions_would_not_load_is_refused(dispatch: ModuleType, tmp_path: Path) -> None:
    """Sessions run ``python -m pytest`` in their own folder, which Python puts ahead of ``PYTHONPATH``."""
    base = tmp_path / "base"
    shutil.copytree(ROOT / "pytest_sprite", base / "pytest_sprite")

    with pytest.raises(SystemExit, match=r"imported pytest_sprite from .*, not from the checkout"):
        dispatch.baseline_env(base, {}, ROOT)
