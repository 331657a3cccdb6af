"""Helpers shared by the project's own tests."""

from __future__ import annotations


def fnescape(text: str) -> str:
    """``text`` as a literal fnmatch pattern (pytester's fnmatch_lines treats [] * ? as wildcards)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)
