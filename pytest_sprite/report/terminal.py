"""The terminal summary: one table per assertion kind that ran, failures first, and a line of counts.

Rows come from each kind's registered row function (``report.kinds``), so the tables print the
columns each check defines for every kind. ``-q`` keeps only the failing rows and the counts; ``--sprite-summary=no``
prints nothing. Colour only when pytest's terminal writer has markup (a TTY, or ``--color=yes``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_sprite.assertions.tables import render_table
from pytest_sprite.report.kinds import Kind, get_kind, verdict_counts
from pytest_sprite.report.logged_results import TestEntry

__all__ = ["KindTable", "build_tables", "render_kind_table", "render_text", "shown_nodeid", "write_summary"]


@dataclass(frozen=True, kw_only=True)
class KindTable:
    """One kind's rows over the whole session, ready to print."""

    kind: Kind
    rows: list[tuple[str, tuple[str, ...], str]]
    """(test id, cells, verdict), failures first, then in the order the tests ran."""

    @property
    def verdicts(self) -> list[str]:
        return [verdict for _, _, verdict in self.rows]

    @property
    def failed(self) -> int:
        return sum(1 for v in self.verdicts if v in self.kind.bad_verdicts)

    def counts(self) -> str:
        return f"{self.kind.kind}: {verdict_counts(self.verdicts, self.kind)}"


def build_tables(tests: Iterable[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[KindTable]:
    """Group every payload of every (test id, payloads) by kind (kinds in order of first appearance)."""
    grouped: dict[str, list[tuple[str, tuple[str, ...], str]]] = {}
    for test_id, payloads in tests:
        for payload in payloads:
            kind = get_kind(str(payload["kind"]))
            for row in kind.rows(payload):
                grouped.setdefault(kind.kind, []).append((test_id, row.cells, row.verdict))
    tables = []
    for name, rows in grouped.items():
        kind = get_kind(name)
        order = sorted(range(len(rows)), key=lambda i: (rows[i][2] not in kind.bad_verdicts, i))
        tables.append(KindTable(kind=kind, rows=[rows[i] for i in order]))
    return tables


def render_kind_table(table: KindTable, *, short: bool) -> list[tuple[str, bool | None]]:
    """Lines of one table, each with True (bad row), False (good row) or None (header, rule, counts)."""
    rows = [r for r in table.rows if not short or r[2] in table.kind.bad_verdicts]
    out: list[tuple[str, bool | None]] = []
    if rows:
        text = render_table(
            ("Test", *table.kind.headers, "Verdict"),
            [(test, *cells, verdict) for test, cells, verdict in rows],
        ).splitlines()
        out += [(text[0], None), (text[1], None)]
        out += [
            (line, verdict in table.kind.bad_verdicts)
            for line, (_, _, verdict) in zip(text[2:], rows, strict=True)
        ]
    out.append((table.counts(), None))
    return out


def shown_nodeid(config: pytest.Config, entry: TestEntry) -> str:
    """The test as pytest's own summary names it: the node id, its path made relative to the directory
    pytest was started in (``Config.cwd_relative_nodeid``).

    Run as ``pytest --pyargs pkg.test_module``, the module is the starting point itself and its node id has
    no path (``::test_x``); the test's file is named then, as ``pytest -vv`` names it (``<- path``).
    """
    path, sep, rest = entry.nodeid.partition("::")
    if not path and sep:
        path = entry.location[0].replace(os.sep, "/")
    start, root = config.invocation_params.dir, config.rootpath
    if start != root:
        path = os.path.relpath(root / path, start).replace(os.sep, "/")
    return f"{path}{sep}{rest}"


def write_summary(terminalreporter: Any, entries: Iterable[TestEntry], *, short: bool) -> None:
    """Print every kind's table through pytest's terminal reporter."""
    config = terminalreporter.config
    tables = build_tables((shown_nodeid(config, e), e.assertions) for e in entries)
    if not tables:
        return
    tr = terminalreporter
    for table in tables:
        tr.write_sep("=", f"sprite: {table.kind.title}", bold=True)
        for line, bad in render_kind_table(table, short=short):
            if bad is None:
                tr.write_line(line, bold=line == table.counts() and table.failed > 0)
            else:
                tr.write_line(line, red=bad, green=not bad)


def render_text(tables: Sequence[KindTable], *, short: bool = False) -> str:
    """Every table as plain text (for ``judge`` and for files), each under its title."""
    blocks = []
    for table in tables:
        lines = [f"== {table.kind.title} =="]
        lines += [line for line, _ in render_kind_table(table, short=short)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
