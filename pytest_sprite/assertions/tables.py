"""Plain-text tables and number formatting shared by every assertion.

The lightning-sprite procedure's measured tables are the model: one header row, one row per arm, figures with three
significant digits, small figures in short scientific notation (``2.40e-6``) and exact zeros as ``0``.
Each assertion defines its terminal table here as a :class:`Kind` (its title, the lightning-sprite procedure's column headers
and a function from one ``to_dict()`` payload to its rows), and ``pytest_sprite.report.kinds`` registers
that definition. Pure: no torch, no pytest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Kind",
    "Row",
    "figure_cell",
    "format_count",
    "format_figure",
    "format_limit",
    "pass_or_fail_kind",
    "render_table",
]


def format_figure(value: float) -> str:
    """Format a relative error or ratio as the lightning-sprite procedure's tables do.

    ``0`` for an exact zero, ``2.40e-6`` below 0.01, three significant digits otherwise
    (``0.238``, ``3``, ``47.5``); ``nan`` and ``inf`` spelled out so they are never mistaken for small.
    """
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if abs(value) < 0.01:
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.3g}"


def figure_cell(value: float | str | None) -> str:
    """A figure as a table cell: ``-`` for none, a string (a JSON payload's ``'inf'``) as it is."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format_figure(value)


def format_limit(value: float) -> str:
    """Format a tolerance as people write it: ``1e-4``, ``2.5e-3``, ``0.05``."""
    if 0 < abs(value) < 0.01:
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return f"{value:g}"


def format_count(changed: int, total: int) -> str:
    """``"0 of 290"``: how many of a set of tensors a check found changed."""
    return f"{changed} of {total}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, with a dashed rule under the header.

    Every row must have one cell per header; a mismatch is a programming error and raises.
    """
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(
                f"table row {i} has {len(row)} cells, the header has {len(headers)}: {list(row)!r}"
            )
    widths = [max([len(h)] + [len(r[c]) for r in rows]) for c, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of a kind's table: the cells under the kind's headers, and the row's verdict."""

    cells: tuple[str, ...]
    verdict: str
    """A word from the kind's ``verdicts``, e.g. ``pass`` or ``FAIL``."""
    figures: Mapping[str, float | int | str | None]
    """Key figures of the row for JUnit properties (name -> value)."""
    label: str
    """What the row is about (an arm, a crash point), used in property names."""


@dataclass(frozen=True, kw_only=True)
class Kind:
    """How the reports show one assertion kind."""

    kind: str
    """The ``kind`` of the payloads (``parity``, ``criterion_v2``, ``resume``, ``crash_consistency``)."""
    title: str
    """Heading of the kind's terminal table."""
    headers: tuple[str, ...]
    """Column headers after ``Test`` (the ``Verdict`` column is added by the table)."""
    rows: Callable[[Mapping[str, Any]], list[Row]]
    """One payload -> its rows."""
    bad_verdicts: frozenset[str]
    """Verdicts that are failures: shown first, and a stored one that re-judges into it fails ``judge``."""
    verdict_order: tuple[str, ...] = ()
    """Order of the counts line (verdicts not listed follow in order of appearance)."""
    unlisted: str = "(not listed)"
    """What a row missing from a payload's rows stands for (a crash matrix lists only the points that did
    not PASS), for ``judge``'s account of verdicts that changed."""


def pass_or_fail_kind(
    kind: str, title: str, headers: tuple[str, ...], rows: Callable[[Mapping[str, Any]], list[Row]]
) -> Kind:
    """A :class:`Kind` whose rows read ``pass`` / ``FAIL``, or a fault's verdict (``FAIL``, ``NOT REJECTED`` fail)."""
    bad, order = frozenset({"FAIL", "NOT REJECTED"}), ("pass", "FAIL", "rejected", "NOT REJECTED")
    return Kind(kind=kind, title=title, headers=headers, rows=rows, bad_verdicts=bad, verdict_order=order)
