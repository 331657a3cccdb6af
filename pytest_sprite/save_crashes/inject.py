"""Inside a run: record every file event under the watched directory, and reach a kill point at each.

Installed once per process (a forked run, or an interpreter started by the command form through
``sitecustomize``); never in the pytest process itself, because an audit hook cannot be removed.

- CPython audit hooks see ``open`` for writing, ``os.rename``/``os.replace``, ``os.remove``/``os.unlink``,
  ``os.rmdir``, ``os.mkdir`` (so ``os.makedirs``) and ``shutil.rmtree``. ``torch.distributed.checkpoint``'s
  ``FileSystemWriter`` writes through ``Path.open`` and ``Path.rename``, so its files are seen here as well.
- ``torch.save`` to a path and safetensors' ``save_file`` write from C++/Rust and raise no audit event, so they
  are wrapped (also when torch or safetensors is imported after the plan is installed).
- Where a run dies is its kill plan's decision (a :class:`~pytest_sprite.subworld.KillAt` the matrix builds):
  every event is the kill point ``("file", i)``, reached inside the event before it takes effect, and every
  file write (:data:`~pytest_sprite.save_crashes.events.TEARABLE_KINDS`) also the point ``("written", i)``, reached
  once the file is written: native writers right after they return, ``open()`` at the process's next file
  event or mark (or the end of the run), i.e. once Python has written it. A kill at a ``written`` point first
  cuts the file to half its size: a torn write.
- In a sub-world rank (every run but the command form's) the points are the sub-world's
  :func:`~pytest_sprite.subworld.kill_point`: the sub-world's plan decides, kills the rank and records where
  (``killed_at``). An interpreter of the command form is no sub-world rank: its :class:`Plan` carries the same
  kill plan, the injector asks it at the same points and ends the process with ``os._exit(CRASH_EXIT_CODE)``.

This emulates a process kill, not power loss: the page cache survives and writes are not reordered.
No third-party import: torch and safetensors are patched only when the run imports them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

from pytest_sprite.assertions.crash_consistency import SCRATCH
from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.save_crashes.events import FileEvent
from pytest_sprite.subworld.plan import KillAt, KillPoint
from pytest_sprite.subworld.rank_body import in_subworld, kill_point

__all__ = [
    "CRASH_EXIT_CODE",
    "FILE_POINT",
    "OUTSIDE",
    "PLAN_ENV",
    "WRITTEN_POINT",
    "Plan",
    "finish",
    "install",
    "install_from_env",
    "installed_plan",
    "note_resumed_from",
    "note_save_complete",
]

CRASH_EXIT_CODE = 86
"""Exit status of a command-form interpreter that its kill plan killed (it has no sub-world to report to)."""

FILE_POINT = "file"
"""Kill point of file event ``i``, inside the event before it takes effect: ``kill_point("file", i)``."""

WRITTEN_POINT = "written"
"""Kill point after file write ``i`` is written; killing there cuts the file to half its size (torn)."""

PLAN_ENV = "SPRITE_CHAOS_PLAN"
"""Environment variable that carries a JSON :class:`Plan` into an interpreter started by the command form."""

OUTSIDE = "<outside>"
"""How an event names a file outside the watched directory (the source of a temp file renamed into it)."""

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the injector of one process does: where to watch and where to log (and, outside a sub-world, die)."""

    root: str
    """Watched directory (the run's training directory); events outside it are ignored."""
    log: str
    """This process's event log (JSON lines, appended)."""
    rank: int = 0
    """This process's rank, written into every event."""
    kill: KillAt | None = None
    """The run's kill plan, for an interpreter of the command form only (no sub-world rank: in one, the plan
    is the sub-world's ``kill=``). None records only."""

    def to_json(self) -> str:
        """The plan as the command form passes it in :data:`PLAN_ENV`."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan from :data:`PLAN_ENV`."""
        data = json.loads(text)
        kill = data.get("kill")
        return cls(
            root=str(data["root"]),
            log=str(data["log"]),
            rank=int(data.get("rank", 0)),
            kill=None
            if kill is None
            else KillAt(
                event=str(kill["event"]),
                at=int(kill["at"]),
                ranks=None if kill.get("ranks") is None else tuple(int(r) for r in kill["ranks"]),
                signum=int(kill["signum"]),
            ),
        )


