"""The clock the harness uses, bound at import.

User tests that mock ``time`` must not break rank timeouts (pytest's own ``_pytest/timing.py``, #185).
"""

from __future__ import annotations

from time import monotonic, perf_counter, sleep
from time import time as wall

__all__ = ["monotonic", "perf_counter", "sleep", "wall"]
"""``wall``: seconds since the epoch, the clock pytest's reports' ``start`` and ``stop`` use (comparable
between the processes of one host), for the durations of phases the harness ended."""
