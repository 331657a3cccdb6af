"""``bench/dispatch.py`` without its sessions: the ways of the marginal cost run in turns.

The bench itself runs for minutes; these tests check how it orders its sessions, with stand-in commands, in a few
seconds (its ``--baseline`` is ``bench/baseline.py``'s, tested in ``test_bench_baseline.py``).
"""

from __future__ import annotations

import importlib
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
