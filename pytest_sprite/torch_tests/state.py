"""What a rank of a torch test starts from: the parent's side (a small JSON file in the test's shared directory)
and its test child's spec."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

__all__ = ["STATE_FILE", "ParentState", "child_spec", "read_state", "write_state"]

STATE_FILE: Final = ".sprite-torch-parent.json"
"""Its name in the test's directory (the test's ``tmp_path``, which every rank sees)."""


@dataclass(frozen=True, kw_only=True)
class ParentState:
    """The parent's side after ``setUp``, as each rank needs it."""

    file_name: str = ""
    """``self.file_name``: the test's store file, the same path on every rank, created and never truncated."""
    env_set: dict[str, str] = field(default_factory=dict)
    """Variables ``setUpClass`` / ``setUp`` set or changed; a natively spawned child inherits them."""
    env_unset: list[str] = field(default_factory=list)
    """Variables they removed."""
    fake_pg: bool = False
    """The instance's ``fake_pg``, which torch passes to ``_run``."""
    skipped: str | None = None
    """``setUp`` raised ``unittest.SkipTest`` with this reason: every rank skips."""
    error: str | None = None
    """``setUp`` (or ``setUpClass``) raised: its traceback; every rank fails with it."""


def write_state(test_dir: Path, state: ParentState) -> None:
    """Write ``state`` for the ranks (atomically: a rank never reads half a file)."""
    tmp = test_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(state)), encoding="utf-8")
    tmp.replace(test_dir / STATE_FILE)


def read_state(test_dir: Path) -> ParentState:
    """The state the parent's side wrote; a clear error when it wrote none."""
    path = test_dir / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RuntimeError(
            f"the parent's side of this torch test (setUp, in the controller) left no {STATE_FILE} in "
            f"{test_dir}: it ended before setUp finished; see {test_dir / 'parent.log'}"
        ) from None
    return ParentState(**data)


def child_spec(item: pytest.Item) -> dict[str, Any]:
    """The test child's ``RunSpec`` (its rank, world size, the test's directory)."""
    child = item.config.pluginmanager.get_plugin("sprite-child")
    if child is None:
        raise RuntimeError("a torch test on ranks runs only in a test child")
    return dict(child.spec)