class _Injector:
    """The per-process recorder and kill-point reporter (one instance, reached through the module global)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.root = os.path.realpath(plan.root)
        self.count = 0
        self.busy = False
        self.pending_written: tuple[int, str, str] | None = None
        """An ``open()`` write whose ``written`` point comes at the next event or mark: (index, path, detail)."""
        self.counts: dict[str, int] = {}
        os.makedirs(os.path.dirname(os.path.abspath(plan.log)), exist_ok=True)
        self.fd = os.open(plan.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    # --- paths -------------------------------------------------------------------------------------------

    def relative(self, path: str) -> str | None:
        """``path`` relative to the watched directory (POSIX), or None when it lies outside."""
        head, tail = os.path.split(os.path.abspath(path))
        real = os.path.join(os.path.realpath(head), tail)
        if real == self.root:
            return "."
        if not real.startswith(self.root + os.sep):
            return None
        return os.path.relpath(real, self.root).replace(os.sep, "/")

    # --- events ------------------------------------------------------------------------------------------

    def event(self, kind: str, path: str, dest: str | None = None) -> tuple[int, str] | None:
        """Count and log one event and reach its ``file`` point: (index, detail), or None when it is not watched."""
        rel = self.relative(path)
        rel_dest = self.relative(dest) if dest is not None else None
        if rel is None and rel_dest is None:
            return None
        self.reach_pending_written()
        index = self.count
        self.count += 1
        # a file outside (a temp file renamed into place) is named only as such: its name is random per run
        shown = rel if rel is not None else OUTSIDE
        shown_dest = None
        if dest is not None:
            shown_dest = rel_dest if rel_dest is not None else OUTSIDE
        line = FileEvent(index=index, rank=self.plan.rank, kind=kind, path=shown, dest=shown_dest).to_dict()
        os.write(self.fd, (json.dumps(line) + "\n").encode())
        detail = shown if shown_dest is None else f"{shown} -> {shown_dest}"
        self.reach(FILE_POINT, index, detail)
        if kind == "open":
            self.pending_written = (index, os.path.abspath(path), detail)
        return index, detail

    def mark(self, mark: str, name: str) -> None:
        """Log a target's mark (a pending ``open()`` write reaches its ``written`` point first: it is written)."""
        self.reach_pending_written()
        line = {"mark": mark, "name": name, "rank": self.plan.rank, "after": self.count}
        os.write(self.fd, (json.dumps(line) + "\n").encode())

    def reach(self, point: str, index: int, detail: str, *, tear: str | None = None) -> None:
        """Kill point ``(point, index)``: the kill plan decides; a kill at a ``written`` point tears ``tear`` first."""

        def cut() -> None:
            self.busy = True  # the process dies next: its own truncate is no event
            if tear is not None:
                _cut_to_half(tear)

        if in_subworld():
            kill_point(point, index, detail=detail, before_kill=cut)
            return
        kill = self.plan.kill
        if kill is None:
            return
        self.counts[point] = count = self.counts.get(point, 0) + 1
        if kill.should_kill(
            KillPoint(rank=self.plan.rank, event=point, count=count, index=index, detail=detail)
        ):
            cut()
            os._exit(CRASH_EXIT_CODE)

    def reach_pending_written(self) -> None:
        """The pending ``open()`` write is written now (the process moved on): its ``written`` point."""
        if self.pending_written is not None:
            index, path, detail = self.pending_written
            self.pending_written = None
            self.reach(WRITTEN_POINT, index, detail, tear=path)

    # --- the audit hook ----------------------------------------------------------------------------------

    def audit(self, name: str, args: tuple[Any, ...]) -> None:
        if self.busy:
            return
        if name == "import":
            return
        try:
            parsed = _parse_audit(name, args)
        except Exception:  # a shape this hook does not know: never break the run over it
            return
        if parsed is None:
            return
        self.busy = True
        try:
            kind, path, dest = parsed
            if kind == "mkdir" and os.path.isdir(path):
                return  # makedirs(exist_ok=True) on a folder that exists changes nothing
            self.event(kind, path, dest)
        finally:
            self.busy = False


