"""The session store of clean results: a fault case takes the clean references the session already computed.

The lightning-sprite seed runs its fault cases "after the clean arms, each in fault_<name>/ against the clean
references": six clean arms and one faulted arm per case. Each test here stays independent (``-k wrong-scale``
alone computes what it needs), so the store does the sharing: :func:`obtain` gives a clean arm's record from
the store, or computes it and puts it there. Faulted results are never stored.

A result is keyed by everything that determines it (:func:`store_key`): the recipe's identity (model, rows and
their digest, seed, lr, steps, global batch, clip), its callables, the arm, the precision, the accumulation,
the world size and layout, the device kind and the strategy class. The store lives in the session's basetemp,
so ranks and sub-worlds on every node see it (``--basetemp`` on a shared filesystem on a cluster). Rank 0 does
every file operation: it holds a lock file per key while the arm computes, so two tests side by side that need
the same result compute it once and the other waits; results are written by atomic rename.

Trust, but check: reuse means something only for a deterministic recipe. The first time a session would reuse
a result, the arm is computed again and the two digests compared (:func:`record_digest`: every field but the
wall time and the source). If they differ, reuse is refused for the rest of the session with a message, and
every later arm is computed in its own test; the verdicts stay correct, only slower.

``--sprite-reuse=auto`` (default) or ``off`` (ini ``sprite_reuse``, environment ``SPRITE_REUSE``). Every arm run
the session computes is counted in the store (``runs.log``), on and off, so the progress lines (``-v``) say
how many arms the session trained. Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from pytest_sprite.glue.recorded_results import progress, running_item
from pytest_sprite.plumbing import tensor_pickle
from pytest_sprite.plumbing.mutants import current_run
from pytest_sprite.plumbing.phases import phase

if TYPE_CHECKING:
    from pytest_sprite.records import RecipeIdentity
    from pytest_sprite.world import World

__all__ = [
    "ReuseRefusedWarning",
    "SessionStore",
    "keep_files",
    "obtain",
    "record_digest",
    "resume_key",
    "session_store",
    "store_key",
]

STORE_DIR: Final = "sprite-store"
"""The store's directory in the session's basetemp."""
RUNS_LOG: Final = "runs.log"
"""One line per computation: ``<kind> <unit> <count> <test> <what>``; kind ``run`` or ``check``, unit ``arm``
or ``role``."""
_TRUST: Final = "trust"
"""The session's verdict on reuse: ``ok``, or ``refused`` and the message."""
_CLAIM: Final = "trust.claim"
"""Made (exclusively) by the test that runs the session's one reuse check."""
_ABOUT: Final = ".about.json"
"""Beside each ``<key>.pkl``: the test that computed it and its digest, what deciding and checking need."""
_SKIPPED_FIELDS: Final = ("wall_s", "source")
"""Record fields that differ between two runs of the same arm without meaning anything."""

R = TypeVar("R")


class ReuseRefusedWarning(UserWarning):
    """Two runs of the same clean arm differed: the session stops reusing results (``--sprite-reuse``)."""


@dataclass(frozen=True)
class Origin:
    """Where a record came from: computed in this test, or reused from another test's run."""

    reused_from: str | None = None
    """The test that computed the record, None when this test computed it."""

    def describe(self) -> str:
        return "computed in this test" if self.reused_from is None else f"reused from {self.reused_from}"


@dataclass(frozen=True)
class _Plan:
    """Rank 0's decision for one key, broadcast to every rank."""

    kind: str
    """``compute`` (lock held, store the result), ``reuse``, ``check`` (compute, compare) or ``alone``."""
    origin: str | None = None


