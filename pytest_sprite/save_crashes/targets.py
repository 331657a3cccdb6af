"""What a crash matrix can crash: a training function run in forks, or an unmodified command.

A target trains into the directory it is given, resuming from whatever it finds there, and ends with its
final weights. Calling it again on the same directory is its resume. Targets run one whole run at a time;
each rank records its file events under its :class:`~pytest_sprite.save_crashes.inject.Plan`, and the matrix decides
which process dies where through the run's kill plan (``RunRequest.kill``): the ``kill=`` of the run's
sub-world, or, in the command form's interpreter, the plan the injector asks itself.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.plumbing.output import tail_of_file
from pytest_sprite.plumbing.process import exit_text, prewarm_training
from pytest_sprite.plumbing.timing import monotonic
from pytest_sprite.save_crashes.inject import CRASH_EXIT_CODE, PLAN_ENV, Plan
from pytest_sprite.save_crashes.target_run import (
    RankOutcome,
    RunOutcome,
    RunRequest,
    crash_outcome,
    forked_envs,
)

__all__ = [
    "CommandTarget",
    "FunctionTarget",
    "SubworldTarget",
    "Target",
    "load_weights",
    "weight_diff",
    "write_sitecustomize",
]


class Target(Protocol):
    """A training job the matrix can run, crash and resume."""

    @property
    def label(self) -> str:
        """How the matrix names the target."""
        ...

    @property
    def ranks(self) -> int:
        """Processes per run."""
        ...

    def run(self, request: RunRequest) -> RunOutcome:
        """One run into ``request.train_dir`` (rank ``r`` under ``plans[r]``, printing into ``outputs[r]``).

        A rank that returns hands back its final weights (a mapping of tensors) as its value.
        """
        ...


@dataclass(frozen=True, kw_only=True)
class FunctionTarget:
    """``fn(train_dir)`` in fresh forks of this process per run: one process (the plain-test form), or ``ranks``."""

    fn: Callable[[Path], Any]
    """Trains to the end, resuming from whatever it finds in ``train_dir``; returns the final weights."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables set in every run's process."""
    name: str = ""
    """Label in the matrix (default: the function's qualified name)."""
    ranks: int = 1
    """Processes per run; with more than one, each is a fork with torchrun's variables (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a fresh port) and the function starts its own process
    group (``torch.distributed.init_process_group("gloo")``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks < 1:
            raise SpriteUsageError(f"ranks must be a positive int, got {self.ranks!r}")

    @property
    def label(self) -> str:
        return (
            self.name
            or f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"
        )

    def prewarm(self) -> None:
        """Load torch's lazily imported parts once here, so that no fork pays for them again."""
        prewarm_training()

    def run(self, request: RunRequest) -> RunOutcome:
        return request.in_forks(self.fn, (), forked_envs(self.ranks, self.env))


_SITECUSTOMIZE = '''"""Written by pytest-sprite's crash matrix: install the chaos plan of {plan_env} in this interpreter."""
import atexit
import sys

sys.path.append({package_root!r})
from pytest_sprite.save_crashes import inject

if inject.install_from_env():
    atexit.register(inject.finish)
'''