def _cut_to_half(path: str) -> None:
    """Cut ``path`` to half its size, as a process killed in the middle of writing it leaves it."""
    try:
        os.truncate(path, os.path.getsize(path) // 2)
    except OSError:
        pass  # the file is gone already (removed after writing): dying is all that is left


def _resolve(path: Any, dir_fd: Any) -> str | None:
    """An audit argument as an absolute path (None for a file descriptor or an unknown type)."""
    if isinstance(path, int) or path is None:
        return None
    text = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(text):
        text = os.path.join(os.readlink(f"/proc/self/fd/{int(dir_fd)}"), text)
    return os.path.abspath(text)


def _parse_audit(name: str, args: tuple[Any, ...]) -> tuple[str, str, str | None] | None:
    """(kind, path, dest) for the audit events that change files, None for every other event."""
    if name == "open":
        path, mode, flags = args[0], args[1], args[2]
        if isinstance(flags, int) and flags & _WRITE_FLAGS:
            resolved = _resolve(path, None)
        elif isinstance(mode, str) and any(c in mode for c in "wax+"):
            resolved = _resolve(path, None)
        else:
            return None
        return None if resolved is None else ("open", resolved, None)
    if name == "os.rename":
        src, dst = _resolve(args[0], args[2]), _resolve(args[1], args[3])
        return None if src is None or dst is None else ("rename", src, dst)
    simple = {"os.remove": "remove", "os.rmdir": "rmdir", "shutil.rmtree": "rmtree"}
    if name in simple:
        resolved = _resolve(args[0], args[-1])
        return None if resolved is None else (simple[name], resolved, None)
    if name == "os.mkdir":
        resolved = _resolve(args[0], args[2])
        return None if resolved is None else ("mkdir", resolved, None)
    return None


_injector: _Injector | None = None


def installed_plan() -> Plan | None:
    """The plan this process runs under, None in an ordinary process."""
    return None if _injector is None else _injector.plan


def install(plan: Plan) -> None:
    """Start recording (and crashing) in this process. Once per process: audit hooks cannot be removed."""
    global _injector
    if _injector is not None:
        raise RuntimeError(f"a chaos plan is installed in this process already ({_injector.plan})")
    if plan.kill is not None and in_subworld():
        raise SpriteUsageError(
            f"Plan(kill={plan.kill!r}) in a sub-world rank: there the kill plan is the sub-world's; pass it as "
            "run_subworld(..., kill=...) and install the plan with kill=None"
        )
    _injector = _Injector(plan)
    sys.addaudithook(_injector.audit)
    _patch_native_writers()


def install_from_env() -> bool:
    """Install the plan in :data:`PLAN_ENV` if there is one (the command form's ``sitecustomize``)."""
    text = os.environ.get(PLAN_ENV)
    if not text:
        return False
    install(Plan.from_json(text))
    return True


def finish() -> None:
    """End of the run: the last ``open()`` write reaches its ``written`` point (where a torn plan dies)."""
    if _injector is not None:
        _injector.reach_pending_written()


def note_save_complete(name: str) -> None:
    """Say that checkpoint ``name`` is completely written; the matrix reports LOST_WORK only with these marks.

    A no-op outside a crash-consistency run, so a training function can call it unconditionally.
    """
    if _injector is not None:
        _injector.mark("save_complete", str(name))


def note_resumed_from(name: str | None) -> None:
    """Say which checkpoint this run resumed from (None: it found none and started from scratch)."""
    if _injector is not None:
        _injector.mark("resumed_from", SCRATCH if name is None else str(name))


# --- native writers ------------------------------------------------------------------------------------


def _wrap_writer(kind: str, real: Callable[..., Any], path_pos: int, path_kw: str) -> Callable[..., Any]:
    """``real`` as an event: its ``file`` point before it, its ``written`` point (torn) once it returns."""

    def writer(*args: Any, **kwargs: Any) -> Any:
        inj = _injector
        target = args[path_pos] if len(args) > path_pos else kwargs.get(path_kw)
        if inj is None or inj.busy or not isinstance(target, (str, bytes, os.PathLike)):
            return real(*args, **kwargs)
        path = os.path.abspath(os.fsdecode(target))
        inj.busy = True
        try:
            seen = inj.event(kind, path)
            result = real(*args, **kwargs)  # its own opens and renames are part of this one event
        finally:
            inj.busy = False
        if seen is not None:
            inj.reach(WRITTEN_POINT, *seen, tear=path)
        return result

    writer.__wrapped__ = real  # type: ignore[attr-defined]
    writer.__name__ = getattr(real, "__name__", kind)
    writer.__doc__ = getattr(real, "__doc__", None)
    return writer


def _patch_torch(torch: ModuleType) -> None:
    save = torch.save
    if getattr(save, "__wrapped__", None) is not None:
        return
    wrapped = _wrap_writer("torch.save", save, 1, "f")
    torch.save = wrapped  # type: ignore[attr-defined]
    serialization = sys.modules.get("torch.serialization")
    if serialization is not None and serialization.save is save:
        serialization.save = wrapped  # type: ignore[attr-defined]


def _patch_safetensors(module: ModuleType) -> None:
    real = getattr(module, "serialize_file", None)
    if real is None or getattr(real, "__wrapped__", None) is not None:
        return
    # save_file calls the module-global serialize_file, so callers that imported save_file by name are covered
    module.serialize_file = _wrap_writer("safetensors", real, 1, "filename")  # type: ignore[attr-defined]


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch": _patch_torch,
    "safetensors.torch": _patch_safetensors,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a native writer's module right after the run imports it."""

    def __init__(self) -> None:
        self._resolving: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PATCHES or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        real_exec = loader.exec_module
        patch = _PATCHES[fullname]

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _patch_native_writers() -> None:
    missing = False
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            missing = True
    if missing:
        sys.meta_path.insert(0, _PatchOnImport())
