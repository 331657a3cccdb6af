"""Every rank's captured output and logs in every report: JSON (against the schema), JUnit, pytest-html."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET

import pytest
from sprite_testing import run_pytest

from pytest_sprite.glue.ranked_report import RANKED_ATTR, RankedReport, ranked_report
from pytest_sprite.launch.rank_entries import bounded

pytestmark = pytest.mark.cpu

TIMEOUT = 240

BODY = """
import logging
import os
import signal
import sys
import pytest

@pytest.fixture
def noisy(world):
    print(f"setup of rank {world.rank}")
    yield
    print(f"teardown of rank {world.rank}", file=sys.stderr)

@pytest.mark.ranks(2)
def test_rank1_fails(world, noisy):
    print(f"call of rank {world.rank}")
    logging.getLogger("mylib").warning("rank %d logged", world.rank)
    assert world.rank == 0

@pytest.mark.ranks(2)
def test_rank1_crashes(world):
    print(f"before the crash on rank {world.rank}", flush=True)
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_json_junit_and_html_carry_each_ranks_output(pytester: pytest.Pytester) -> None:
    import jsonschema

    from pytest_sprite.report.json_report import load_schema

    pytester.makepyfile(BODY)
    html = importlib.util.find_spec("pytest_html") is not None
    result = run_pytest(
        pytester,
        "--sprite-report=report.json",
        "--junitxml=junit.xml",
        "-o",
        "junit_logging=all",
        *(["--html=report.html"] if html else []),
        timeout=TIMEOUT,
    )
    result.assert_outcomes(failed=2)
    document = json.loads((pytester.path / "report.json").read_text())
    jsonschema.validate(document, load_schema())
    ranks = {t["nodeid"].split("::")[1]: t["ranks"] for t in document["tests"]}
    fails = ranks["test_rank1_fails"]
    for rank in (0, 1):
        output = fails[rank]["output"]
        assert output["setup"]["stdout"] == f"setup of rank {rank}\n"
        assert output["call"]["stdout"] == f"call of rank {rank}\n"
        assert f"rank {rank} logged" in output["call"]["log"]
        assert output["teardown"]["stderr"] == f"teardown of rank {rank}\n"
        assert "last_output" not in fails[rank]
    crashed = ranks["test_rank1_crashes"][1]
    assert crashed["output"] == {}  # its captured output died with it; the tail its process wrote survives
    assert "before the crash on rank 1" in crashed["last_output"]

    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    out = "".join(e.text or "" for e in cases["test_rank1_fails"].iter("system-out"))
    err = "".join(e.text or "" for e in cases["test_rank1_fails"].iter("system-err"))
    assert "[rank 1, call]\ncall of rank 1" in out and "[rank 0, setup]\nsetup of rank 0" in out
    assert "[rank 1, teardown]\nteardown of rank 1" in err
    assert "[rank 0, call]" in out and "rank 0 logged" in out

    if html:  # one section per rank, as the terminal shows them
        page = (pytester.path / "report.html").read_text()
        assert "Captured stdout call [rank 1]" in page and "Captured stdout call [rank 0]" in page


def test_a_runaway_output_is_cut_in_the_middle_and_says_so() -> None:
    text = "".join(f"line {i}\n" for i in range(100_000))
    cut = bounded(text, limit=1000)
    assert cut.startswith("line 0\n") and cut.endswith("line 99999\n")
    assert f"characters cut here; the first 250 and the last 750 of {len(text)} are kept" in cut
    assert bounded("short", limit=1000) == "short"


def test_a_merged_report_crosses_processes_as_a_plain_test_report(pytester: pytest.Pytester) -> None:
    """pytest-xdist's controller writes the JUnit XML from serialized reports: the ranks stay named."""
    config = pytester.parseconfigure()
    report = ranked_report(
        nodeid="t.py::test_a",
        location=("t.py", 1, "test_a"),
        keywords={},
        outcome="passed",
        longrepr=None,
        when="call",
        sections=[("Captured stdout call [rank 0]", "zero\n"), ("Captured stdout call [rank 1]", "one\n")],
    )
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    assert data["$report_type"] == "TestReport" and data[RANKED_ATTR] is True
    back = config.hook.pytest_report_from_serializable(config=config, data=json.loads(json.dumps(data)))
    assert isinstance(back, RankedReport)
    assert back.capstdout == "[rank 0, call]\nzero\n[rank 1, call]\none\n"
