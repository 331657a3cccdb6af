"""Agents that fail before they can serve: each error shown once, with the ranks that saw it."""

from __future__ import annotations

import pytest

from pytest_sprite.launch import early_failures
from pytest_sprite.launch.early_failures import EarlyFailures, agents_failed, collection_differs

pytestmark = pytest.mark.cpu


def test_the_same_error_on_several_agents_is_shown_once() -> None:
    text = agents_failed({2: "SyntaxError: x", 1: "SyntaxError: x", 3: "SyntaxError: x"})
    assert text == "rank agents 1-3 failed before they could join the world:\nSyntaxError: x"


def test_different_errors_are_each_shown_under_their_ranks() -> None:
    text = agents_failed({1: "A", 3: "A", 2: "B", None: "C"})
    assert text.splitlines() == [
        "rank agents 1-3 failed before they could join the world, with 3 different errors:",
        "--- rank agents 1, 3 ---",
        "A",
        "--- rank agent 2 ---",
        "B",
        "--- a rank agent ---",
        "C",
    ]


def test_one_agent_reads_as_before() -> None:
    assert agents_failed({1: "boom"}) == "rank agent 1 failed before it could join the world:\nboom"


def test_collection_errors_fold_per_module_over_agents() -> None:
    text = collection_differs({2: {"t.py": "ImportError\n"}, 1: {"t.py": "ImportError", "u.py": "NameError"}})
    assert text.splitlines() == [
        "rank agents 1-2 could not collect what this process collected",
        "error collecting t.py on rank agents 1-2:",
        "ImportError",
        "error collecting u.py on rank agent 1:",
        "NameError",
    ]


def test_gathered_failures_are_due_once_every_agent_spoke_or_the_others_had_their_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(early_failures, "monotonic", lambda: now[0])
    gathered = EarlyFailures()
    assert not gathered.due(every_agent_spoke=True)  # nothing failed
    gathered.note(1, {"t.py": "ImportError"})
    assert not gathered.due(every_agent_spoke=False)
    assert gathered.due(every_agent_spoke=True)
    now[0] += early_failures.SETTLE + 0.1
    assert gathered.due(every_agent_spoke=False)
    assert gathered.take().startswith("rank agent 1 could not collect")
    assert not gathered.due(every_agent_spoke=True)  # taken once
