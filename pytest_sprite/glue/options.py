"""Session settings: one place that reads options, environment and ini, in a documented order.

Precedence: a test's marker (``timeout=``) > command line > environment variable > ini > default.
Every error names the source the bad value came from.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import pytest

from ..env.device import DEVICE_CHOICES
from ..env.rendezvous import unresolved
from ..errors import SpriteUsageError
from ..plumbing.mutants import MutantSpec, select_mutants
from .markers import parse_positive_int, parse_timeout

__all__ = [
    "DEFAULT_TIMEOUT_SOURCE",
    "OPTIONS",
    "QWEN_PATH_ENV",
    "Settings",
    "option_source",
    "register_options",
    "settings_key",
]

QWEN_PATH_ENV: Final = "SPRITE_QWEN_PATH"
"""The environment variable that names real Qwen2 weights (``--qwen-path``)."""

DEFAULT_TIMEOUT: Final = 300.0
DEFAULT_TIMEOUT_SOURCE: Final = "the default"
"""``Settings.timeout_source`` when no option, ini key or environment variable set the rank timeout."""
DEFAULT_GRACE: Final = 5.0
DEFAULT_CONNECT_TIMEOUT: Final = 120.0
SUMMARY_CHOICES: Final = ("auto", "no")
TORCH_TESTS_CHOICES: Final = ("native", "ranks")
LAUNCH_EARLY_CHOICES: Final = ("auto", "on", "off")
REUSE_CHOICES: Final = ("auto", "off")


@dataclass(frozen=True)
class _Option:
    flag: str
    dest: str
    ini: str
    env: str
    help: str
    metavar: str


OPTIONS: Final = (
    _Option(
        "--ranks",
        "sprite_ranks",
        "ranks",
        "SPRITE_RANKS",
        "World size the launcher provides (ranks tests needing more are skipped). "
        "Default: the largest @pytest.mark.ranks seen.",
        "W",
    ),
    _Option(
        "--launcher",
        "sprite_launcher",
        "launcher",
        "SPRITE_LAUNCHER",
        "How rank agents start: local (fork, default) or any registered launcher (an unknown name lists them).",
        "NAME",
    ),
    _Option(
        "--rank-timeout",
        "sprite_rank_timeout",
        "rank_timeout",
        "SPRITE_RANK_TIMEOUT",
        f"Seconds a ranks test may run before every rank's stack is dumped and it fails "
        f"(marker timeout= overrides). Default: {DEFAULT_TIMEOUT:g}.",
        "SECONDS",
    ),
    _Option(
        "--rank-grace",
        "sprite_rank_grace",
        "rank_grace",
        "SPRITE_RANK_GRACE",
        f"Seconds the other ranks get to finish after one rank failed, before their stacks are "
        f"taken and they are ended. Default: {DEFAULT_GRACE:g}.",
        "SECONDS",
    ),
    _Option(
        "--pack",
        "sprite_pack",
        "pack",
        "SPRITE_PACK",
        "on: run ranks tests side by side on free agents of the world, in collection order (default); "
        "off: one ranks test at a time on agents 0..n-1.",
        "on|off",
    ),
    _Option(
        "--launch-early",
        "sprite_launch_early",
        "launch_early",
        "SPRITE_LAUNCH_EARLY",
        "With --ranks and a launcher other than local, when the agents start: on: as the controller starts "
        "collecting, so their collection and its overlap; off: at the first ranks test; auto (default): on "
        "when this host has a core for the controller and each agent it may run (--ppn, else --ranks).",
        "auto|on|off",
    ),
    _Option(
        "--ppn",
        "sprite_ppn",
        "ppn",
        "SPRITE_PPN",
        "Ranks per node, for launchers that need it (pals, mpiexec, srun).",
        "N",
    ),
    _Option(
        "--launcher-args",
        "sprite_launcher_args",
        "launcher_args",
        "SPRITE_LAUNCHER_ARGS",
        "Extra words for the launcher command, shell-quoted (e.g. '--cpu-bind list:1-8').",
        "ARGS",
    ),
    _Option(
        "--controller-host",
        "sprite_controller_host",
        "controller_host",
        "SPRITE_CONTROLLER_HOST",
        "Address agents connect back to. Default: 127.0.0.1 for local launches, else this host's name.",
        "HOST",
    ),
    _Option(
        "--connect-timeout",
        "sprite_connect_timeout",
        "connect_timeout",
        "SPRITE_CONNECT_TIMEOUT",
        f"Seconds to wait for every agent to connect. Default: {DEFAULT_CONNECT_TIMEOUT:g}.",
        "SECONDS",
    ),
    _Option(
        "--sprite-device",
        "sprite_device",
        "sprite_device",
        "SPRITE_DEVICE",
        f"Device for test ranks: {', '.join(DEVICE_CHOICES)} (auto: xpu, else cuda, else cpu).",
        "KIND",
    ),
    _Option(
        "--sprite-artifacts",
        "sprite_artifacts",
        "sprite_artifacts",
        "SPRITE_ARTIFACTS",
        "Directory where arms write their records, one fresh directory per test (never overwritten).",
        "DIR",
    ),
    _Option(
        "--sprite-report",
        "sprite_report",
        "sprite_report",
        "SPRITE_REPORT",
        "Write one JSON report of the session to PATH (never over an existing file: see --sprite-report-overwrite).",
        "PATH",
    ),
    _Option(
        "--sprite-plots",
        "sprite_plots",
        "sprite_plots",
        "SPRITE_PLOTS",
        "Write PNG plots of the assertions' figures into DIR (needs matplotlib: pip install pytest-sprite[plots]).",
        "DIR",
    ),
    _Option(
        "--sprite-summary",
        "sprite_summary",
        "sprite_summary",
        "SPRITE_SUMMARY",
        f"Assertion tables after the run: {', '.join(SUMMARY_CHOICES)} (default auto: shown, shortened by -q).",
        "WHEN",
    ),
    _Option(
        "--torch-tests",
        "sprite_torch_tests",
        "torch_tests",
        "SPRITE_TORCH_TESTS",
        "How torch's MultiProcessTestCase tests run: native (default: torch spawns its processes per test) "
        "or ranks (each test method runs as a ranks test on the class's world_size, bodies unchanged).",
        "native|ranks",
    ),
    _Option(
        "--sprite-reuse",
        "sprite_reuse",
        "sprite_reuse",
        "SPRITE_REUSE",
        "auto (default): fault cases take the clean arms the session already computed from a store in the "
        "basetemp, checked once per session by recomputing one; off: every test computes its own.",
        "auto|off",
    ),
    _Option(
        "--world-check",
        "sprite_world_check",
        "world_check",
        "SPRITE_WORLD_CHECK",
        "on (default): refuse a local world larger than this machine holds (processes, file descriptors, "
        "memory, as measured before the first fork); off: start it anyway.",
        "on|off",
    ),
    _Option(
        "--sprite-mutate",
        "sprite_mutate",
        "sprite_mutate",
        "SPRITE_MUTATE",
        "Run each ranks test again under each applicable mutant (a planted distributed bug) and report which "
        "its checks kill: a comma list of families (collective, training, checkpoint), mutant names or specs "
        "(skip_allreduce@rank1:from3), or all. Default: off.",
        "MUTANTS",
    ),
    _Option(
        "--sprite-mutate-fail-under",
        "sprite_mutate_fail_under",
        "sprite_mutate_fail_under",
        "SPRITE_MUTATE_FAIL_UNDER",
        "Fail the session when --sprite-mutate's score (killed / applicable, 0-1) is below SCORE.",
        "SCORE",
    ),
    _Option(
        "--qwen-path",
        "sprite_qwen_path",
        "qwen_path",
        QWEN_PATH_ENV,
        "Load real Qwen2 weights for lora_qwen from PATH (default: a tiny in-memory config).",
        "PATH",
    ),
)

settings_key = pytest.StashKey["Settings"]()


def register_options(parser: pytest.Parser) -> None:
    """Add every option to the ``sprite`` group, each with its ini twin (one help text for both)."""
    group = parser.getgroup("sprite", "distributed ranks tests (pytest-sprite)")
    for opt in OPTIONS:
        group.addoption(opt.flag, dest=opt.dest, default=None, metavar=opt.metavar, help=opt.help)
        parser.addini(opt.ini, help=f"{opt.help} (Environment: {opt.env}.)", default=None)
    group.addoption(
        "--collective-check",
        dest="sprite_collective_check",
        action="store_true",
        default=None,
        help=COLLECTIVE_CHECK_HELP,
    )
    parser.addini(
        "collective_check",
        help=f"{COLLECTIVE_CHECK_HELP} (Environment: SPRITE_COLLECTIVE_CHECK.)",
        default=None,
    )
    group.addoption(
        "--sprite-report-overwrite",
        dest="sprite_report_overwrite",
        action="store_true",
        default=False,
        help="Let --sprite-report replace an existing file.",
    )
    group.addoption(
        "--sprite-profile",
        dest="sprite_profile",
        action="store_true",
        default=False,
        help="Measure where each ranks test's time goes, by phase (sub-world start, Trainer, fit set-up, "
        "steps, records, judging, ...): a table after the run, and each test's phases in --sprite-report.",
    )
    group.addoption("--sprite-agent", dest="sprite_agent", default=None, help=argparse.SUPPRESS)


COLLECTIVE_CHECK_HELP: Final = (
    "Run ranks with torch's collective fingerprint checks (TORCH_DISTRIBUTED_DEBUG=DETAIL): a collective "
    "called with other ops, shapes or dtypes on two ranks fails at once, naming both, instead of hanging. "
    "Costs an extra collective per collective. Default: off."
)
_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off", "")


def _collective_check(config: pytest.Config) -> bool:
    """``--collective-check`` > SPRITE_COLLECTIVE_CHECK > ini ``collective_check`` > off."""
    if config.getoption("sprite_collective_check", None):
        return True
    for value, source in (
        (os.environ.get("SPRITE_COLLECTIVE_CHECK"), "environment variable SPRITE_COLLECTIVE_CHECK"),
        (config.getini("collective_check"), "ini option collective_check"),
    ):
        if value is None or (source.startswith("environment") and value == ""):
            continue
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise SpriteUsageError(
            f"{source}={value!r} is not a switch; use one of {', '.join(_TRUE)} to turn the check on "
            f"or {', '.join(v for v in _FALSE if v)} to leave it off"
        )
    return False


def _raw(config: pytest.Config, opt: _Option) -> tuple[Any, str] | None:
    value = config.getoption(opt.dest, None)
    if value is not None:
        return value, opt.flag
    env = os.environ.get(opt.env)
    if env not in (None, ""):
        return env, f"environment variable {opt.env}"
    ini = config.getini(opt.ini)
    if ini not in (None, "", []):
        return ini, f"ini option {opt.ini}"
    return None


def option_source(config: pytest.Config, dest: str) -> str:
    """Where an option's value came from, in the words its errors use (``--sprite-report``,
    ``environment variable SPRITE_REPORT``, ``ini option sprite_report``); its flag when unset."""
    opt = next(opt for opt in OPTIONS if opt.dest == dest)
    raw = _raw(config, opt)
    return raw[1] if raw else opt.flag


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The resolved session settings."""

    world_size: int | None
    """``--ranks``; None: the largest marker seen."""
    launcher: str
    timeout: float
    timeout_source: str
    grace: float
    ppn: int | None
    launcher_args: tuple[str, ...]
    controller_host: str | None
    connect_timeout: float
    device: str
    artifacts: str | None
    qwen_path: str | None
    collective_check: bool = False
    """``--collective-check``: ranks run with torch's collective fingerprint checks."""
    report: str | None = None
    """``--sprite-report``: where the session's JSON report goes."""
    report_overwrite: bool = False
    profile: bool = False
    """``--sprite-profile``: each ranks test's time by phase, in the summary and the JSON report."""
    plots: str | None = None
    """``--sprite-plots``: directory for PNG plots."""
    summary: str = "auto"
    """``--sprite-summary``: auto (tables shown, -q shortens them) or no."""
    pack: bool = True
    """``--pack``: ranks tests side by side on free agents; False runs one at a time."""
    launch_early: str = "auto"
    """``--launch-early``: auto, on or off; see ``Controller.launch_early``."""
    torch_tests: str = "native"
    """``--torch-tests``: native, or ranks (torch's MultiProcessTestCase tests run as ranks tests)."""
    world_check: bool = True
    """``--world-check``: a local world beyond the machine's measured limits is refused before any fork."""
    reuse: str = "auto"
    """``--sprite-reuse``: auto (clean results shared through the session store) or off."""
    mutate: tuple[MutantSpec, ...] = ()
    """``--sprite-mutate``: the mutants each ranks test runs under after its own run; empty: off."""
    mutate_fail_under: float | None = None
    """``--sprite-mutate-fail-under``: the lowest mutation score that passes the session."""

    @classmethod
    def from_config(cls, config: pytest.Config, *, launchers: Sequence[str]) -> Settings:
        """Read and validate every setting; raises SpriteUsageError naming the source.

        ``launchers``: the ``--launcher`` values the session's launcher registry holds.
        """
        opts = {opt.dest: opt for opt in OPTIONS}

        def get(dest: str) -> tuple[Any, str] | None:
            return _raw(config, opts[dest])

        ranks = get("sprite_ranks")
        launcher_name = _launcher_name(get("sprite_launcher"), launchers)
        timeout = get("sprite_rank_timeout")
        grace = get("sprite_rank_grace")
        ppn = get("sprite_ppn")
        largs = get("sprite_launcher_args")
        connect = get("sprite_connect_timeout")
        device_name = _device_name(get("sprite_device"))
        host = get("sprite_controller_host")
        summary_name = _summary_name(get("sprite_summary"))
        pack = get("sprite_pack")
        early = get("sprite_launch_early")
        early_name = _lower_choice(early, "auto", LAUNCH_EARLY_CHOICES)
        torch_tests_name = _lower_choice(get("sprite_torch_tests"), "native", TORCH_TESTS_CHOICES)
        reuse_name = _lower_choice(get("sprite_reuse"), "auto", REUSE_CHOICES)
        world_check = get("sprite_world_check")

        def text(dest: str) -> str | None:
            raw = get(dest)
            return str(raw[0]) if raw else None

        return cls(
            world_size=parse_positive_int(*ranks) if ranks else None,
            launcher=launcher_name,
            timeout=parse_timeout(*timeout) if timeout else DEFAULT_TIMEOUT,
            timeout_source=timeout[1] if timeout else DEFAULT_TIMEOUT_SOURCE,
            grace=parse_timeout(*grace) if grace else DEFAULT_GRACE,
            ppn=parse_positive_int(*ppn) if ppn else None,
            launcher_args=_launcher_words(largs),
            controller_host=_controller_host(host, agent=bool(config.getoption("sprite_agent", None))),
            connect_timeout=parse_timeout(*connect) if connect else DEFAULT_CONNECT_TIMEOUT,
            device=device_name,
            artifacts=text("sprite_artifacts"),
            qwen_path=text("sprite_qwen_path"),
            collective_check=_collective_check(config),
            report=text("sprite_report"),
            report_overwrite=bool(config.getoption("sprite_report_overwrite", False)),
            profile=bool(config.getoption("sprite_profile", False)),
            plots=text("sprite_plots"),
            summary=summary_name,
            pack=parse_on_off(*pack) if pack else True,
            launch_early=early_name,
            torch_tests=torch_tests_name,
            reuse=reuse_name,
            world_check=parse_on_off(*world_check) if world_check else True,
            mutate=_mutants(get("sprite_mutate")),
            mutate_fail_under=_fail_under(get("sprite_mutate_fail_under")),
        )


