"""``bench/baseline.py`` and the benches' ``--baseline``: which checkout a baseline's sessions load, which are
refused, how two sessions' reports and profiles are read side by side; without running a session.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModuleType]:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return {name: importlib.import_module(name) for name in ("baseline", "profile_split", "suite")}


def _checkout(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    shutil.copytree(
        ROOT / "pytest_sprite", base / "pytest_sprite", ignore=shutil.ignore_patterns("__pycache__")
    )
    return base


def test_a_baseline_must_be_a_checkout_that_holds_the_plugin(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit, match=r"--baseline .*no pytest_sprite/plugin\.py there.*git worktree add"):
        bench["baseline"].baseline_env(tmp_path, {}, tmp_path)


def test_a_baseline_checkout_goes_first_on_the_path(bench: dict[str, ModuleType], tmp_path: Path) -> None:
    base = _checkout(tmp_path)

    env, name = bench["baseline"].baseline_env(base, {"PYTHONPATH": "/elsewhere"}, tmp_path)

    assert env["PYTHONPATH"].split(":") == [str(base.resolve()), "/elsewhere"]
    assert name == str(base.resolve())  # not a git checkout: named by its path


def test_a_baseline_that_the_sessions_would_not_load_is_refused(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """Sessions run ``python -m pytest`` in their own folder, which Python puts ahead of ``PYTHONPATH``."""
    base = _checkout(tmp_path)

    with pytest.raises(SystemExit, match=r"imported pytest_sprite from .*, not from the checkout"):
        bench["baseline"].baseline_env(base, {}, ROOT)


def test_a_baseline_without_a_module_an_entry_point_names_is_refused(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """Lightning loads the installed entry points in every fit: an older checkout would fail them all."""
    base = _checkout(tmp_path)
    (base / "pytest_sprite" / "rank" / "fit_phases.py").unlink()

    with pytest.raises(SystemExit) as refused:
        bench["baseline"].baseline_env(base, {}, tmp_path)

    assert str(refused.value) == (
        f"--baseline {base.resolve()}: it has no module for the installed pytest-sprite's entry point "
        "lightning.pytorch.callbacks_factory sprite_fit_phases = pytest_sprite.rank.fit_phases:callbacks, so "
        "its sessions would fail, not be measured; run it from an environment of its own (`pip install -e` "
        "of the checkout in a venv, then `--baseline-python VENV/bin/python` where the bench has it)"
    )


def test_the_suite_bench_profiles_a_baseline_only_when_it_has_the_option(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    base = _checkout(tmp_path)
    args = argparse.Namespace(baseline=base, baseline_python=None, profile=True, order="off,auto")

    first, second = bench["suite"].sessions(args, tmp_path)

    assert first.args == ["--sprite-reuse=auto", "--sprite-profile"] == second.args
    assert first.env is not None and first.env["PYTHONPATH"].startswith(str(base.resolve()))
    assert first.label == f"baseline {base.resolve()}" and second.label == "now" and second.env is None
    options = base / "pytest_sprite" / "glue" / "options.py"
    options.write_text(options.read_text().replace('"--sprite-profile"', '"--sprite-other"'))

    first, _ = bench["suite"].sessions(args, tmp_path)

    assert first.args == ["--sprite-reuse=auto"]


def _report(path: Path, **figures: float) -> Path:
    tests = [
        {"nodeid": f"t::{name}", "outcome": "passed", "duration": 1.0 + i, "assertions": [{"figure": value}]}
        for i, (name, value) in enumerate(figures.items())
    ]
    path.write_text(json.dumps({"tests": tests}))
    return path


def test_two_reports_compare_by_outcomes_and_figures_not_times(
    bench: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _report(tmp_path / "a.json", a=1.0, b=2.0)
    again = _report(tmp_path / "b.json", a=1.0, b=2.0)
    data = json.loads(again.read_text())
    data["tests"][0]["duration"] = 99.0
    again.write_text(json.dumps(data))
    moved = _report(tmp_path / "c.json", a=1.0, b=2.5)

    assert bench["baseline"].print_comparison(first, again) is True
    assert bench["baseline"].print_comparison(first, moved) is False

    assert capsys.readouterr().out.splitlines() == [
        "  verdicts and figures: the same",
        "  verdicts and figures: DIFFER in 1 tests: ['t::b']",
        "    t::b: first difference at .assertions[0].figure: first '2.0' / second '2.5'",
    ]


def test_profiles_print_side_by_side_one_column_a_session(
    bench: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench["profile_split"].print_profiles(
        {
            "baseline abc1234": {"wall": 10.0, "steps": 4.0, "fit setup": 1.0, "fork": 3.0, "session": 20.0},
            "now": {"wall": 8.0, "steps": 4.0, "fork": 1.0, "probe": 0.5},
            "unprofiled": {},
        }
    )

    assert capsys.readouterr().out.splitlines() == [
        "  profile (s)               baseline abc1234               now",
        "  session wall time                     20.0                 -",
        "    outside the fits              15.0 (75%)                 -",
        "    outside the steps             16.0 (80%)                 -",
        "  tests' wall time                      10.0               8.0",
        "    outside the fits               5.0 (50%)         4.0 (50%)",
        "    outside the steps              6.0 (60%)         4.0 (50%)",
        "  the fits' steps                        4.0               4.0",
        "  the tests' other phases",
        "    fit setup                            1.0                 -",
        "    fork                                 3.0               1.0",
        "    probe                                  -               0.5",
    ]


def test_the_benches_import_the_one_baseline_helper() -> None:
    for name in ("dispatch", "suite", "cells"):
        text = (ROOT / "bench" / f"{name}.py").read_text()
        assert "from baseline import" in text and "def baseline_env" not in text, name


def test_a_reports_profile_totals_carry_the_sessions_wall_time(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    report = tmp_path / "r.json"
    report.write_text(
        json.dumps(
            {
                "duration": 30.0,
                "tests": [
                    {"nodeid": "a", "duration": 4.0, "profile": {"steps": 1.0, "rest": 3.0}},
                    {"nodeid": "b", "duration": 2.0, "profile": {"steps": 0.5, "fork": 1.5}},
                    {"nodeid": "plain", "duration": 9.0},
                ],
            }
        )
    )

    assert bench["profile_split"].profile_totals(report) == {
        "wall": 6.0,
        "steps": 1.5,
        "rest": 3.0,
        "fork": 1.5,
        "session": 30.0,
    }
