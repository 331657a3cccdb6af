"""Exceptions users may catch.

Every message says what was given, what is allowed and how to fix it, and names the source
(an option, a marker, an environment variable).
"""

from __future__ import annotations

__all__ = [
    "DebuggerUnavailableWarning",
    "LaunchError",
    "LeftoverProcessWarning",
    "RankEnvError",
    "SpriteError",
    "SpriteUsageError",
]


class SpriteError(Exception):
    """Base class of every error pytest-sprite raises on purpose."""


class SpriteUsageError(SpriteError, ValueError):
    """Bad input from the user: an option, a marker argument, an API argument."""


class RankEnvError(SpriteError, RuntimeError):
    """Launcher rank variables are missing or disagree, so this process cannot know its rank."""


class LaunchError(SpriteError, RuntimeError):
    """The launcher could not start the rank agents, or lost them."""


class LeftoverProcessWarning(UserWarning):
    """A ranks test left a process running; pytest-sprite ended it and names it (rank, pid, command)."""


class DebuggerUnavailableWarning(UserWarning):
    """``breakpoint()`` on a rank found no terminal to open in (CI, stdin not a terminal, an xdist worker) and
    returned at once; the warning says why."""
