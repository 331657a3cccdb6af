"""Bad input gets an error that names the problem and the fix."""

from __future__ import annotations

import pytest
from sprite_testing import fnescape

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            "ranks(0)",
            'the world size must be a positive int, "world" or a non-empty list of them, got 0 (a int)',
        ),
        (
            "ranks(-1)",
            'the world size must be a positive int, "world" or a non-empty list of them, got -1 (a int)',
        ),
        (
            'ranks("four")',
            "the world size must be a positive int, \"world\" or a non-empty list of them, got 'four' (a str)",
        ),
        ("ranks([])", "the list of world sizes is empty"),
        ("ranks([2, 0])", 'every world size must be a positive int or "world", got 0 (a int) in [2, 0]'),
        ("ranks(True)", "got True (a bool)"),
        ("ranks(2, timeout=-5)", "timeout= must be a number of seconds > 0, got -5"),
        ("ranks(2, init=0)", "init= must be True or False, got 0 (a int)"),
        ("ranks(2, tiemout=5)", "unknown keyword tiemout; the keywords are timeout=SECONDS and init=False"),
        ("ranks()", "takes exactly one world size or list of sizes, got 0 arguments"),
    ],
)
def test_bad_marker_is_a_collection_error_naming_the_test(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_bad():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            fnescape(
                "@pytest.mark.ranks(...) on test_bad_marker_is_a_collection_error_naming_the_test.py::test_bad: "
            )
            + "*"
            + fnescape(message)
            + "*"
        ]
    )
    assert "During handling" not in result.stdout.str()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--ranks=0"], {}, "--ranks must be a positive integer (1, 2, 24, ...), got '0'"),
        (["--ranks=four"], {}, "--ranks must be a positive integer (1, 2, 24, ...), got 'four'"),
        (["--ranks=-2"], {}, "--ranks must be a positive integer (1, 2, 24, ...), got '-2'"),
        (
            [],
            {"SPRITE_RANKS": "x"},
            "environment variable SPRITE_RANKS must be a positive integer (1, 2, 24, ...), got 'x'",
        ),
        (
            ["--launcher=slurmish"],
            {},
            "--launcher='slurmish' is not a known launcher; valid launchers: local, mpiexec, pals, srun, torchrun",
        ),
        (["--rank-timeout=soon"], {}, "--rank-timeout must be a number of seconds > 0, got 'soon'"),
        (["--rank-timeout=0"], {}, "--rank-timeout must be a number of seconds > 0, got '0'"),
        (["--sprite-device=tpu"], {}, "--sprite-device='tpu': valid values are auto, cpu, cuda, xpu"),
        (["--launch-early=soon"], {}, "--launch-early='soon': valid values are auto, on, off"),
        (
            [],
            {"SPRITE_LAUNCH_EARLY": "1"},
            "environment variable SPRITE_LAUNCH_EARLY='1': valid values are auto, on, off",
        ),
    ],
)
def test_bad_options_are_usage_errors(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([fnescape(f"ERROR: {message}")])


def test_ini_settings_are_read_and_named_in_errors(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nrank_timeout = never\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: ini option rank_timeout must be a number of seconds > 0, got 'never'"]
    )


def test_markers_are_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cpu
        @pytest.mark.xpu
        def test_x():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers", "--co")
    assert result.ret == 0
    markers = pytester.runpytest("--markers")
    markers.stdout.fnmatch_lines(
        ["@pytest.mark.ranks(n, timeout=None, init=True): run the test body on n ranks*"]
    )
