"""BF16 parity, criterion v2: the public import path of :mod:`pytest_sprite.assertions.criterion`.

The assertion lives in the ``criterion`` package, one module per concern (results, invariants, scoring,
verdict, the terminal's table); this module keeps every name importable from where it always was.
"""

from __future__ import annotations

from pytest_sprite.assertions.criterion import assert_criterion_v2, results, tensor_gap
from pytest_sprite.assertions.criterion.results import *  # noqa: F403

__all__ = ["assert_criterion_v2", "tensor_gap"]
__all__ += results.__all__
