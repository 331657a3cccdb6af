"""pytest11 entry point (``-p no:sprite`` disables it): options, markers, and the controller switch.

Loading this module imports no torch; the controller, agents and children are imported only when
a session needs them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from .errors import SpriteError, SpriteUsageError
from .glue import ranked_report
from .glue.markers import PARAM_NAME, remember_ranks_spec, size_id, world_sizes
from .glue.options import Settings, register_options, settings_key
from .glue.pytest_timeout import register_timeout_bridge
from .glue.recorded_results import ResultsPlugin

pytest_plugins = [
    "pytest_sprite.fixtures",
    "pytest_sprite.recipes.recipe_fixtures",
    # The built-in launchers and faults register through the same hooks as a project's.
    "pytest_sprite.launch.launchers",
    "pytest_sprite.planted_faults",
]

RANKS_MARKER_HELP = (
    "ranks(n, timeout=None, init=True): run the test body on n ranks, each a fresh process with torch.distributed "
    'initialized; ranks([1, 2, 4]) parametrizes over world sizes; ranks("world") runs on the session\'s whole '
    'world (--ranks), ranks([2, "world"]) on 2 and the world; timeout= seconds overrides --rank-timeout; '
    "init=False starts each rank without a default process group (MASTER_PORT free for the test's own)."
)
CPU_MARKER_HELP = "cpu: the test needs no accelerator (select CI's suite with -m cpu)."
XPU_MARKER_HELP = "xpu: the test needs Intel XPU tiles (not run in CI)."
CUDA_MARKER_HELP = "cuda: the test needs a CUDA GPU (not run in CI)."


def pytest_addoption(parser: pytest.Parser) -> None:
    register_options(parser)


def pytest_report_header(config: pytest.Config) -> str:
    """One line under pytest's own: the plugin's version and the torch its ranks will import (read from the
    installed metadata, so the header imports no torch)."""
    from .plumbing.distribution import DISTRIBUTION, importable, installed_version

    torch = installed_version("torch") if importable("torch") else None
    return f"{DISTRIBUTION} {installed_version() or '(not installed)'}, " + (
        f"torch {torch}" if torch else "torch not installed (ranks tests need it)"
    )


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, args: list[str]) -> Any:
    """In a launched agent, a conftest that fails to import is reported to the controller at once (its
    rank and traceback), instead of leaving it to wait out ``--connect-timeout``."""
    try:
        return (yield)
    except Exception as exc:
        from .rank.early_failure import agent_address, describe_failure, report_agent_failure

        address = agent_address(list(args))
        if address is not None:
            report_agent_failure(address, describe_failure(exc))
        raise


def _fault_mutants(faults: Any) -> None:
    """``--sprite-mutate``'s training and checkpoint mutants: one per registered fault a fit can take from outside."""
    from .plumbing.mutants import fault_mutant, use_fault_mutants

    made = (fault_mutant(f.name, f.description, f.planter.hooks()) for f in faults.values())
    try:
        use_fault_mutants(m for m in made if m is not None)
    except ValueError as exc:
        raise SpriteUsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    from .launch.launchers import collect_launchers
    from .planted_faults import collect_faults

    for line in (RANKS_MARKER_HELP, CPU_MARKER_HELP, XPU_MARKER_HELP, CUDA_MARKER_HELP):
        config.addinivalue_line("markers", line)
    try:
        _fault_mutants(collect_faults(config))
        launchers = collect_launchers(config)
        settings = Settings.from_config(config, launchers=launchers.names)
    except SpriteUsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[settings_key] = settings
    config.pluginmanager.register(ResultsPlugin(), "sprite-results")
    config.pluginmanager.register(ranked_report, "sprite-ranked-reports")
    register_timeout_bridge(config)
    agent_address = config.getoption("sprite_agent", None)
    if settings.torch_tests == "ranks":  # torch's MultiProcessTestCase tests on ranks
        from .torch_tests import register

        register(config, agent=bool(agent_address))
    if agent_address:
        from .rank.main import AgentSessionPlugin

        config.pluginmanager.register(AgentSessionPlugin(config, agent_address), "sprite-agent")
    else:
        try:
            _check_output_paths(config, settings)
            _check_local_world(config, settings)
        except SpriteError as exc:
            raise pytest.UsageError(str(exc)) from None
        from .launch.controller import Controller
        from .launch.termination import TerminationPlugin

        config.pluginmanager.register(Controller(config, settings), "sprite-controller")
        config.pluginmanager.register(TerminationPlugin(), "sprite-termination")
        if not hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller reports
            _register_reporter(config, settings)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A ``pytest`` process ends without the C++ static destructors of what it loaded (torch's: 0.15-0.2 s on
    the 2-core test machine after the session has said everything; ``SPRITE_FAST_EXIT=0`` keeps them). Not
    when pytest runs inside another program (``pytest.main``), whose own exit is its business; that program
    gets its fault registry back."""
    from .planted_faults import restore_faults

    restore_faults(config)
    if _runs_as_pytest():
        from .plumbing.process import skip_static_destructors_at_exit

        skip_static_destructors_at_exit()


def _runs_as_pytest() -> bool:
    """This process is ``python -m pytest`` or the ``pytest`` command (a launched agent's too)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in ("pytest", "pytest.__main__"):
        return True
    return os.path.basename(sys.argv[0]) in ("pytest", "py.test", "pytest.exe")


def _check_output_paths(config: pytest.Config, settings: Settings) -> None:
    """The folders the session writes into, checked before any test runs (one line naming the option); the
    report's file is checked where the reporter takes it (``report.session``)."""
    from .glue.options import option_source
    from .glue.output_paths import check_output_dir

    if settings.plots:
        check_output_dir(settings.plots, option_source(config, "sprite_plots"))
    if settings.artifacts:
        check_output_dir(settings.artifacts, option_source(config, "sprite_artifacts"))


def _check_local_world(config: pytest.Config, settings: Settings) -> None:
    """``--ranks`` beyond what this machine holds, refused before collection (the launch checks again)."""
    if settings.launcher == "local" and settings.world_size is not None and not config.option.collectonly:
        from .glue.options import option_source
        from .launch.launchers.local import check_local_world

        where = f"{option_source(config, 'sprite_ranks')}={settings.world_size}"
        check_local_world(config, settings.world_size, where=where)


def _register_reporter(config: pytest.Config, settings: Settings) -> None:
    from .report.session import SpriteReporter

    try:
        reporter = SpriteReporter(config, settings)
    except SpriteUsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.pluginmanager.register(reporter, "sprite-reports")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parse and validate every ranks marker once, at collection; the list form parametrizes over world sizes."""
    error: str | None
    try:
        spec = remember_ranks_spec(metafunc)
    except SpriteUsageError as exc:
        error = str(exc)
    else:
        error = None
    if error is not None:  # outside the except block: no chained traceback in the collection error
        pytest.fail(error, pytrace=False)
    if spec is not None and spec.parametrized:
        metafunc.fixturenames.append(PARAM_NAME)
        sizes = world_sizes(spec, metafunc.config.stash[settings_key].world_size)
        metafunc.parametrize(PARAM_NAME, sizes, ids=[size_id(n) for n in sizes], indirect=True)


@pytest.fixture(name=PARAM_NAME)
def _world_size_param(request: pytest.FixtureRequest) -> Any:
    """The world size of a ``ranks([...])`` parametrized test (hidden; its name is PARAM_NAME)."""
    return request.param
