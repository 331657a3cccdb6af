"""Rank-range text shared by the controller's merged reports and the assertions' tables.

Stdlib only: both sides of the process boundary import it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["fold_ranks"]


def fold_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"ranks 0-3"``; ``[1]`` -> ``"rank 1"``; ``[0, 2, 3]`` -> ``"ranks 0, 2-3"``."""
    ordered = sorted(set(ranks))
    if not ordered:
        raise ValueError("fold_ranks needs at least one rank")
    runs: list[tuple[int, int]] = []
    for r in ordered:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ordered) == 1 else f"ranks {text}"
