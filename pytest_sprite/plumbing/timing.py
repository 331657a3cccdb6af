"""The clock the harness uses, bound at import.

User tests that mock ``time`` must not break rank timeouts (pytest's own ``_pytest/timing.py``, #185).
"""

from __future__ import annotations

from time import monotonic, perf_counter, sleep

__all__ = ["monotonic", "perf_counter", "sleep"]
