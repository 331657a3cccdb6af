"""The session store of clean results (issue 22): reuse, the first reuse's check, and its refusal.

A fault case takes the clean arms the session already computed; the first reuse recomputes once and compares
digests, and a recipe whose runs differ (a rank drawing unseeded noise) gets its reuse refused for the rest of
the session, with a message, and every later arm computed in its own test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("lightning")
# Imported here, before pytester's in-process runs snapshot sys.modules: torch cannot be imported twice.
import lightning.pytorch  # noqa: F401
import torch  # noqa: F401

from pytest_sprite.recipes.clean_references import SessionStore, record_digest, run_counts, tally

pytestmark = pytest.mark.cpu


@dataclasses.dataclass(frozen=True)
class _Record:
    figures: tuple[float, ...]
    wall_s: float = 0.0
    source: str | None = None


def test_digest_ignores_wall_time_and_source_only() -> None:
    a = _Record((1.0, 2.0), wall_s=3.0, source="x")
    assert record_digest(a) == record_digest(_Record((1.0, 2.0)))
    assert record_digest(a) != record_digest(_Record((1.0, 2.0 + 2**-40)))


def test_store_computes_once_checks_the_first_reuse_then_reuses(tmp_path: Path) -> None:
    first = SessionStore(tmp_path, test="t::a")
    assert first.begin("k").kind == "compute"
    first.finish("k", _Record((1.0,)))
    second = SessionStore(tmp_path, test="t::b")
    plan = second.begin("k")
    assert (plan.kind, plan.origin) == ("check", "t::a")
    assert second.check("k", _Record((1.0,), wall_s=9.0), "arm x") is None
    plan = SessionStore(tmp_path, test="t::c").begin("k")
    assert (plan.kind, plan.origin) == ("reuse", "t::a")
    assert SessionStore(tmp_path, test="t::c").load("k") == _Record((1.0,))


def test_a_differing_rerun_refuses_reuse_for_the_session(tmp_path: Path) -> None:
    first = SessionStore(tmp_path, test="t::a")
    first.begin("k")
    first.finish("k", _Record((1.0,)))
    second = SessionStore(tmp_path, test="t::b")
    assert second.begin("k").kind == "check"
    message = second.check("k", _Record((1.5,)), "arm single, 32-true")
    assert message is not None and "two fault-free runs of the same clean arm" in message
    assert "t::a" in message and "reuse is refused for the rest of this session" in message
    assert SessionStore(tmp_path, test="t::c").begin("k").kind == "alone"
    assert SessionStore(tmp_path, test="t::c").begin("other").kind == "alone"


def test_a_failed_arm_stores_nothing_and_frees_the_key(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, test="t::a")
    assert store.begin("k").kind == "compute"
    store.finish("k", None)
    assert SessionStore(tmp_path, test="t::b").begin("k").kind == "compute"


def test_runs_are_counted_by_kind(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, test="t::a")
    store.count_run("arm ref, bf16-mixed")
    store.count_run("arm ref, bf16-mixed", kind="check")
    store.count_run("arm ddp, bf16-mixed")
    store.count_run("roles fit, twin, killed", unit="role", units=3)
    assert run_counts(tmp_path) == {"arm": 2, "role": 3, "arm check": 1, "role check": 0}
    assert (
        tally(run_counts(tmp_path)) == "arm runs this session: 2 + 1 reuse check, role runs this session: 3"
    )


RECIPES = '''
import os

import torch
import torch.nn.functional as F
from torch import nn

from pytest_sprite import Recipe


def rows(n):
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
    return [(xs[i], ys[i]) for i in range(n)]


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def seeded():
    return nn.Linear(4, 2)


def noisy():
    """A rank that draws unseeded noise: every build starts from different weights."""
    model = nn.Linear(4, 2)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with torch.no_grad():
        model.bias.add_(torch.randn(2, generator=g))
    return model


SEEDED = Recipe(name="seeded", model=seeded, rows=rows, loss=loss)
NOISY = Recipe(name="noisy", model=noisy, rows=rows, loss=loss)
'''


@pytest.mark.parametrize(
    ("recipe", "says"),
    [
        pytest.param(
            "SEEDED",
            [
                "*test_a: arm single, 32-true: computed in this test (arm runs this session: 1)",
                "*test_b: arm single, 32-true: reuse check passed*test_recipes.py::test_a*",
                "*test_c: arm single, 32-true: reused from test_recipes.py::test_a (arm runs this session: 1 + 1 *",
            ],
            id="deterministic",
            marks=pytest.mark.slow,  # SessionStore's unit tests cover the same path in CI
        ),
        pytest.param(
            "NOISY",
            [
                "*test_a: arm single, 32-true: computed in this test (arm runs this session: 1)",
                "*test_b: arm single, 32-true: reuse refused: two fault-free runs of the same clean arm*",
                "*test_c: arm single, 32-true: computed in this test (arm runs this session: 2 + 1 *",
            ],
            id="nondeterministic",
        ),
    ],
)
def test_the_first_reuse_is_checked(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, recipe: str, says: list[str]
) -> None:
    """Three tests need the same clean arm: the second recomputes it once; the third reuses it, or not."""
    monkeypatch.delenv("SPRITE_REUSE", raising=False)
    monkeypatch.delenv("SPRITE_ARTIFACTS", raising=False)
    pytester.makepyfile(recipes=RECIPES)
    pytester.makepyfile(
        test_recipes=f"""
        from recipes import {recipe} as RECIPE

        def test_a():
            RECIPE.run("single", steps=2, global_batch=4)

        def test_b():
            RECIPE.run("single", steps=2, global_batch=4)

        def test_c():
            RECIPE.run("single", steps=2, global_batch=4)
        """
    )
    report = pytester.path / "report.json"
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-v", "-W", "ignore::DeprecationWarning", f"--sprite-report={report}"
    )
    assert result.parseoutcomes()["passed"] == 3
    result.stdout.fnmatch_lines(says, consecutive=False)
    runs = 1 if recipe == "SEEDED" else 2
    result.stdout.fnmatch_lines(
        [f"sprite: arm runs this session: {runs} + 1 reuse check (--sprite-reuse=auto)"]
    )
    reuse = json.loads(report.read_text())["sprite_reuse"]
    assert reuse == {"mode": "auto", "arm": runs, "role": 0, "arm_check": 1, "role_check": 0}
    if recipe == "NOISY":
        result.stdout.fnmatch_lines(["*ReuseRefusedWarning: two fault-free runs of the same clean arm*"])


@pytest.mark.slow
def test_reuse_off_computes_every_arm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPRITE_REUSE", "off")
    monkeypatch.delenv("SPRITE_ARTIFACTS", raising=False)
    pytester.makepyfile(recipes=RECIPES)
    pytester.makepyfile(
        test_recipes="""
        from recipes import SEEDED

        def test_a():
            SEEDED.run("single", steps=2, global_batch=4)

        def test_b():
            SEEDED.run("single", steps=2, global_batch=4)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v")
    assert result.parseoutcomes()["passed"] == 2
    result.stdout.fnmatch_lines(
        ["*test_b: arm single, 32-true: computed in this test (arm runs this session: 2)"]
    )
    result.stdout.no_fnmatch_line("*reused from*")
    result.stdout.no_fnmatch_line("*reuse check*")