@dataclass(frozen=True, kw_only=True)
class CommandTarget:
    """An unmodified script: one interpreter per run, the injector loaded through ``sitecustomize``.

    ``{out}`` in the command (and in ``result_file``) becomes the run's training directory. An interpreter per
    run is unavoidable for a command (the ckpt-chaos method's ``run`` mode), and it has that mode's limits: only one
    process (the command's own), LOST_WORK is not judged unless the script marks its saves, and a script that
    ships its own ``sitecustomize`` shadows the injector.
    """

    argv: tuple[str, ...]
    """The command, with ``{out}`` where it takes its output directory."""
    result_file: str
    """Where the run leaves its final weights (``torch.save`` of a state dict, ``.safetensors`` or ``.json``)."""
    resume_argv: tuple[str, ...] | None = None
    """The resume command (default: the same command)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables added for every run."""
    inject_dir: Path | None = None
    """Folder holding the generated ``sitecustomize.py`` (set by the matrix, inside ``out_dir``)."""

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise SpriteUsageError(
                f"the command must be a non-empty list of strings, got {list(self.argv)!r}"
            )
        if "{out}" not in " ".join(self.argv):
            raise SpriteUsageError(
                f"the command {shlex.join(self.argv)!r} has no {{out}}: put {{out}} where it takes its output "
                "directory, e.g. ['python', 'train.py', '--out', '{out}']"
            )
        if not self.result_file:
            raise SpriteUsageError(
                "result_file= is required with a command: where the run leaves its final weights, "
                "e.g. result_file='{out}/final.pt'"
            )

    @property
    def label(self) -> str:
        return shlex.join(self.argv)

    @property
    def ranks(self) -> int:
        return 1

    def prepare(self, inject_dir: Path) -> CommandTarget:
        """Write the ``sitecustomize`` that loads the injector, and return the target that uses it."""
        write_sitecustomize(inject_dir)
        return CommandTarget(
            argv=self.argv,
            result_file=self.result_file,
            resume_argv=self.resume_argv,
            env=self.env,
            inject_dir=inject_dir,
        )

    def run(self, request: RunRequest) -> RunOutcome:
        train_dir, plan, output, timeout = (
            request.train_dir,
            request.plans[0],
            request.outputs[0],
            request.timeout,
        )
        resuming = train_dir.exists() and any(train_dir.iterdir())
        argv = self.resume_argv if (resuming and self.resume_argv) else self.argv
        command = [a.replace("{out}", str(train_dir)) for a in argv]
        env = dict(os.environ)
        env.update(self.env)
        if self.inject_dir is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(self.inject_dir), env.get("PYTHONPATH", "")) if p
            )
        env.pop(PLAN_ENV, None)
        if plan is not None:  # no sub-world rank: the interpreter's injector carries the run's kill plan
            env[PLAN_ENV] = dataclasses.replace(plan, kill=request.kill).to_json()
        train_dir.mkdir(parents=True, exist_ok=True)
        start = monotonic()
        with open(output, "ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                outcome = RankOutcome(
                    rank=0, status="timeout", error=f"still running after {timeout:.0f} s; killed"
                )
                return RunOutcome(ranks=(outcome,), wall_s=monotonic() - start)
        wall = monotonic() - start
        if code == CRASH_EXIT_CODE and plan is not None and request.kill is not None:
            # the status only the injector's os._exit gives, where the kill plan kills (at one event: its own)
            crashed = RankOutcome(rank=0, status="crashed", crashed_at=request.kill.at)
            return RunOutcome(ranks=(crashed,), wall_s=wall)
        if code != 0:
            tail = tail_of_file(output, 3).rstrip()
            error = f"ended with {exit_text(code, None)}" + (f": {tail.splitlines()[-1]}" if tail else "")
            return RunOutcome(ranks=(RankOutcome(rank=0, status="raised", error=error),), wall_s=wall)
        result = Path(self.result_file.replace("{out}", str(train_dir)))
        try:
            weights = load_weights(result)
        except Exception as exc:
            error = f"exited 0 but its result file {result.name} is unreadable: {type(exc).__name__}: {exc}"
            return RunOutcome(ranks=(RankOutcome(rank=0, status="raised", error=error),), wall_s=wall)
        return RunOutcome(ranks=(RankOutcome(rank=0, status="returned", value=weights),), wall_s=wall)


def write_sitecustomize(inject_dir: Path) -> Path:
    """Create ``inject_dir`` with a ``sitecustomize.py`` that installs the plan of :data:`PLAN_ENV`.

    Put ``inject_dir`` first on ``PYTHONPATH`` and every interpreter started with a plan records (and dies) as
    planned; without a plan it does nothing.
    """
    inject_dir.mkdir(parents=True)
    package_root = str(Path(__file__).resolve().parents[2])
    path = inject_dir / "sitecustomize.py"
    path.write_text(_SITECUSTOMIZE.format(plan_env=PLAN_ENV, package_root=package_root), encoding="utf-8")
    return path


def load_weights(path: Path) -> dict[str, Any]:
    """A result file's weights: ``.safetensors``, a ``torch.save`` of a state dict (or module), or ``.json``.

    A ``.json`` object of plain values suits scripts that use no torch; its values are compared for equality.
    """
    if path.suffix == ".json":
        import json

        value = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(value, dict):
            raise ValueError(f"holds a JSON {type(value).__name__}, not an object of weights")
        return value
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    import torch

    value = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(value, torch.nn.Module):
        value = value.state_dict()
    if not isinstance(value, Mapping):
        raise ValueError(f"holds a {type(value).__name__}, not a mapping of tensors")
    return dict(value)


