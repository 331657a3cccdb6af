"""The distribution a user installs, not the checkout: the sdist and wheel build, twine accepts them, and the
wheel, installed without the checkout on the path, runs the main job's modules and the README's first example.

An editable install hides what a built wheel leaves out (a data file, a module outside the package list, the
shipped suite): its finder serves any module of the checkout. So the wheel goes into a new virtual environment
(``venv --without-pip``, the wheel installed into its site-packages by pip ``--no-deps``), which reaches the
libraries of the environment running this test (torch, transformers, peft: gigabytes not worth installing again)
through a view of that environment's site-packages: a folder of links to each entry except this project's own
(the editable install's finder, its ``.pth`` and its dist-info, or an installed copy), added with
``site.addsitedir`` so the other ``.pth`` files still apply. The sessions run from a folder outside the checkout;
the first check proves that ``pytest_sprite`` is imported from the wheel and that no path of the checkout is on
``sys.path``.

CI builds without isolation (the ``setuptools`` of the test extra: seconds, where an isolated build installs a
fresh setuptools twice); ``nox -s build`` builds as a packager does, isolated.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
OWN = re.compile(r"(pytest_sprite|__editable__.*pytest_sprite)")
"""Entries of a site-packages folder that are this project's own install (editable or not)."""
TIMEOUT = 600


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class WheelEnv:
    python: Path
    site: Path
    outside: Path


def run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; its output is the assertion message when it fails."""
    result = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def tracked(*paths: str) -> list[str]:
    """The checkout's own files under ``paths``: tracked, or new and not ignored (not what a build left)."""
    argv = ["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build``: the sdist, then the wheel built from the unpacked sdist (as a packager builds it)."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True, check=False).returncode:
        pytest.skip("not a git checkout (an unpacked sdist): the checks compare the build with git's files")
    # A copy of the checkout's own files: a checkout's leftover egg-info (an editable install's) lists files
    # that setuptools then puts in the sdist whatever the configuration says, hiding a missing data file.
    source = tmp_path_factory.mktemp("source")
    for name in tracked():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source, cwd=source)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Built(sdist=sdist, wheel=wheel)


@pytest.fixture(scope="module")
def wheel_env(built: Built, tmp_path_factory: pytest.TempPathFactory) -> WheelEnv:
    home = tmp_path_factory.mktemp("wheel-env")
    venv = home / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=home)
    python = venv / "bin" / "python"
    site = Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=home
        ).stdout.strip()
    )
    run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-compile",
        "--target",
        site,
        built.wheel,
        cwd=home,
    )
    view = home / "parent-site-packages"
    view.mkdir()
    parents = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for parent in parents:
        for entry in parent.iterdir():
            if not OWN.match(entry.name) and not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    (site / "_parent_site_packages.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    outside = home / "outside"
    outside.mkdir()
    return WheelEnv(python=python, site=site, outside=outside)


def clean_env() -> dict[str, str]:
    """This environment less what would put the checkout on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS")}


def first_readme_example() -> str:
    fence = re.search(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    assert fence is not None, "README.md has no python example"
    return fence.group(1)


def project_version() -> str:
    found = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert found is not None
    return found.group(1)


def names_in(built: Built) -> tuple[set[str], set[str]]:
    """The wheel's file names, and the sdist's without its top folder."""
    with zipfile.ZipFile(built.wheel) as wheel:
        in_wheel = set(wheel.namelist())
    with tarfile.open(built.sdist) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    return in_wheel, in_sdist


def test_the_wheel_holds_every_file_of_the_package_and_the_sdist_what_its_tests_need(built: Built) -> None:
    in_wheel, in_sdist = names_in(built)
    missing = [f for f in tracked("pytest_sprite") if f not in in_wheel]
    assert not missing, (
        f"the wheel leaves out {missing}: list the data files in [tool.setuptools.package-data]"
    )
    version = project_version()
    assert f"pytest_sprite-{version}.dist-info/licenses/LICENSE" in in_wheel
    missing = [f for f in tracked() if f not in in_sdist and f != ".gitignore"]
    assert not missing, f"the sdist leaves out {missing}: graft or include them in MANIFEST.in"


def test_twine_check_strict_passes(built: Built) -> None:
    result = run(sys.executable, "-m", "twine", "check", "--strict", built.sdist, built.wheel, cwd=ROOT)
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_wheel_runs_the_main_job_and_the_readme_from_outside_the_checkout(wheel_env: WheelEnv) -> None:
    where = run(
        wheel_env.python,
        "-c",
        "import sys, pytest_sprite; from importlib.metadata import version; "
        "print(pytest_sprite.__file__); print(version('pytest-sprite')); "
        "print(*[getattr(f, '__module__', type(f).__module__) for f in sys.meta_path]); "
        "print(*sys.path, sep='\\n')",
        cwd=wheel_env.outside,
        env=clean_env(),
    ).stdout.splitlines()
    assert Path(where[0]).is_relative_to(wheel_env.site), where[0]
    assert where[1] == project_version()
    assert "__editable__" not in where[2], f"an editable install's finder is active: {where[2]}"
    assert not [p for p in where[3:] if p and Path(p).resolve().is_relative_to(ROOT)], where
    (wheel_env.outside / "test_first.py").write_text(first_readme_example(), encoding="utf-8")
    # The README's first example at the README's --ranks=4, beside the main job's collectives and its FP32
    # parity test at 2 ranks (the parity module's fault cases and other sizes: the slow test below).
    result = run(
        wheel_env.python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "test_first.py",
        "--pyargs",
        "pytest_sprite.suite.test_collectives",
        "pytest_sprite.suite.test_parity",
        "--ranks=4",
        "-k",
        "not fault and (not test_lora_parity or ranks2)",
        cwd=wheel_env.outside,
        env=clean_env(),
    )
    assert f"pytest-sprite {project_version()}, torch " in result.stdout, result.stdout
    assert re.search(r"= 9 passed, \d+ deselected in ", result.stdout), result.stdout


@pytest.mark.slow
def test_the_wheel_runs_the_whole_collectives_and_parity_modules(wheel_env: WheelEnv) -> None:
    result = run(
        wheel_env.python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "pytest_sprite.suite.test_collectives",
        "pytest_sprite.suite.test_parity",
        "--ranks=4",
        cwd=wheel_env.outside,
        env=clean_env(),
    )
    assert re.search(r"= \d+ passed in ", result.stdout), result.stdout
