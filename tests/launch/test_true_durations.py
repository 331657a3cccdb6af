"""A phase's duration is the wall time it held its ranks, however it ended: terminal, JSON and JUnit agree.

Each body holds its ranks for a known least time before it ends by a timeout, a crash or a lost agent, so
every bound asserted below is one the phase cannot undercut (no timing race: the old figures were 0.02 s).
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

BODY = """
import os
import signal
import time
import pytest

@pytest.mark.ranks(2, timeout=2)
def test_times_out(world):
    if world.rank == 1:
        time.sleep(60)

@pytest.mark.ranks(2)
def test_crashes_after_a_second(world):
    if world.rank == 1:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)

@pytest.mark.ranks(2)
def test_loses_its_agent_after_a_second(world):
    if world.rank == 1:
        time.sleep(1)
        os.kill(os.getppid(), signal.SIGKILL)
"""

LEAST = {
    "test_times_out": 2.0,
    "test_crashes_after_a_second": 1.0,
    "test_loses_its_agent_after_a_second": 1.0,
}


def test_a_timeout_a_crash_and_a_lost_agent_report_the_time_they_held(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BODY)
    result = run_pytest(
        pytester, "--sprite-report=report.json", "--junitxml=junit.xml", "--durations=0", "-vv", timeout=240
    )
    result.assert_outcomes(failed=3)
    durations = {
        m["name"]: float(m["secs"])
        for m in re.finditer(r"^(?P<secs>[\d.]+)s call +\S+::(?P<name>\w+)$", result.stdout.str(), re.M)
    }
    document = json.loads((pytester.path / "report.json").read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in document["tests"]}
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    for name, least in LEAST.items():
        assert durations[name] >= least, (name, durations)
        assert tests[name]["call"]["duration"] >= least
        assert tests[name]["duration"] >= least
        assert tests[name]["ranks"][1]["duration"] >= least
        assert float(cases[name].get("time") or 0) >= least
    assert [r["outcome"] for r in tests["test_loses_its_agent_after_a_second"]["ranks"]][1] == "lost"
