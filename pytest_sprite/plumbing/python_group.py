"""A torch ``ProcessGroup`` made in Python, registered as a backend: the names torch's trampoline asks it for.

``--sprite-mutate``'s recording group (``rank/mutant_backend.py``) and a dry world's group
(``subworld/dry_world.py``) are both such groups; a group made in Python has no name of its own, so each keeps
the one torch's backend creator was given.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.distributed as dist

__all__ = ["PythonProcessGroup"]

_ProcessGroup: Any = dist.ProcessGroup
"""Its methods are overloaded in torch's stubs; the subclasses take torch's call forms."""


class PythonProcessGroup(_ProcessGroup):  # type: ignore[misc]
    """A process group whose collectives are Python methods, named as its backend and its creator say."""

    backend_name: ClassVar[str]
    """The name the backend was registered under (``Backend.register_backend``)."""

    def __init__(self, rank: int, size: int, name: str) -> None:
        super().__init__(rank, size)
        self.name_ = name

    def getBackendName(self) -> str:
        return self.backend_name

    def getGroupName(self) -> str:
        return self.name_