def _launcher_name(raw: tuple[Any, str] | None, launchers: Sequence[str]) -> str:
    """``--launcher``'s value (default ``local``), one of the registry's ``launchers``."""
    name = str(raw[0]).strip() if raw else "local"
    if name not in launchers:
        where = raw[1] if raw else "--launcher"
        raise SpriteUsageError(
            f"{where}={name!r} is not a known launcher; valid launchers: {', '.join(launchers)}"
        )
    return name


def _launcher_words(raw: tuple[Any, str] | None) -> tuple[str, ...]:
    """``--launcher-args`` split as a shell would; an unbalanced quote names the option and the fix."""
    if raw is None:
        return ()
    try:
        return tuple(shlex.split(str(raw[0])))
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        raise SpriteUsageError(
            f"{raw[1]}={raw[0]!r}: cannot be split into words ({str(exc).lower()}); it is split as a shell "
            "splits a command line: close the quote or escape it with a backslash"
        ) from None


def _controller_host(raw: tuple[Any, str] | None, *, agent: bool) -> str | None:
    """``--controller-host`` when this host can resolve it: a name that resolves nowhere fails here in one
    line, not in every agent after the resolver's retries. An agent (``agent``) connects to the address the
    controller gives it and resolves nothing here."""
    if raw is None or agent:
        return None if raw is None else str(raw[0]).strip()
    host = str(raw[0]).strip()
    why = unresolved(host) if host else "it is empty"
    if why is not None:
        raise SpriteUsageError(
            f"{raw[1]}={raw[0]!r}: this host cannot resolve it ({why}); pass an address or a name the agents "
            "reach this host by, or leave it unset (launched agents: this host's name; local ones: 127.0.0.1)"
        )
    return host


