"""``--sprite-artifacts DIR``: every arm's record on disk, in a fresh directory that is never overwritten.

Layout: ``DIR/<test id>/<NN>-<arm>[-acc<k>][-<fault>]/`` holding ``record.pt`` (the full record,
``torch.load(weights_only=True)``-safe) and ``record.json`` (its figures). A resume check stores its
whole run (every role's records, every rank) as ``DIR/<test id>/<NN>-resume-<strategy>[-<fault>]/resume-run.pt``.
``NN`` counts the arms and resume checks a test ran, so two runs of the same arm in one test get two
directories; running the session again into the same DIR finds them present and refuses, as the lightning-sprite procedure's
arms refuse to overwrite a result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_sprite.errors import SpriteUsageError

if TYPE_CHECKING:
    from pytest_sprite.records import ArmRecord, Bf16ArmRecord, ResumeRun

__all__ = [
    "RESUME_RUN_FILE",
    "ArtifactDir",
    "ArtifactExistsError",
    "load_arm_record",
    "load_resume_run",
    "test_artifacts",
    "test_dir_name",
    "write_resume_run",
]

RESUME_RUN_FILE = "resume-run.pt"
"""The file a resume check's whole run is stored in (``torch.load(weights_only=True)``-safe)."""

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
    """Where one test's arms and resume checks write their records; counts them so each gets a fresh directory."""

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
        parts = [arm]
        if accumulate != 1:
            parts.append(f"acc{accumulate}")
        if fault:
            parts.append(fault)
        return self._claim(parts)

    def next_resume_dir(self, *, strategy: str, fault: str | None = None) -> Path:
        """Claim the next directory for a resume check's run; refuse at once (before any role runs) if it exists."""
        return self._claim(["resume", strategy, *([fault] if fault else [])])

    def _claim(self, parts: list[str]) -> Path:
        self._count += 1
        path = self.root / self.test / "-".join([f"{self._count:02d}", *parts])
        if path.exists():
            raise _exists(path)
        return path

    def write(self, path: Path, record: ArmRecord | Bf16ArmRecord, *, origin: str | None = None) -> Path:
        """Create ``path`` (it must not exist) and write the record into it; return the directory.

        ``origin`` (``computed in this test``, ``reused from <test>``: see the session store) goes into
        ``record.json``, where ``python -m pytest_sprite judge`` names it.
        """
        import torch

        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()  # exclusive: a directory created meanwhile by another run is refused too
        except FileExistsError:
            raise _exists(path) from None
        torch.save(record.to_dict(), path / "record.pt")
        with open(path / "record.json", "x", encoding="utf-8") as fh:
            summary = record.summary() if origin is None else {**record.summary(), "origin": origin}
            json.dump(summary, fh, indent=1, sort_keys=True)
            fh.write("\n")
        return path


_artifacts_key = pytest.StashKey["ArtifactDir"]()


def test_artifacts(item: pytest.Item) -> ArtifactDir | None:
    """The running test's artifact directory under ``--sprite-artifacts``, None when the option is not set.

    One per test item (kept in its stash), so the ``lora_qwen`` arms and the resume checks of a test
    count their directories together.
    """
    from pytest_sprite.glue.options import settings_key

    root = item.config.stash[settings_key].artifacts
    if not root:
        return None
    artifacts = item.stash.get(_artifacts_key, None)
    if artifacts is None:
        artifacts = item.stash[_artifacts_key] = ArtifactDir.for_test(root, item.nodeid)
    return artifacts


test_artifacts.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name


def write_resume_run(run: ResumeRun, directory: str | os.PathLike[str], *, fresh: bool) -> Path:
    """Store ``run`` as ``resume-run.pt`` in ``directory`` and return the file; never overwrite one.

    ``fresh``: ``directory`` is a claimed ``--sprite-artifacts`` directory and must not exist yet. Otherwise
    (the check's checkpoint directory) the file is ``resume-run.pt``, or ``resume-run-02.pt``, ... when a
    run is stored there already.
    """
    import torch

    folder = Path(directory)
    if fresh:
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()  # exclusive: a directory created meanwhile by another run is refused too
        except FileExistsError:
            raise _exists(folder) from None
    folder.mkdir(parents=True, exist_ok=True)
    data = run.to_dict()
    stem, suffix = RESUME_RUN_FILE.rsplit(".", 1)
    n = 1
    while True:
        path = folder / (RESUME_RUN_FILE if n == 1 else f"{stem}-{n:02d}.{suffix}")
        try:
            with open(path, "xb") as fh:
                torch.save(data, fh)
            return path
        except FileExistsError:
            n += 1


def load_resume_run(path: str | os.PathLike[str]) -> ResumeRun:
    """Read a resume check's stored run (``resume-run.pt``, or the directory holding it), for ``judge_resume``."""
    import torch

    from pytest_sprite.records import ResumeRun

    p = Path(path)
    file = p / RESUME_RUN_FILE if p.is_dir() else p
    if not file.is_file():
        raise SpriteUsageError(
            f"no resume run at {file}; pass the {RESUME_RUN_FILE} an assert_resume_bitexact stored"
        )
    data = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise SpriteUsageError(
            f"{file} holds a {type(data).__name__}, not a resume run; pass the {RESUME_RUN_FILE} an "
            "assert_resume_bitexact stored"
        )
    try:
        run = ResumeRun.from_dict(data)
    except SpriteUsageError as exc:
        raise SpriteUsageError(f"{file}: {exc}") from None
    return dataclasses.replace(run, source=str(file))


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