def test_a_bad_reuse_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--sprite-reuse=sometimes")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--sprite-reuse='sometimes': valid values are auto, off*"])


class _Summarised:
    """Enough of a record for ``ArtifactDir.write``."""

    def to_dict(self) -> dict[str, str]:
        return {"arm": "ref32"}

    def summary(self) -> dict[str, str]:
        return {"arm": "ref32"}


def test_an_arm_directory_names_where_its_record_came_from(tmp_path: Path) -> None:
    """``record.json`` says computed or reused from which test, and ``judge`` lists it beside the tables."""
    from pytest_sprite.recipes.artifacts import ArtifactDir
    from pytest_sprite.recipes.clean_references import Origin
    from pytest_sprite.report.rejudge import _origins

    art = ArtifactDir.for_test(tmp_path, "t.py::test_fault")
    reused = art.write(
        art.next_arm_dir(arm="ref32"), _Summarised(), origin=Origin("t.py::test_clean").describe()
    )  # type: ignore[arg-type]
    computed = art.write(art.next_arm_dir(arm="ddp"), _Summarised(), origin=Origin().describe())  # type: ignore[arg-type]
    assert _origins([reused, computed]) == (
        "ref32: reused from t.py::test_clean",
        "ref32: computed in this test",
    )


def test_a_second_test_waits_for_the_result_the_first_is_computing(tmp_path: Path) -> None:
    """Two tests side by side that need the same clean arm: one computes it, the other waits and takes it."""
    import threading

    first = SessionStore(tmp_path, test="t::a")
    assert first.begin("k").kind == "compute"  # holds the key's lock while the arm trains
    plans: list[object] = []
    waiter = threading.Thread(target=lambda: plans.append(SessionStore(tmp_path, test="t::b").begin("k")))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and plans == []  # still waiting on the lock
    first.finish("k", _Record((1.0,)))
    waiter.join(timeout=10)
    (plan,) = plans
    assert (plan.kind, plan.origin) == ("check", "t::a")  # type: ignore[attr-defined]


def test_a_mutant_run_neither_reuses_nor_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``--sprite-mutate`` a stored clean arm must not stand in for the arm a mutant breaks."""
    from pytest_sprite.plumbing import mutants
    from pytest_sprite.recipes.clean_references import reuse_mode

    monkeypatch.setattr(mutants, "_RUN", [])
    assert reuse_mode() == "auto"
    mutants.start_run(None)  # the test's own run: it records, and shares clean results as before
    assert reuse_mode() == "auto"
    mutants.start_run("skip_allreduce")
    assert reuse_mode() == "off"
