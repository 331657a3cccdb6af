"""Each rank's captured output and log records, by phase, for the machine-readable reports.

pytest keeps what a test printed or logged as report sections (``Captured stdout call`` and so on); the
merged report shows them per rank (``Captured stdout call [rank 1]``) in the terminal, JUnit and
pytest-html. The JSON report carries them as data, one entry per rank, so the output of every rank
survives in CI, not only rank 0's. Each text is bounded: a runaway print loop on 96 ranks must not make
a report nobody can open; the cut keeps the start and the end and says where it cut and how much.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pytest import TestReport

__all__ = ["OUTPUT_LIMIT", "STREAMS", "bounded", "phase_output"]

OUTPUT_LIMIT: Final = 64 * 1024
"""Characters kept of one stream of one phase of one rank (the first quarter and the last three)."""

STREAMS: Final = {"Captured stdout": "stdout", "Captured stderr": "stderr", "Captured log": "log"}
"""pytest's section prefixes and the stream each names in the report."""


def bounded(text: str, limit: int = OUTPUT_LIMIT) -> str:
    """``text`` whole when it fits in ``limit`` characters, else its start and end around a line naming the cut."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    cut = len(text) - head - tail
    return (
        f"{text[:head]}\n[pytest-sprite: {cut} characters cut here; the first {head} and the last {tail} "
        f"of {len(text)} are kept]\n{text[-tail:]}"
    )


def phase_output(reports: Sequence[TestReport]) -> dict[str, dict[str, str]]:
    """Phase -> stream -> the text one rank's reports captured (streams with nothing captured are left out).

    A report repeats the sections of the phases before it (``Captured stdout call`` is on the teardown
    report too): each section is taken once, by its name, which says its phase.
    """
    sections: dict[str, str] = {}
    for report in reports:
        sections.update((name, content) for name, content in report.sections if content)
    out: dict[str, dict[str, str]] = {}
    for name, content in sections.items():
        prefix, _, phase = name.rpartition(" ")
        stream = STREAMS.get(prefix)
        if stream is not None:
            out.setdefault(phase, {})[stream] = bounded(content)
    return out
