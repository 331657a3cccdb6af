"""The roll call: where each rank was, ranks at the same place folded into one line, the odd ones marked.

Pure and stdlib only, so a ranks test's failure (``launch/rollcall.py`` places its ranks from their
reports, ends and stacks) and a sub-world's timeout (``subworld/result.py`` places its ranks from their
outcomes and stacks) read the same way: 96 ranks in two lines, the rank that is elsewhere named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from .ranges import fold_ranks

__all__ = ["ROLL_CALL_PLACES", "place_groups", "roll_call_lines"]

ROLL_CALL_PLACES: Final = 7
"""Places listed one a line; further ones are summed up in one more line (a roll call stays within 10 lines)."""


def place_groups(places: Mapping[int, str]) -> list[tuple[list[int], str]]:
    """The ranks at each place (rank -> one line of text), in the order of each place's first rank."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(places):
        by_text.setdefault(places[rank], []).append(rank)
    return sorted(((ranks, text) for text, ranks in by_text.items()), key=lambda g: g[0][0])


def roll_call_lines(places: Mapping[int, str]) -> list[str]:
    """``where the N ranks were:`` and one line per place, ranks folded, the odd ones marked; at most 9 lines."""
    groups = place_groups(places)
    largest = max(len(ranks) for ranks, _ in groups)
    lines = [f"where the {len(places)} ranks were:"]
    for ranks, text in groups[:ROLL_CALL_PLACES]:
        odd = "  <- odd one out" if len(groups) > 1 and len(ranks) < largest and len(ranks) <= 2 else ""
        lines.append(f"  {fold_ranks(ranks)}: {text}{odd}")
    rest = groups[ROLL_CALL_PLACES:]
    if rest:
        more = [r for ranks, _ in rest for r in ranks]
        lines.append(f"  ... {len(rest)} more places: {fold_ranks(more)} (their stacks below)")
    return lines
