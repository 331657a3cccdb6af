"""JUnit XML (``--junitxml``): per-rank outcomes and each assertion's key figures as testcase properties.

pytest's junitxml writes the properties of a test's *teardown* report, so they are added there, from the
session's store, before junitxml sees the report. Names: ``sprite.world_size``, ``sprite.rank<r>`` (the
rank's outcome), ``sprite.rank<r>.exit_code`` / ``.signal`` when it did not end cleanly, and per assertion
``sprite.<kind>[<i>].<row label>.verdict`` and ``.<figure>`` (``sprite.parity[0].ddp.pre_norm_rel``).
"""

from __future__ import annotations

from typing import Any

from pytest_sprite.report.logged_results import TestEntry

__all__ = ["junit_properties"]


def junit_properties(entry: TestEntry) -> list[tuple[str, Any]]:
    """The properties of one test, in a stable order."""
    props: list[tuple[str, Any]] = []
    if entry.ranks:
        props.append(("sprite.world_size", len(entry.ranks)))
    for rank in entry.ranks:
        r = rank["rank"]
        props.append((f"sprite.rank{r}", rank["outcome"]))
        if rank.get("signal") is not None:
            props.append((f"sprite.rank{r}.signal", rank["signal"]))
        elif rank.get("exit_code") not in (None, 0):
            props.append((f"sprite.rank{r}.exit_code", rank["exit_code"]))
    if not entry.assertions:
        return props
    # The assertion kinds import every assertion's tables: only a test that made an assertion loads them.
    from pytest_sprite.report.kinds import get_kind

    for i, payload in enumerate(entry.assertions):
        kind = get_kind(str(payload["kind"]))
        prefix = f"sprite.{kind.kind}[{i}]"
        for row in kind.rows(payload):
            props.append((f"{prefix}.{row.label}.verdict", row.verdict))
            props.extend((f"{prefix}.{row.label}.{name}", value) for name, value in row.figures.items())
    return props
