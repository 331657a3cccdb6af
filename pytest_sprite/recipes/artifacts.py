"""``--sprite-artifacts DIR``: every arm's record on disk, in a fresh directory that is never overwritten.

Layout: ``DIR/<test id>/<NN>-<arm>[-acc<k>][-<fault>]/`` holding ``record.pt`` (the full record,
``torch.load(weights_only=True)``-safe) and ``record.json`` (its figures). ``NN`` counts the arms a test
ran, so two runs of the same arm in one test get two directories; running the session again into the
same DIR finds them present and refuses, as the seed's arms refuse to overwrite a result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_sprite.errors import SpriteUsageError

if TYPE_CHECKING:
    from pytest_sprite.records import ArmRecord, Bf16ArmRecord

__all__ = ["ArtifactDir", "ArtifactExistsError", "load_arm_record", "test_dir_name"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=+-]+")


class ArtifactExistsError(SpriteUsageError, FileExistsError):
    """An arm's artifact directory already exists; results are never overwritten."""


def test_dir_name(nodeid: str) -> str:
    """A file-system-safe directory name for a pytest node id (``tests/t.py::test[4]`` -> ``tests_t.py__test_4``)."""
    name = _UNSAFE.sub("_", nodeid.replace("::", "__")).strip("_.")
    return name or "test"


test_dir_name.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name


@dataclass(kw_only=True)
class ArtifactDir:
    """Where one test's arms write their records; counts arms so each gets its own fresh directory."""

    root: Path
    """``--sprite-artifacts`` directory."""
    test: str
    """Directory name of the test (see :func:`test_dir_name`)."""
    _count: int = field(default=0, repr=False)

    @classmethod
    def for_test(cls, root: str | os.PathLike[str], nodeid: str) -> ArtifactDir:
        """The artifact directory of the test ``nodeid`` under ``root``."""
        return cls(root=Path(root), test=test_dir_name(nodeid))

    def next_arm_dir(self, *, arm: str, accumulate: int = 1, fault: str | None = None) -> Path:
        """Claim the next arm directory name; refuse at once (before any training) if it already exists."""
        self._count += 1
        parts = [f"{self._count:02d}", arm]
        if accumulate != 1:
            parts.append(f"acc{accumulate}")
        if fault:
            parts.append(fault)
        path = self.root / self.test / "-".join(parts)
        if path.exists():
            raise _exists(path)
        return path

    def write(self, path: Path, record: ArmRecord | Bf16ArmRecord) -> Path:
        """Create ``path`` (it must not exist) and write the record into it; return the directory."""
        import torch

        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()  # exclusive: a directory created meanwhile by another run is refused too
        except FileExistsError:
            raise _exists(path) from None
        torch.save(record.to_dict(), path / "record.pt")
        with open(path / "record.json", "x", encoding="utf-8") as fh:
            json.dump(record.summary(), fh, indent=1, sort_keys=True)
            fh.write("\n")
        return path


def _exists(path: Path) -> ArtifactExistsError:
    return ArtifactExistsError(
        f"--sprite-artifacts: {path} already exists, and an arm never overwrites a result; "
        "pass a fresh --sprite-artifacts directory or remove the old one"
    )


def load_arm_record(path: str | os.PathLike[str]) -> ArmRecord | Bf16ArmRecord:
    """Read an arm record written under ``--sprite-artifacts`` (its directory or its ``record.pt``).

    Records judged offline compare exactly as they did in the test: ``assert_parity(load_arm_record(a), ...)``;
    a BF16 arm's record comes back as a ``Bf16ArmRecord`` for ``assert_criterion_v2``.
    """
    import torch

    from pytest_sprite.records import ArmRecord, Bf16ArmRecord

    p = Path(path)
    file = p / "record.pt" if p.is_dir() else p
    if not file.is_file():
        raise SpriteUsageError(f"no arm record at {file}; pass an arm directory under --sprite-artifacts")
    data = torch.load(file, map_location="cpu", weights_only=True)
    record = (
        Bf16ArmRecord.from_dict(data)
        if isinstance(data, dict) and data.get("kind") == "bf16"
        else ArmRecord.from_dict(data)
    )
    return dataclasses.replace(record, source=str(file.parent))