class SessionStore:
    """The store of one session under ``root``; its file operations run on rank 0 only."""

    def __init__(self, root: Path, *, test: str) -> None:
        self.root = root
        self.test = test
        self._locks: dict[str, int] = {}

    # --- counting ------------------------------------------------------------------------------------

    def count_run(self, what: str, *, kind: str = "run", unit: str = "arm", units: int = 1) -> None:
        """Count ``units`` computed runs of ``unit`` (arm or role); kind ``run`` or ``check`` (a reuse check)."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = f"{kind} {unit} {units} {self.test} {what}\n".encode()
        fd = os.open(self.root / RUNS_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def counts(self) -> dict[str, int]:
        """Runs computed so far in the session (see :func:`run_counts`)."""
        return run_counts(self.root)

    # --- trust ---------------------------------------------------------------------------------------

    def trust(self) -> str | None:
        """``ok``, ``refused`` (with the message after a newline), or None while unchecked."""
        try:
            return (self.root / _TRUST).read_text()
        except FileNotFoundError:
            return None

    def claim_check(self) -> bool:
        """Whether this test runs the session's one reuse check (True for exactly one caller)."""
        try:
            os.close(os.open(self.root / _CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        return True

    def set_trust(self, text: str) -> None:
        _atomic_write(self.root / _TRUST, text.encode())

    # --- results -------------------------------------------------------------------------------------

    def begin(self, key: str) -> _Plan:
        """Decide what to do for ``key``; for ``compute`` the key's lock stays held until :meth:`finish`."""
        trust = self.trust()
        if trust is not None and trust.startswith("refused"):
            return _Plan("alone")
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        _lock(fd)  # waits while another test computes this result
        stored = self._about(key)
        if stored is None:
            self._locks[key] = fd
            return _Plan("compute")
        _unlock(fd)
        origin = stored["test"]
        if trust is None:
            return _Plan("check" if self.claim_check() else "alone", origin)
        return _Plan("reuse", origin)

    def finish(self, key: str, record: Any | None) -> None:
        """Store ``record`` (None: the arm failed, store nothing) and release the key's lock."""
        fd = self._locks.pop(key, None)
        try:
            if record is not None:
                entry = {"test": self.test, "digest": record_digest(record), "record": record}
                if key in _KEY_TEXT:
                    _atomic_write(self.root / f"{key}.json", _KEY_TEXT[key].encode())
                # its tensors as their bytes: each reuse reads them back ten times faster than torch's pickle
                _atomic_write(self.root / f"{key}.pkl", tensor_pickle.dumps(entry))
                # Written last: a key whose summary exists has its record stored in full.
                about = {"test": entry["test"], "digest": entry["digest"]}
                _atomic_write(self.root / f"{key}{_ABOUT}", json.dumps(about).encode())
        finally:
            if fd is not None:
                _unlock(fd)

    def load(self, key: str) -> Any:
        return record_of(self.load_bytes(key))

    def load_bytes(self, key: str) -> bytes:
        """The stored entry of ``key`` as written: what rank 0 broadcasts for every rank to unpickle once."""
        try:
            return (self.root / f"{key}.pkl").read_bytes()
        except FileNotFoundError:
            raise RuntimeError(f"the session store lost result {key} under {self.root}") from None

    def check(self, key: str, fresh: Any, what: str) -> str | None:
        """Compare a fresh run with the stored one; set the session's trust; the refusal message, if any."""
        entry = self._about(key)
        if entry is None:
            return None
        digest = record_digest(fresh)
        if digest == entry["digest"]:
            self.set_trust("ok\n")
            return None
        message = (
            f"two fault-free runs of the same clean arm ({what}) differ: {entry['test']} computed digest "
            f"{entry['digest'][:16]}, {self.test} computed {digest[:16]} with the same recipe identity, arm, "
            "precision, world and strategy. The recipe is not deterministic (unseeded randomness, "
            "nondeterministic kernels or reductions), so a stored result cannot stand in for a new run: reuse "
            "is refused for the rest of this session and every test computes its own clean references "
            "(the verdicts stay correct, only slower). Seed every random draw, or pass --sprite-reuse=off."
        )
        self.set_trust("refused\n" + message)
        return message

    def _about(self, key: str) -> dict[str, str] | None:
        """Who computed ``key`` and its digest, without unpickling the record (tens of ms per arm)."""
        try:
            about: dict[str, str] = json.loads((self.root / f"{key}{_ABOUT}").read_bytes())
        except FileNotFoundError:
            return None
        return about


def record_of(entry: bytes) -> Any:
    """The record in a stored entry's bytes."""
    return pickle.loads(entry)["record"]


def run_counts(root: Path) -> dict[str, int]:
    """The runs counted under a store directory: ``arm`` and ``role`` (training), ``arm check`` and
    ``role check`` (recomputed by the first reuse's check)."""
    counts = {"arm": 0, "role": 0, "arm check": 0, "role check": 0}
    try:
        lines = (root / RUNS_LOG).read_text().splitlines()
    except FileNotFoundError:
        return counts
    for line in lines:
        kind, unit, units = line.split(" ", 3)[:3]
        name = unit if kind == "run" else f"{unit} {kind}"
        counts[name] = counts.get(name, 0) + int(units)
    return counts


def _lock(fd: int) -> None:
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)


def _unlock(fd: int) -> None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a reader never sees half a result."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------------------
# keys and digests


def store_key(recipe: Any, request: Any, identity: RecipeIdentity, world: World) -> str:
    """A digest of everything that determines a clean arm's result (the store's file name for it).

    ``recipe`` is a :class:`~pytest_sprite.recipes.recipe.Recipe` and ``request`` a checked
    :class:`~pytest_sprite.recipes.arm_request.ArmRequest` (typed loosely: the store imports neither).
    """
    fields: dict[str, Any] = {
        "recipe": _recipe_fields(recipe),
        "identity": {f.name: getattr(identity, f.name) for f in dataclasses.fields(identity)},
        "arm": request.arm,
        "precision": request.precision,
        "accumulate": request.accumulate,
        "world": {"size": world.size, "local_size": world.local_size},
        "device": world.device.type,
        "strategy": _qualname(type(request.strategy)) if request.strategy is not None else None,
    }
    return _digest_of(fields)


def resume_key(recipe: Any, *, strategy: str, precision: str, ranks: int, world: World) -> str:
    """A digest of everything that determines the resume check's roles before the restore (``recipe``: a
    :class:`~pytest_sprite.recipes.resume_spec.ResumeRecipe`)."""
    fields: dict[str, Any] = {
        "roles": "before-restore",
        "recipe": _recipe_fields(recipe.source),
        "resume": {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name != "source"},
        "strategy": strategy,
        "precision": precision,
        "ranks": ranks,
        "world": {"size": world.size, "local_size": world.local_size},
        "device": world.device.type,
    }
    return _digest_of(fields)


def _recipe_fields(recipe: Any) -> dict[str, Any]:
    return {
        "class": _qualname(type(recipe)),
        "name": recipe.name,
        "model": _qualname(recipe.model),
        "rows": _qualname(recipe.rows),
        "loss": _qualname(recipe.loss),
        "shard": _qualname(recipe.shard),
        "linear_sites": list(recipe.linear_sites) if recipe.linear_sites is not None else None,
        "backbone": recipe.backbone,
        "adapter": recipe.adapter,
        "seed": recipe.seed,
        "lr": recipe.lr,
    }


_KEY_TEXT: dict[str, str] = {}
"""Each key this process made, as the JSON it digests (written beside the result as ``<key>.json``)."""


def _digest_of(fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, indent=1, default=repr)
    key = hashlib.sha256(text.encode()).hexdigest()[:32]
    _KEY_TEXT[key] = text
    return key


def _qualname(obj: object) -> str | None:
    """``module.qualname`` of a class or function; a callable object's class and its repr (lora_qwen's)."""
    if obj is None:
        return None
    if hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}:{obj!r}"


