"""The extension hooks, each used the way a project would: from its conftest.py, in a pytest session.

A project adds a launcher, a planted fault and a report table through the hooks in ``hookspecs.py``; the
built-in ones register through the same hooks, so a project's sits beside them in every list and error.
"""

from __future__ import annotations

import json

import pytest
from sprite_testing import clear_rank_variables, needs_mpiexec, run_pytest

pytestmark = pytest.mark.cpu

BUILTIN_LAUNCHERS = "local, mpiexec, pals, srun, torchrun"


def test_a_conftest_adds_a_launcher_that_the_session_validates_and_uses(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from pytest_sprite.errors import LaunchError

        class FluxLauncher:
            name = "flux"
            spans_nodes = True

            def check(self):
                raise LaunchError("flux: 'flux run' is not on PATH; load the flux module")

            def launch(self, request):
                raise AssertionError("check() refused first")

        def pytest_sprite_add_launchers(launchers):
            launchers.add("flux", FluxLauncher)
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_two(world):
            pass
        """
    )
    unknown = run_pytest(pytester, "--launcher=flxu", timeout=120)
    assert unknown.ret == pytest.ExitCode.USAGE_ERROR
    unknown.stderr.fnmatch_lines(
        [f"*--launcher='flxu' is not a known launcher; valid launchers: {BUILTIN_LAUNCHERS}, flux"]
    )
    used = run_pytest(pytester, "--launcher=flux", "--ranks=2", timeout=120)
    assert used.ret != pytest.ExitCode.OK
    assert "flux: 'flux run' is not on PATH; load the flux module" in used.stdout.str() + used.stderr.str()


@needs_mpiexec
def test_a_project_launcher_runs_the_tests_and_its_name_goes_into_a_valid_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jsonschema

    from pytest_sprite.report.json_report import load_schema

    clear_rank_variables(monkeypatch)
    pytester.makeconftest(
        """
        from pytest_sprite.launch.launchers.mpiexec import MpiexecLauncher

        class HydraLauncher(MpiexecLauncher):
            name = "hydra"
            program_name = "mpiexec"

        def pytest_sprite_add_launchers(launchers):
            launchers.add("hydra", HydraLauncher)
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_two(world):
            assert world.size == 2
        """
    )
    result = run_pytest(pytester, "--launcher=hydra", "--ranks=2", "--sprite-report=report.json", timeout=120)
    result.assert_outcomes(passed=1)
    document = json.loads((pytester.path / "report.json").read_text())
    assert document["environment"]["launcher"] == "hydra"
    jsonschema.validate(document, load_schema())


def test_a_conftest_adds_a_fault_that_the_arms_plant_and_expect_fault_rejected_judges(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(
        """
        from pytest_sprite.planted_faults import Fault, Planter

        class SkipAllReduce(Planter):
            def skip_step(self, step, steps, site):
                return site.rank == 1

        def pytest_sprite_add_faults(faults):
            faults.add(Fault(name="skipped-allreduce", description="rank 1 never steps", arms=("ddp",),
                             by=("synchronized",), planter=SkipAllReduce()))
        """
    )
    pytester.makepyfile(
        """
        import pytest
        from pytest_sprite import expect_fault_rejected
        from pytest_sprite.assertions.evidence import AssertionFailure, FailedCheck
        from pytest_sprite.errors import SpriteUsageError
        from pytest_sprite.planted_faults import PlantSite, get_fault, plant, registered_faults

        def test_registered_beside_the_builtins():
            names = list(registered_faults())
            assert names[0] == "missing-rank" and names[-1] == "skipped-allreduce"

        def test_planted_on_its_arms_only():
            site = PlantSite(arm="ddp", rank=1, world_size=2, accumulate=1)
            assert plant("skipped-allreduce", site).skip_step(0, 1, site)
            with pytest.raises(SpriteUsageError, match="applies to arms ddp, not 'fsdp'"):
                plant("skipped-allreduce", PlantSite(arm="fsdp", rank=1, world_size=2, accumulate=1))
            with pytest.raises(SpriteUsageError, match="known faults: .*unrestored-rng, skipped-allreduce"):
                get_fault("skiped-allreduce")

        def test_judged_by_its_checks():
            failed = (FailedCheck(arm="ddp (fault skipped-allreduce)", check="synchronized",
                                  fault="skipped-allreduce", detail="rank 1 differs"),)
            with expect_fault_rejected("skipped-allreduce") as rejection:
                raise AssertionFailure("ddp: not synchronized", failed=failed, result=None)
            assert rejection.evidence.checks == ("synchronized",)
        """
    )
    result = run_pytest(pytester, timeout=120)
    result.assert_outcomes(passed=3)


def test_a_conftest_adds_the_report_table_of_its_assertion_kind(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from pytest_sprite.report.kinds import Kind, Row

        def latency_rows(payload):
            verdict = "pass" if payload["passed"] else "FAIL"
            return [Row(cells=(f"{payload['p99_ms']:.1f}",), verdict=verdict,
                        figures={"p99_ms": payload["p99_ms"]}, label="p99")]

        def pytest_sprite_add_report_tables(tables):
            tables.add(Kind(kind="latency", title="Latency (p99 under budget)", headers=("p99 ms",),
                            rows=latency_rows, bad_verdicts=frozenset({"FAIL"})))
        """
    )
    pytester.makepyfile(
        """
        from pytest_sprite import record_assertion

        class Latency:
            def to_dict(self):
                return {"kind": "latency", "passed": True, "p99_ms": 12.25}

        def test_fast():
            record_assertion(Latency())
        """
    )
    result = run_pytest(pytester, timeout=120)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*Latency (p99 under budget)*", "*test_fast*12.2*pass*"])
