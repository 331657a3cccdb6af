"""The shipped suite scores itself: ``pytest --pyargs pytest_sprite.suite --sprite-mutate=all`` kills every
mutant that applies to it, except the survivors docs/measurements/mutation.md explains."""

from __future__ import annotations

from functools import partial

import pytest
from sprite_testing import run_pytest
from test_mutation import table

pytestmark = pytest.mark.cpu

run = partial(run_pytest, timeout=1800)

ALLREDUCE = ["skip_allreduce", "allreduce_sum_as_mean", "allreduce_mean_of_world_plus_one", "stale_allreduce"]


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("SPRITE_MUTATE", "SPRITE_MUTATE_FAIL_UNDER", "SPRITE_RANKS"):
        monkeypatch.delenv(name, raising=False)


def test_the_shipped_collectives_test_kills_every_collective_mutant(pytester: pytest.Pytester) -> None:
    """The representative fast path of the shipped suite: on one rank only the mutants that change a world of
    one apply; on two every mutant of a collective it calls is killed."""
    result = run(
        pytester,
        "--pyargs",
        "pytest_sprite.suite.test_collectives",
        "--ranks=2",
        "--sprite-mutate=collective",
    )
    result.assert_outcomes(passed=2)
    assert table(result.stdout.str()) == {
        "test_all_reduce_all_gather_broadcast[ranks1]": {
            "killed": ["allreduce_mean_of_world_plus_one", "stale_allreduce"],
            "not applicable": [
                "skip_allreduce",
                "allreduce_sum_as_mean",
                "broadcast_wrong_source",
                "allgather_swap",
                "reduce_scatter_shift",
            ],
        },
        "test_all_reduce_all_gather_broadcast[ranks2]": {
            "killed": [*ALLREDUCE, "broadcast_wrong_source", "allgather_swap"],
            "not applicable": ["reduce_scatter_shift"],
        },
    }
    result.stdout.fnmatch_lines(["mutation score: 1.00, 8 killed of 8 applicable"])


@pytest.mark.slow
def test_the_shipped_suites_clean_checks_kill_every_mutant_but_the_explained(
    pytester: pytest.Pytester,
) -> None:
    """The suite's clean checks at two ranks under every mutant (about 2.5 minutes on 2 cores): the parity
    and criterion checks kill all that apply; the resume check lets the five survive that the measurements
    page explains (the same loss bug in the resumed and the uninterrupted fit, a gather of identical
    shapes, a stale buffer seen only in the continuation's gradients, which it measures but does not
    require, and the RNG state, which it reports but does not require)."""
    result = run(
        pytester,
        "--pyargs",
        "pytest_sprite.suite",
        "--ranks=2",
        "--sprite-mutate=all",
        "-k",
        "test_all_reduce_all_gather_broadcast or test_lora_parity or test_criterion_v2_clean "
        "or (test_resume and ddp-32-true and not fault)",
    )
    result.assert_outcomes(passed=5)
    got = table(result.stdout.str())
    collective = [*ALLREDUCE, "broadcast_wrong_source", "allgather_swap", "reduce_scatter_shift"]
    assert got["test_criterion_v2_clean[ranks2]"]["killed"] == [
        *collective,
        "missing-rank",
        "wrong-scale",
        "scale-grad",
    ]
    assert got["test_lora_parity[ranks2]"]["killed"] == [*collective, "missing-rank", "wrong-scale"]
    resume = got["test_resume[ranks2-ddp-32-true]"]
    assert resume["killed"] == [
        "skip_allreduce",
        "allreduce_sum_as_mean",
        "allreduce_mean_of_world_plus_one",
        "broadcast_wrong_source",
        "dropped-optimizer-state",
        "reset-lr-scheduler",
        "perturbed-weight",
    ]
    # unrestored-rng: the tiny recipe draws no random numbers after its restore, and the check only reports RNG
    assert resume["survived"] == [
        "stale_allreduce",
        "allgather_swap",
        "missing-rank",
        "wrong-scale",
        "unrestored-rng",
    ]