def record_digest(record: Any) -> str:
    """SHA-256 of a record's every field but the wall time and the source: equal digests, same result."""
    h = hashlib.sha256()
    _feed(
        h,
        {
            f.name: getattr(record, f.name)
            for f in dataclasses.fields(record)
            if f.name not in _SKIPPED_FIELDS
        },
    )
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(f"<{type(value).__name__}>".encode())
        _feed(h, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    elif isinstance(value, Mapping):
        h.update(b"{")
        for k in sorted(value, key=str):
            h.update(f"{k!s}:".encode())
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif type(value).__module__ == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
        from pytest_sprite.records import tensor_digest

        h.update(tensor_digest(value).encode())
    elif isinstance(value, float):
        h.update(float.hex(value).encode())
    else:
        h.update(repr(value).encode())
    h.update(b";")


# -------------------------------------------------------------------------------------------------------
# the one entry point the arm runners use


def reuse_mode() -> str | None:
    """``auto`` or ``off`` for the running test's session; None outside a pytest test.

    Always ``off`` in a ``--sprite-mutate`` mutant run: a stored clean result would stand in for the arm the
    mutant must break (the mutant would survive unseen), and a mutated one must never be stored.
    """
    item = running_item()
    if item is None:
        return None
    mutation = current_run()
    if mutation is not None and mutation.spec is not None:
        return "off"
    from pytest_sprite.glue.options import settings_key

    settings = item.config.stash.get(settings_key, None)
    return getattr(settings, "reuse", "auto") if settings is not None else "auto"


def keep_files(root: Path, name: str, key: str) -> str | None:
    """Copy ``root / name`` into the session store (rank 0) and return the copy's parent, which then holds
    ``name``; None when reuse is off or there is no store (the files stay where they are)."""
    import shutil

    store = session_store()
    if store is None or reuse_mode() == "off":
        return None
    dest = store.root / f"files-{key}-{os.getpid()}"
    shutil.copytree(root / name, dest / name)
    return str(dest)


def count_runs(world: World | None, what: str, *, unit: str, units: int) -> None:
    """Count runs computed outside :func:`obtain` (a resume check's roles after the restore); call on every rank."""
    if world is None or world.rank != 0 or units < 1:
        return
    store = session_store()
    if store is not None:
        store.count_run(what, unit=unit, units=units)


def session_store() -> SessionStore | None:
    """The running test's session store (in its basetemp), None outside a pytest test."""
    item = running_item()
    if item is None:
        return None
    from pytest_sprite.glue.pytest_internals import tmp_path_factory

    try:
        basetemp = Path(tmp_path_factory(item.config).getbasetemp())
    except Exception:  # no basetemp: nothing to share, the arm is computed as before
        return None
    return SessionStore(basetemp / STORE_DIR, test=item.nodeid)


def obtain(
    what: str,
    compute: Callable[[], R],
    *,
    world: World,
    key: Callable[[], str] | None,
    unit: str = "arm",
    units: int = 1,
) -> tuple[R, Origin]:
    """A clean arm's record from the store, or ``compute()`` on every rank (and stored); faulted: ``key=None``.

    Call on every rank of the test. ``what`` names the arm in progress lines and messages.
    """
    store = world.run_on_rank(0, session_store)
    mode = world.run_on_rank(0, reuse_mode)
    mine = store if world.rank == 0 else None
    if store is None or key is None or mode == "off":
        return _computed(what, compute, mine, unit=unit, units=units), Origin()
    k = key()
    plan = world.run_on_rank(0, store.begin, k)
    if plan.kind == "reuse":
        with phase("records"):
            record: R = record_of(world.run_on_rank(0, store.load_bytes, k))
        progress(f"{what}: reused from {plan.origin}{_tally(mine)}")
        return record, Origin(plan.origin)
    if plan.kind == "compute":
        done: R | None = None
        try:
            done = _computed(what, compute, mine, unit=unit, units=units)
        finally:
            if mine is not None:
                mine.finish(k, done)
        assert done is not None
        return done, Origin()
    if plan.kind == "check":
        fresh = _computed(what, compute, mine, kind="check", unit=unit, units=units)
        message = world.run_on_rank(0, store.check, k, fresh, what)
        if message is None:
            progress(f"{what}: reuse check passed (recomputed: the same digest as {plan.origin}'s)")
        else:
            progress(f"{what}: reuse refused: {message}")
            warnings.warn(ReuseRefusedWarning(message), stacklevel=2)
        return fresh, Origin()
    return _computed(what, compute, mine, unit=unit, units=units), Origin()


def _computed(
    what: str,
    compute: Callable[[], R],
    store: SessionStore | None,
    *,
    kind: str = "run",
    unit: str = "arm",
    units: int = 1,
) -> R:
    record = compute()
    if store is not None:
        store.count_run(what, kind=kind, unit=unit, units=units)
    progress(f"{what}: computed in this test{_tally(store)}")
    return record


def tally(counts: Mapping[str, int]) -> str:
    """``arm runs 14 + 1 reuse check, role runs 0``: what a session computed, for progress lines and benches."""
    parts = []
    for unit in ("arm", "role"):
        if counts.get(unit) or counts.get(f"{unit} check"):
            check = counts.get(f"{unit} check", 0)
            parts.append(
                f"{unit} runs this session: {counts[unit]}" + (f" + {check} reuse check" if check else "")
            )
    return ", ".join(parts)


def _tally(store: SessionStore | None) -> str:
    if store is None:
        return ""
    return f" ({tally(store.counts())})"
