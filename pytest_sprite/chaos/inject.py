"""Inside a run: record every file event under the watched directory, and die at the planned one.

Installed once per process (a forked run, or an interpreter started by the command form through
``sitecustomize``); never in the pytest process itself, because an audit hook cannot be removed.

- CPython audit hooks see ``open`` for writing, ``os.rename``/``os.replace``, ``os.remove``/``os.unlink``,
  ``os.rmdir``, ``os.mkdir`` (so ``os.makedirs``) and ``shutil.rmtree``. ``torch.distributed.checkpoint``'s
  ``FileSystemWriter`` writes through ``Path.open`` and ``Path.rename``, so its files are seen here as well.
- ``torch.save`` to a path and safetensors' ``save_file`` write from C++/Rust and raise no audit event, so they
  are wrapped (also when torch or safetensors is imported after the plan is installed).
- The planned event ends the process with ``os._exit(CRASH_EXIT_CODE)`` inside the event, before it takes effect.
  A torn crash lets the write happen and cuts the file to half its size: native writers right after they return,
  ``open()`` at the process's next file event or mark (or the end of the run), i.e. once Python has written it.

This emulates a process kill, not power loss: the page cache survives and writes are not reordered.
Stdlib only at import: torch and safetensors are patched only when the run imports them.
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
from pytest_sprite.chaos.events import FileEvent

__all__ = [
    "CRASH_EXIT_CODE",
    "OUTSIDE",
    "PLAN_ENV",
    "Plan",
    "finish",
    "install",
    "install_from_env",
    "installed_plan",
    "note_resumed_from",
    "note_save_complete",
]

CRASH_EXIT_CODE = 86
"""Exit status of a process that died at its planned crash point (so the matrix can tell it from a failure)."""

PLAN_ENV = "SPRITE_CHAOS_PLAN"
"""Environment variable that carries a JSON :class:`Plan` into an interpreter started by the command form."""

OUTSIDE = "<outside>"
"""How an event names a file outside the watched directory (the source of a temp file renamed into it)."""

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the injector of one process does: where to watch, where to log, and where (if anywhere) to die."""

    root: str
    """Watched directory (the run's training directory); events outside it are ignored."""
    log: str
    """This process's event log (JSON lines, appended)."""
    rank: int = 0
    """This process's rank, written into every event."""
    crash_at: int | None = None
    """Index of the event (among this rank's) where the process dies; None records only."""
    torn: bool = False
    """Die with the file of the planned event written and cut to half its size, instead of before the event."""

    def to_json(self) -> str:
        """The plan as the command form passes it in :data:`PLAN_ENV`."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan from :data:`PLAN_ENV`."""
        data = json.loads(text)
        return cls(
            root=str(data["root"]),
            log=str(data["log"]),
            rank=int(data.get("rank", 0)),
            crash_at=None if data.get("crash_at") is None else int(data["crash_at"]),
            torn=bool(data.get("torn", False)),
        )


class _Injector:
    """The per-process recorder and crash trigger (one instance, reached through the module global)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.root = os.path.realpath(plan.root)
        self.count = 0
        self.busy = False
        self.pending_tear: str | None = None
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

    def event(self, kind: str, path: str, dest: str | None = None) -> int | None:
        """Count and log one event; die here when it is the planned untorn one. None when it is not watched."""
        rel = self.relative(path)
        rel_dest = self.relative(dest) if dest is not None else None
        if rel is None and rel_dest is None:
            return None
        if self.pending_tear is not None:
            self.tear_and_exit(self.pending_tear)
        index = self.count
        self.count += 1
        # a file outside (a temp file renamed into place) is named only as such: its name is random per run
        shown = rel if rel is not None else OUTSIDE
        shown_dest = None
        if dest is not None:
            shown_dest = rel_dest if rel_dest is not None else OUTSIDE
        line = FileEvent(index=index, rank=self.plan.rank, kind=kind, path=shown, dest=shown_dest).to_dict()
        os.write(self.fd, (json.dumps(line) + "\n").encode())
        if index == self.plan.crash_at:
            if not self.plan.torn:
                os._exit(CRASH_EXIT_CODE)
            if kind == "open":
                self.pending_tear = os.path.abspath(path)
        return index

    def mark(self, mark: str, name: str) -> None:
        """Log a target's mark (a torn ``open()`` file is cut first: the target has finished writing it)."""
        if self.pending_tear is not None:
            self.tear_and_exit(self.pending_tear)
        line = {"mark": mark, "name": name, "rank": self.plan.rank, "after": self.count}
        os.write(self.fd, (json.dumps(line) + "\n").encode())

    def tear_and_exit(self, path: str) -> None:
        """Cut ``path`` to half its size and die, as a process killed in the middle of writing it."""
        self.busy = True
        try:
            size = os.path.getsize(path)
            os.truncate(path, size // 2)
        except OSError:
            pass  # the file is gone already (removed after writing): dying is all that is left
        os._exit(CRASH_EXIT_CODE)

    def is_planned_torn(self, index: int | None) -> bool:
        return index is not None and self.plan.torn and index == self.plan.crash_at

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
    """End of the run: a torn ``open()`` file still waiting for its cut is cut now (and the process dies)."""
    if _injector is not None and _injector.pending_tear is not None:
        _injector.tear_and_exit(_injector.pending_tear)


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
    """``real`` as an event: die before it, or (torn) after it with its file cut in half."""

    def writer(*args: Any, **kwargs: Any) -> Any:
        inj = _injector
        target = args[path_pos] if len(args) > path_pos else kwargs.get(path_kw)
        if inj is None or inj.busy or not isinstance(target, (str, bytes, os.PathLike)):
            return real(*args, **kwargs)
        path = os.path.abspath(os.fsdecode(target))
        inj.busy = True
        try:
            index = inj.event(kind, path)
            result = real(*args, **kwargs)  # its own opens and renames are part of this one event
        finally:
            inj.busy = False
        if inj.is_planned_torn(index):
            inj.tear_and_exit(path)
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