def _mutants(raw: tuple[Any, str] | None) -> tuple[MutantSpec, ...]:
    """``--sprite-mutate``'s selection (``off`` or unset: none); a bad name fails naming the source."""
    if raw is None or str(raw[0]).strip().lower() in ("", "off", "none"):
        return ()
    try:
        return select_mutants(str(raw[0]), raw[1])
    except ValueError as exc:
        raise SpriteUsageError(str(exc)) from None


def _fail_under(raw: tuple[Any, str] | None) -> float | None:
    """``--sprite-mutate-fail-under``: a score from 0 to 1."""
    if raw is None:
        return None
    try:
        score = float(raw[0])
    except ValueError:
        score = -1.0
    if not 0.0 <= score <= 1.0:
        raise SpriteUsageError(
            f"{raw[1]}={raw[0]!r} is not a score; give a number from 0 to 1 (killed / applicable)"
        )
    return score


def _device_name(device: tuple[Any, str] | None) -> str:
    """``--device``'s value, stripped, when it is one of DEVICE_CHOICES; ``auto`` when unset."""
    device_name = str(device[0]).strip() if device else "auto"
    if device_name not in DEVICE_CHOICES:
        where = device[1] if device else "--device"
        raise SpriteUsageError(f"{where}={device_name!r}: valid values are {', '.join(DEVICE_CHOICES)}")
    return device_name


def _summary_name(summary: tuple[Any, str] | None) -> str:
    """``--sprite-summary``'s value, stripped, when it is one of SUMMARY_CHOICES; ``auto`` when unset."""
    summary_name = str(summary[0]).strip() if summary else "auto"
    if summary is not None and summary_name not in SUMMARY_CHOICES:
        raise SpriteUsageError(
            f"{summary[1]}={summary_name!r}: valid values are {', '.join(SUMMARY_CHOICES)}"
        )
    return summary_name


def _lower_choice(raw: tuple[Any, str] | None, default: str, choices: Sequence[str]) -> str:
    """An option's value, stripped and lower-cased, when it is one of ``choices``; ``default`` when unset."""
    name = str(raw[0]).strip().lower() if raw else default
    if raw is not None and name not in choices:
        raise SpriteUsageError(f"{raw[1]}={raw[0]!r}: valid values are {', '.join(choices)}")
    return name


def parse_on_off(value: object, where: str) -> bool:
    """``on`` or ``off`` (any case) from an option, ini or environment value."""
    word = str(value).strip().lower()
    if word not in ("on", "off"):
        raise SpriteUsageError(f"{where}={value!r}: valid values are on, off")
    return word == "on"
