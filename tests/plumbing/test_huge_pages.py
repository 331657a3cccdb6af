"""The heap of the process ranks are forked from, backed by huge pages once (issue 23)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads /proc (Linux)"),
]

# A fresh interpreter: the collapse acts on the whole process and happens once per line of forks.
COLLAPSE = textwrap.dedent(
    """
    import os, sys
    from pytest_sprite.plumbing.process import HUGE_PAGES_FROM_FORKS, collapse_heap_once

    forks = int(sys.argv[1])

    def huge_kb():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])

    heap = [bytearray(64 << 10) for _ in range(512)]  # 32 MiB of the heap to collapse
    before = huge_kb()
    collapsed = collapse_heap_once(forks=forks)
    pid = os.fork()
    if pid == 0:  # a fork inherits the decision: it does not collapse again
        os._exit(0 if collapse_heap_once(forks=HUGE_PAGES_FROM_FORKS) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    again = collapse_heap_once(forks=HUGE_PAGES_FROM_FORKS)
    print(collapsed, before, huge_kb(), again, os.waitstatus_to_exitcode(status))
    """
)


def _run(forks: int = 1000, env: dict[str, str] | None = None) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", COLLAPSE, str(forks)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return [int(x) for x in done.stdout.split()]


def _thp_never() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return not path.exists() or "[never]" in path.read_text()


@pytest.mark.skipif(_thp_never(), reason="transparent huge pages are off on this machine")
def test_the_heap_is_collapsed_once_and_its_forks_do_not_again() -> None:
    collapsed, before, after, again, fork_code = _run()
    if collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1)")
    assert collapsed >= 16 << 20  # most of the 32 MiB just allocated, in whole 2 MiB pages
    assert after - before >= collapsed // 1024 // 2  # the process now holds them as huge pages
    assert (again, fork_code) == (0, 0)


def test_sprite_huge_pages_0_turns_it_off() -> None:
    collapsed, before, after, _, _ = _run(env={**os.environ, "SPRITE_HUGE_PAGES": "0"})
    assert collapsed == 0 and after == before


def test_a_process_about_to_fork_few_children_does_not_pay_for_it() -> None:
    """Collapsing costs a few tenths of a second; a session of a few ranks tests would not win it back,
    and its forks, having inherited the decision, do not collapse either."""
    collapsed, before, after, again, fork_code = _run(forks=2)
    assert (collapsed, again, fork_code) == (0, 0, 0) and after == before
