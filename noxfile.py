"""The project's tasks, each in a virtual environment of its own (``nox -l`` lists them; ``nox -s NAME``).

``bash .ci/run`` stays what CI runs (the README's test command in a new environment); these sessions are the
same commands for a contributor, plus the build check and the compatibility runs that CI cannot afford.
Arguments after ``--`` go to the session's main command (``nox -s tests -- tests/launch -x``).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typing", "tests"]
nox.options.default_venv_backend = "venv"

# The torch CI runs: the CPU wheel on this machine's disk. torch 2.14.1 is the newest pip takes from it here
# (a CUDA build that runs on the CPU, about 5 GB installed).
CI_TORCH = "torch==2.13.0"
NEWEST_TORCH = "torch==2.14.1"
# The oldest release of each range pyproject.toml allows that a test ran against (docs/tested.md).
OLDEST = ["pytest==8.0.2", "lightning==2.6.5", "hypothesis==6.131.0"]
# What the torch 2.14.1 run covers when the whole CPU suite does not fit the time at hand.
COMPAT_PATHS = ["tests/launch", "tests/glue", "tests/torch_tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The project's CPU tests, as CI runs them (``--run-slow`` adds the full matrices)."""
    session.install(CI_TORCH, "-e", ".[test]")
    session.run("pytest", "-m", "cpu", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, warnings as errors (tests/project/test_docs.py runs its examples)."""
    session.install("-e", ".[docs]")
    session.run("sphinx-build", "-W", "-b", "html", "docs", "docs/_build/html", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff's rules and format."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typing(session: nox.Session) -> None:
    """mypy --strict over the package (torch and Lightning installed, so their types are checked too)."""
    session.install(CI_TORCH, "-e", ".[test]")
    session.run("mypy", "--strict", "pytest_sprite")


@nox.session
def build(session: nox.Session) -> None:
    """The sdist and wheel as a packager builds them (isolated build), checked by twine, then the wheel run:
    installed without the checkout on the path, the shipped suite's collectives and parity and the README's
    first example from a directory outside the checkout (tests/project/test_wheel.py)."""
    session.install(CI_TORCH, "-e", ".[test]")
    tmp = session.create_tmp()
    session.run("python", "-m", "build", "--outdir", f"{tmp}/dist", ".")
    session.run("sh", "-c", f"twine check --strict {tmp}/dist/*", external=True)
    session.run("pytest", "-m", "cpu", "tests/project/test_wheel.py", "--run-slow", *session.posargs)


@nox.session(name="torch-newest")
def torch_newest(session: nox.Session) -> None:
    """The CPU tests against torch 2.14.1 (``-- -m cpu`` for all of them; the default is the harness,
    the glue and the torch-suite tests, then the shipped suite at 4 ranks)."""
    session.install(NEWEST_TORCH, "-e", ".[test]")
    session.run("pytest", "-m", "cpu", *(session.posargs or COMPAT_PATHS))
    session.run("pytest", "--pyargs", "pytest_sprite.suite", "--ranks=4")


@nox.session
def oldest(session: nox.Session) -> None:
    """The oldest releases the ranges allow, with the torch CI runs: the shipped suite at 2 ranks and the
    tests that lean on each (pytest's internals, Lightning's strategies, hypothesis on ranks)."""
    session.install(CI_TORCH, "-e", ".[test]", *OLDEST)
    session.run(
        "pytest",
        "-m",
        "cpu",
        *(
            session.posargs
            or [
                "tests/glue/test_harness.py",
                "tests/glue/test_usage_errors.py",
                "tests/glue/test_ranks_hypothesis.py",
                "tests/lightning",
            ]
        ),
    )
    session.run("pytest", "--pyargs", "pytest_sprite.suite", "--ranks=2")
