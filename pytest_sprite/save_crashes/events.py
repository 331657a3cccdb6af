"""File events of a training run and the marks a target leaves: the unit a crash matrix is built from.

A run's event log is one JSON object a line, appended by the injector inside the run's process (with
``os.write``, so a line survives the process dying right after it). Two kinds of lines:

- an event: ``{"i": 3, "rank": 0, "kind": "torch.save", "path": "ckpt-5/model.pt", "dest": null}``, one per file
  operation under the watched directory, numbered per rank in the order the rank performed them;
- a mark: ``{"mark": "save_complete", "name": "ckpt-5", "rank": 0, "after": 4}``: what the target says it finished
  (or resumed from) after ``after`` events of that rank.

Pure and stdlib only: the injector (in the run) writes these lines and the matrix (in the test) reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pytest_sprite.assertions.crash_consistency import SCRATCH

__all__ = [
    "EVENT_KINDS",
    "MARK_KINDS",
    "SCRATCH",
    "TEARABLE_KINDS",
    "EventLog",
    "FileEvent",
    "Mark",
    "read_event_log",
]

EVENT_KINDS: tuple[str, ...] = (
    "open",
    "rename",
    "remove",
    "rmdir",
    "mkdir",
    "rmtree",
    "torch.save",
    "safetensors",
)
"""What the injector records: opens for writing, renames (``os.replace`` too), removes, directory creation and
removal (CPython audit events), and the native writers that raise no audit event (``torch.save`` to a path,
``safetensors``' ``save_file``)."""

TEARABLE_KINDS: frozenset[str] = frozenset({"open", "torch.save", "safetensors"})
"""Events that write a file's bytes: each gets a second crash point where the file is cut to half its size."""

MARK_KINDS: tuple[str, ...] = ("save_complete", "resumed_from")
"""Marks a target may leave: a checkpoint it finished saving, the checkpoint its run resumed from."""


@dataclass(frozen=True, kw_only=True)
class FileEvent:
    """One file operation of one rank, under the watched directory."""

    index: int
    """Position among this rank's events (0-based): the crash plan names an event by rank and index."""
    rank: int
    """Rank that performed it (0 in a one-process run)."""
    kind: str
    """One of :data:`EVENT_KINDS`."""
    path: str
    """The file or folder, POSIX-style relative to the watched directory (``<outside>`` when outside it)."""
    dest: str | None = None
    """Rename target, in the same form; None for other kinds."""

    @property
    def tearable(self) -> bool:
        """True when the event writes a file's bytes (it gets a torn crash point as well)."""
        return self.kind in TEARABLE_KINDS

    def describe(self) -> str:
        """``rename ckpt-5.tmp -> ckpt-5`` or ``torch.save ckpt-5/model.pt``."""
        if self.dest is not None:
            return f"{self.kind} {self.path} -> {self.dest}"
        return f"{self.kind} {self.path}"

    def same_operation(self, other: FileEvent) -> bool:
        """True when both describe the same operation on the same files (index and rank aside)."""
        return (self.kind, self.path, self.dest) == (other.kind, other.path, other.dest)

    def to_dict(self) -> dict[str, Any]:
        """The event's log line."""
        return {"i": self.index, "rank": self.rank, "kind": self.kind, "path": self.path, "dest": self.dest}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileEvent:
        """Read an event's log line back."""
        return cls(
            index=int(data["i"]),
            rank=int(data["rank"]),
            kind=str(data["kind"]),
            path=str(data["path"]),
            dest=None if data.get("dest") is None else str(data["dest"]),
        )


@dataclass(frozen=True, kw_only=True)
class Mark:
    """What a target said about its checkpoints at one point of its run."""

    mark: Literal["save_complete", "resumed_from"]
    """``save_complete``: every file of checkpoint ``name`` is in place; ``resumed_from``: the run loaded it."""
    name: str
    """Checkpoint name as the target spells it (``checkpoint-10``), or :data:`SCRATCH`."""
    rank: int
    """Rank that left the mark."""
    after: int
    """How many of this rank's events had happened when the mark was left."""

    def to_dict(self) -> dict[str, Any]:
        """The mark's log line."""
        return {"mark": self.mark, "name": self.name, "rank": self.rank, "after": self.after}


@dataclass(frozen=True, kw_only=True)
class EventLog:
    """Everything one run's processes logged, in log order."""

    events: tuple[FileEvent, ...]
    marks: tuple[Mark, ...]

    def for_rank(self, rank: int) -> tuple[FileEvent, ...]:
        """This rank's events in the order it performed them."""
        return tuple(e for e in self.events if e.rank == rank)

    def completed_saves(self) -> tuple[str, ...]:
        """Checkpoints marked complete, oldest first, each once (the first mark of a name counts)."""
        names: list[str] = []
        for m in self.marks:
            if m.mark == "save_complete" and m.name not in names:
                names.append(m.name)
        return tuple(names)

    def resumed_from(self) -> str | None:
        """The checkpoint the run said it resumed from (rank 0's mark first), None if it said nothing."""
        marks = sorted((m for m in self.marks if m.mark == "resumed_from"), key=lambda m: m.rank)
        return marks[0].name if marks else None


def read_event_log(*paths: str | Path) -> EventLog:
    """Read one or more per-rank log files into one log; missing files count as empty (a rank that logged nothing).

    A last line cut short by a dying process is ignored; any other malformed line raises ``ValueError`` naming it.
    """
    events: list[FileEvent] = []
    marks: list[Mark] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            continue
        lines = p.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                if n == len(lines) - 1:  # the final line, never finished: the process died writing it
                    continue
                raise ValueError(f"{p}:{n + 1}: not an event log line ({exc}): {line[:80]!r}") from None
            if "mark" in data:
                if data["mark"] not in MARK_KINDS:
                    raise ValueError(
                        f"{p}:{n + 1}: unknown mark {data['mark']!r}; marks: {', '.join(MARK_KINDS)}"
                    )
                marks.append(
                    Mark(
                        mark=data["mark"],
                        name=str(data["name"]),
                        rank=int(data["rank"]),
                        after=int(data["after"]),
                    )
                )
            else:
                event = FileEvent.from_dict(data)
                if event.kind not in EVENT_KINDS:
                    raise ValueError(f"{p}:{n + 1}: unknown event kind {event.kind!r}")
                events.append(event)
    return EventLog(events=tuple(events), marks=tuple(marks))
