"""The failure output the docs show is what the plugin prints: each sample is checked against a real run.

A block of output in a page is a sample when the line before its fence reads ``<!-- sample: NAME -->``. NAME is
a key of ``SOURCES`` below: the test file that produces that output, run here in a pytester session. Every line
of the sample must appear in one line of the real output once both are masked (numbers, hex addresses and
directories become placeholders, runs of spaces one space, rules of ``-``, ``=`` or ``_`` three characters); a
``...`` in a sample line stands for anything. So a sample may leave lines out, but none it shows can drift.

The hang (its test is the one its page shows) and the crash run in CI (about 16 s); the training samples (parity, criterion v2, a crash matrix) run with
``--run-slow``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from sprite_testing import run_pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)])
MARKER = re.compile(r"^<!--\s*sample:\s*([\w-]+)\s*-->\s*$")
FENCE = re.compile(r"^(`{3,})")


def page_example(page: str, defines: str) -> str:
    """The python block of ``page`` that defines ``defines``: the test a page shows is the one that runs."""
    text = (ROOT / page).read_text(encoding="utf-8")
    for block in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S):
        if f"def {defines}(" in block:
            return str(block)
    raise AssertionError(f"{page} shows no python block defining {defines}")


FAST = {
    "hang": page_example("docs/how-to/hangs-and-mismatches.md", "test_hang"),
    "crash": """
        import os
        import signal

        import pytest
        import torch
        import torch.distributed as dist


        @pytest.mark.ranks(2)
        def test_crash(world):
            if world.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))
    """,
}

SLOW = {
    "parity-failure": """
        import pytest

        from pytest_sprite import assert_parity


        @pytest.mark.ranks(4)
        def test_parity_fails(world, lora_qwen):
            ref = lora_qwen.run("single")
            assert_parity(ref, lora_qwen.run("ddp", fault="wrong-scale"))
    """,
    "parity-table": """
        import pytest

        from pytest_sprite import assert_parity, expect_fault_rejected


        @pytest.mark.ranks(2)
        def test_parity(world, lora_qwen):
            ref = lora_qwen.run("single")
            assert_parity(ref, lora_qwen.run("ddp"), lora_qwen.run("fsdp"))
            with expect_fault_rejected("wrong-scale"):
                assert_parity(ref, lora_qwen.run("ddp", fault="wrong-scale"))
    """,
    "criterion-verdict": """
        import pytest

        from pytest_sprite import assert_criterion_v2

        ARMS = ("ref32", "ref", "split", "split_premul", "ddp", "fsdp")


        @pytest.mark.ranks(2)
        def test_criterion_fault(world, lora_qwen):
            arms = {a: lora_qwen.run(a, precision="bf16-mixed", fault="wrong-scale" if a == "ddp" else None) for a in ARMS}
            assert_criterion_v2(arms)
    """,
    "crash-matrix": """
        from pytest_sprite import assert_crash_consistent, crash_fn
        from pytest_sprite.save_crashes.protocols import train_in_place, train_tmp_rename


        def test_in_place(tmp_path):
            assert_crash_consistent(crash_fn(train_in_place), out_dir=tmp_path / "chaos", max_points=3)


        def test_tmp_rename(tmp_path):
            assert_crash_consistent(crash_fn(train_tmp_rename), out_dir=tmp_path / "chaos", max_points=3)
    """,
}
SOURCES = {**FAST, **SLOW}


@dataclass(frozen=True)
class Sample:
    name: str
    where: str
    lines: tuple[str, ...]


def samples() -> list[Sample]:
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            marker = MARKER.match(line)
            if not marker:
                continue
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            where = f"{page.relative_to(ROOT)}:{i + 1}"
            assert fence, f"{where}: a sample marker must sit on the line before a fenced block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].rstrip() == fence.group(1))
            found.append(Sample(marker.group(1), where, tuple(lines[i + 2 : end])))
    return found


def mask(text: str) -> str:
    """What may differ between two runs of one failure: numbers, addresses, directories, widths of columns."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x#", text)
    text = re.sub(r"[\w.~-]*(?:/[\w.~-]+)*/", "", text)  # a directory, up to the file name
    text = re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", text)
    text = re.sub(r"([-=_])\1{2,}", r"\1\1\1", text)
    return " ".join(text.split())


def missing_lines(sample: Sample, output: str) -> list[str]:
    """The sample's lines that no line of the output shows (a ``...`` in a sample line matches anything)."""
    seen = [mask(line) for line in output.splitlines()]
    missing = []
    for line in sample.lines:
        pieces = [p for p in (mask(part) for part in line.split("...")) if p]
        if not pieces:
            continue
        pattern = re.compile(".*".join(re.escape(p) for p in pieces))
        if not any(pattern.search(out) for out in seen):
            missing.append(line)
    return missing


SAMPLES = samples()


def check_samples(pytester: pytest.Pytester, sources: dict[str, str], timeout: float) -> None:
    for name, code in sources.items():
        pytester.makepyfile(**{f"test_{name.replace('-', '_')}": textwrap.dedent(code)})
    result = run_pytest(pytester, "--ranks=4", "--sprite-device=cpu", timeout=timeout)
    output = result.stdout.str() + result.stderr.str()
    chosen = [s for s in SAMPLES if s.name in sources]
    assert {s.name for s in chosen} == set(sources), "a sample source that no page shows"
    problems = [
        f"{s.where} ({s.name}): not in the real output:\n    " + "\n    ".join(lines)
        for s in chosen
        if (lines := missing_lines(s, output))
    ]
    assert not problems, "\n".join(problems) + "\n\nthe real output:\n" + output[-12000:]


def test_every_sample_names_a_source_that_produces_it() -> None:
    assert SAMPLES, "no sample markers found: has the marker syntax changed?"
    unknown = [f"{s.where}: {s.name}" for s in SAMPLES if s.name not in SOURCES]
    assert not unknown, f"samples without a source in {Path(__file__).name}: {unknown}"


def test_a_masked_sample_line_matches_another_runs_numbers_and_not_another_text() -> None:
    sample = Sample("x", "page.md:1", ("rank 1 crashed with signal 9 (SIGKILL) at /tmp/a/test_x.py:12",))
    assert not missing_lines(sample, "  rank 3 crashed with signal 9 (SIGKILL) at /home/b/test_x.py:7\n")
    assert missing_lines(sample, "rank 3 exited with code 9 at /home/b/test_x.py:7\n") == list(sample.lines)
    ellipsis = Sample("x", "page.md:1", ("RuntimeError: ... Connection closed by peer ...",))
    assert not missing_lines(ellipsis, "RuntimeError: [gloo.cc:1] Connection closed by peer [127.0.0.1]:5\n")


def test_the_hang_and_crash_samples_are_what_a_real_run_prints(pytester: pytest.Pytester) -> None:
    check_samples(pytester, FAST, timeout=240)


@pytest.mark.slow
def test_the_training_samples_are_what_a_real_run_prints(pytester: pytest.Pytester) -> None:
    check_samples(pytester, SLOW, timeout=1800)
