"""assert_crash_consistent in a ranks test: every rank calls it, every run is a sub-world of the test's ranks."""

from __future__ import annotations

import json

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

TIMEOUT = 400


def test_every_rank_is_a_crash_candidate_in_a_ranks_test(pytester: pytest.Pytester) -> None:
    pytest.importorskip("torch")
    pytester.makepyfile(
        test_ranks_chaos="""
        from pathlib import Path

        import pytest
        from pytest_sprite import assert_crash_consistent, crash_fn
        from pytest_sprite.save_crashes.protocols import train_rank0_rename

        def on_rank_1(event):
            return event.rank == 1

        @pytest.mark.ranks(2)
        def test_rank0_rename(world):
            out = Path(__file__).parent / "chaos"  # one folder every rank sees
            m = assert_crash_consistent(crash_fn(train_rank0_rename), out_dir=out, select=on_rank_1)
            assert m.ranks == 2 and m.passed
            assert world.gather_object(m.summary()) == [m.summary()] * 2  # the same matrix on every rank
        """
    )
    result = run_pytest(pytester, timeout=TIMEOUT)
    result.assert_outcomes(passed=1)
    stored = json.loads((pytester.path / "chaos" / "matrix.json").read_text())
    rows = stored["rows"]
    # rank 1 writes only its optimizer file into each save; it dies there, untorn and torn, in both saves
    # (and at the mkdir of a .tmp folder when it was the first to create it: a race between the ranks)
    assert {(r["event"], r["file"]) for r in rows if r["event"] == "mkdir"} <= {
        ("mkdir", "ckpt-2.tmp"),
        ("mkdir", "ckpt-4.tmp"),
    }
    assert [(r["rank"], r["file"], r["torn"], r["verdict"]) for r in rows if r["event"] != "mkdir"] == [
        (1, "ckpt-2.tmp/optim-1.pt", False, "PASS"),
        (1, "ckpt-2.tmp/optim-1.pt", True, "PASS"),
        (1, "ckpt-4.tmp/optim-1.pt", False, "PASS"),
        (1, "ckpt-4.tmp/optim-1.pt", True, "PASS"),
    ]
    assert all(r["verdict"] == "PASS" for r in rows)
    # A point is "rank 1's n-th event" of the fault-free run. Which rank makes a .tmp folder is a race, so
    # in a crashed run rank 1's n-th event can be another one, or never come: the row then says so.
    assert any(r["crashed"] and r["rank"] == 1 for r in rows)
    assert all(r["crashed"] or "not reached" in r["note"] for r in rows)
    assert all(
        r["note"] == "" or "not reached" in r["note"] or r["note"].startswith("died at ") for r in rows
    )