def weight_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two results (mappings of tensors); ``inf`` when they do not match up.

    Plain numbers (and lists of them) are compared numerically; other values count as 0 when equal and ``inf``
    otherwise, and so do results that are not mappings.
    """
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return 0.0 if a == b else float("inf")
    if set(a) != set(b):
        return float("inf")
    import torch

    worst = 0.0
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape:
                return float("inf")
            if x.numel() == 0:
                continue
            d = float((x.detach().to(torch.float64) - y.detach().to(torch.float64)).abs().max())
            if d != d:  # nan
                return float("nan")
            worst = max(worst, d)
        else:
            d = _plain_diff(x, y)
            if d != d:
                return float("nan")
            worst = max(worst, d)
    return worst


def _plain_diff(x: Any, y: Any) -> float:
    """Largest difference between two plain values: numbers, or equally long lists of numbers; else 0 or inf."""
    numbers = (int, float)
    if (
        isinstance(x, numbers)
        and isinstance(y, numbers)
        and not isinstance(x, bool)
        and not isinstance(y, bool)
    ):
        return abs(float(x) - float(y))
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return max((_plain_diff(a, b) for a, b in zip(x, y, strict=True)), default=0.0)
    return 0.0 if x == y else float("inf")


def _subworld_rank(
    world: Any, fn: Callable[..., Any], args: tuple[Any, ...], plans: Sequence[Plan | None]
) -> Any:
    """One rank of a sub-world run: install this rank's plan, train, hand back portable weights."""
    from pytest_sprite.save_crashes import inject
    from pytest_sprite.save_crashes.target_run import portable

    plan = plans[world.rank]
    if plan is not None:
        inject.install(plan)
    value = fn(*args)
    inject.finish()
    return portable(value)


def _prepare_subworld_rank(
    fn: Callable[..., Any], args: tuple[Any, ...], plans: Sequence[Plan | None]
) -> None:
    """Warm the zygote the sub-world forks from: torch's lazy parts, and what ``fn.subworld_prepare`` loads."""
    prewarm_training()
    prepare = getattr(fn, "subworld_prepare", None)
    if callable(prepare):
        prepare(*args)


_subworld_rank.subworld_prepare = _prepare_subworld_rank  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True)
class SubworldTarget:
    """A per-rank training function run in sub-worlds: the form for a ranks test (every rank calls the assertion).

    Every run is ``run_subworld`` on every rank of the test: test rank ``r`` forks sub-rank ``r`` from its
    zygote, with its own rendezvous and default process group (``fn`` needs none of its own). A sub-world ends
    when one of its ranks dies, so the other ranks of a crashed run are stopped right away rather than running
    on for ``grace`` seconds (a stated limit of this form).
    """

    fn: Callable[..., Any]
    """Module-level (it is pickled to the zygotes): ``fn(train_dir, *args)`` returns the final weights."""
    args: tuple[Any, ...] = ()
    ranks: int = 1
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', '?')}"

    def run(self, request: RunRequest) -> RunOutcome:
        from pytest_sprite.subworld import run_subworld

        start = monotonic()
        result = run_subworld(
            _subworld_rank,
            args=(self.fn, (request.train_dir, *self.args), tuple(request.plans)),
            ranks=self.ranks,
            kill=request.kill,
            timeout=request.timeout,
        )
        ranks: list[RankOutcome] = []
        for o, out in zip(result.outcomes, request.outputs, strict=True):
            if o.output:
                with open(out, "a", encoding="utf-8") as f:
                    f.write(o.output)
            if o.status == "returned":
                ranks.append(RankOutcome(rank=o.rank, status="returned", value=o.value))
            elif o.status == "killed":
                ranks.append(crash_outcome(o))
            elif o.status == "raised":
                last = [line for line in o.error.strip().splitlines() if line.strip()][-1:] or [o.error]
                ranks.append(RankOutcome(rank=o.rank, status="raised", error=last[0], traceback=o.error))
            elif o.status == "ended":
                ranks.append(
                    RankOutcome(rank=o.rank, status="timeout", error=o.error or "ended with its sub-world")
                )
            else:
                ranks.append(RankOutcome(rank=o.rank, status="died", error=o.error or o.status))
        return RunOutcome(ranks=tuple(ranks), wall_s=monotonic() - start)
