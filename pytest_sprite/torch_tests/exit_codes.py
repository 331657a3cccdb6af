"""torch's exit-code protocol, applied to the ranks' reports before they are merged.

torch's ``MultiProcessTestCase._check_return_codes`` decides a test from its processes' exit codes:
any process that exited with ``TEST_ERROR_EXIT_CODE`` (10, an exception in the test) fails it; a process
that did not exit (timeout) fails it; else, unless the method is in ``skip_return_code_checks``, rank 0's
code decides: a skip code skips the test with torch's message, the expected code (0, or the method's
``special_return_code_checks`` entry) passes it, any other code fails it. Only rank 0's code counts: a
peer that exited with a skip code or any other code does not change the outcome.

A rank's child reports its own code on its call report (``CODE_ATTR``): 10 as a failure, a skip code as
a skip, 0 and any other code as passed (so the harness does not end its peers for it); the rule below
then makes the merged outcome the one torch's runner gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

import pytest

from ..plumbing.dependency_internals import torch_multiprocess_module

__all__ = [
    "CODE_ATTR",
    "ERROR_EXIT_CODE",
    "Verdict",
    "apply_verdict",
    "exit_code",
    "skip_messages",
    "torch_verdict",
]

CODE_ATTR: Final = "sprite_torch_exit"
"""Attribute of a rank's call report: the exit code torch's rank process would have ended with."""
SKIPPED_ATTR: Final = "sprite_torch_skip"
"""Attribute of a rank's call report: True when its code is one of torch's skip codes."""
ERROR_EXIT_CODE: Final = 10
"""``MultiProcessTestCase.TEST_ERROR_EXIT_CODE``."""

Verdict = Literal["as-is", "pass", "skip", "wrong-code"]
"""``as-is``: the ranks' own reports stand (an error exit, or a rank that did not finish)."""


def torch_verdict(
    codes: Mapping[int, int | None],
    skips: Mapping[int, bool],
    *,
    world_size: int,
    skip_checks: bool,
    expected: int,
) -> Verdict:
    """torch's decision from each rank's exit code (None: the rank did not finish) and which codes skip."""
    if any(codes.get(rank) == ERROR_EXIT_CODE for rank in range(world_size)):
        return "as-is"
    if any(codes.get(rank) is None for rank in range(world_size)):
        return "as-is"
    if skip_checks:
        return "pass"
    if skips.get(0, False):
        return "skip"
    return "pass" if codes[0] == expected else "wrong-code"


def _call(reports: list[pytest.TestReport]) -> pytest.TestReport | None:
    return next((rep for rep in reports if rep.when == "call"), None)


def apply_verdict(
    reports: Mapping[int, list[pytest.TestReport]],
    ends: Mapping[int, Any],
    *,
    skip_checks: bool,
    expected: int,
    teardown_error: str | None,
) -> Verdict:
    """Change the ranks' call reports in place so that merging them gives torch's outcome; the verdict."""
    world_size = max([*reports, *ends, 0]) + 1 if (reports or ends) else 0
    calls = {rank: _call(list(reps)) for rank, reps in reports.items()}
    codes: dict[int, int | None] = {}
    skips: dict[int, bool] = {}
    for rank in range(world_size):
        end, call = ends.get(rank), calls.get(rank)
        clean = end is not None and bool(getattr(end, "clean", False))
        codes[rank] = getattr(call, CODE_ATTR, None) if clean and call is not None else None
        skips[rank] = bool(getattr(call, SKIPPED_ATTR, False))
    verdict = torch_verdict(codes, skips, world_size=world_size, skip_checks=skip_checks, expected=expected)
    first = calls.get(0)
    if verdict == "skip" and first is not None:
        for call in calls.values():
            if call is not None:
                call.outcome, call.longrepr = "skipped", first.longrepr
    elif verdict == "pass":
        for rank, call in calls.items():
            if call is not None and not call.passed:
                call.sections.append(
                    (
                        "torch exit code",
                        f"rank {rank} exited with code {codes[rank]}; torch's runner decides "
                        f"by rank 0's code ({codes[0]})"
                        + (" and skips the check for this test" if skip_checks else ""),
                    )
                )
                call.outcome, call.longrepr = "passed", None
    elif verdict == "wrong-code" and first is not None:
        detail = "\n".join(text for name, text in first.sections if "torch exit code" in name)
        first.outcome = "failed"
        first.longrepr = f"Expected exit code {expected} but got {codes[0]} on rank 0" + (
            f"\n{detail}" if detail else ""
        )
    if teardown_error is not None and first is not None:
        text = f"tearDown (the parent's side, in the controller) raised:\n{teardown_error}"
        if first.failed:
            first.sections.append(("tearDown", text))
        else:
            first.outcome, first.longrepr = "failed", text
    return verdict


def exit_code(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(value)`` would give (None: 0; an int: itself; anything else: 1)."""
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def skip_messages() -> dict[int, str]:
    """torch's skip exit codes and their messages (``TEST_SKIPS``)."""
    table = getattr(torch_multiprocess_module(), "TEST_SKIPS", {})
    return {int(skip.exit_code): str(skip.message) for skip in table.values()}
