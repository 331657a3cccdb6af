"""``--sprite-profile`` inside a Lightning fit: its set-up, its steps and its teardown as phases.

Lightning builds this callback into every Trainer made in a profiled ranks test, through its public
``lightning.pytorch.callbacks_factory`` entry point (``pyproject.toml``), so a user's own fit is split as the
recipes' arms are. The time from Lightning's ``setup`` hook to the first batch is ``fit setup`` (the strategy
wraps the model, the optimizer is built), the batches are ``steps``, what follows the last one is
``teardown``. Outside a profiled test :func:`callbacks` returns nothing.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from ..plumbing import phases

__all__ = ["FitPhases", "callbacks"]


def callbacks() -> list[Any]:
    """Lightning's ``callbacks_factory`` entry point: the phase clock's callback, or none when it is off."""
    return [FitPhases()] if phases.enabled() else []


class FitPhases(Callback):
    """Opens and closes the fit's phases at Lightning's hooks; a fit that raises closes what it opened (and
    only that: the recipes' arms hold a ``fit setup`` phase of their own around ``trainer.fit``)."""

    def __init__(self) -> None:
        self.open: str | None = None

    def _switch(self, name: str | None) -> None:
        if self.open is not None:
            phases.leave(self.open)
        self.open = name
        if name is not None:
            phases.enter(name)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._switch("fit setup")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._switch("steps")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._switch("teardown")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._switch(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._switch(None)
