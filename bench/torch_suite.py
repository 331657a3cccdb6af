"""A torch distributed test file natively and with ``--torch-tests=ranks``, side by side in one run (issue 26).

Runs pytest over the given files (bodies unchanged: torch's own ``test/distributed/`` files, or any written
in its idiom) once per mode: ``native`` (torch spawns its processes), ``pack-on`` and ``pack-off``
(``--torch-tests=ranks`` with ``--pack=on`` / ``--pack=off``). Each session writes JUnit XML; the script
prints the counts per outcome and the wall time of each mode, the speed-up over native, and every test whose
outcome differs from its native one, with the reasons both ways. The load average is printed around each
session: on a shared machine the times move with it.

Usage::

    python bench/torch_suite.py test_api.py [more files] [-k EXPR] [--env NAME=VALUE] [--modes native,pack-on]

The files run from their own folder (run it where they import from). torch's ``test_distributed_spawn.py``
needs ``--env BACKEND=gloo --env WORLD_SIZE=2 --env TEMP_DIR=... --env INIT_METHOD=file://...``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

MODES = {
    "native": [],
    "pack-on": ["--torch-tests=ranks", "--pack=on"],
    "pack-off": ["--torch-tests=ranks", "--pack=off"],
}
"""Each mode's pytest options."""


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Each test's outcome (passed, failed, error, skipped) and the first line of its reason, from JUnit XML."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}.{case.get('name')}"
        outcome, reason = "passed", ""
        for kind, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(kind)
            if node is not None:
                text = (node.get("message") or node.text or "").strip()
                outcome, reason = word, (text.splitlines() or [""])[0][:160]
                break
        found[test] = (outcome, reason)
    return found


def run(
    mode: str, files: list[Path], root: Path, select: str | None, env: dict[str, str]
) -> dict[str, object]:
    junit = root / f"{mode}.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
    cmd += [f"--basetemp={root / ('tmp-' + mode)}", *MODES[mode], *(str(f) for f in files)]
    if select:
        cmd += ["-k", select]
    before = load()
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=files[0].parent, capture_output=True, text=True, env={**os.environ, **env})
    wall = time.perf_counter() - start
    tail = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(
        f"  {mode:>8}: {wall:7.1f} s  exit {done.returncode}  load {before} -> {load()}  {tail}", flush=True
    )
    if not junit.exists():
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
        return {"wall": wall, "tests": {}}
    return {"wall": wall, "tests": outcomes(junit)}


def report(results: dict[str, dict[str, object]]) -> int:
    """Print the table and the differences; the number of tests whose outcome differs from native."""
    print(
        "\n| mode | passed | failed | error | skipped | time | speed-up |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    native = results.get("native")
    for mode, result in results.items():
        tests: dict[str, tuple[str, str]] = result["tests"]  # type: ignore[assignment]
        counts = {
            kind: sum(1 for o, _ in tests.values() if o == kind)
            for kind in ("passed", "failed", "error", "skipped")
        }
        wall = float(result["wall"])  # type: ignore[arg-type]
        ratio = f"{float(native['wall']) / wall:.1f}x" if native is not None else ""  # type: ignore[arg-type]
        print(
            f"| {mode} | {counts['passed']} | {counts['failed']} | {counts['error']} | {counts['skipped']} "
            f"| {wall:.1f} s | {ratio} |"
        )
    differing = 0
    if native is not None:
        base: dict[str, tuple[str, str]] = native["tests"]  # type: ignore[assignment]
        for mode, result in results.items():
            tests: dict[str, tuple[str, str]] = result["tests"]  # type: ignore[no-redef]
            for test in sorted(set(base) | set(tests)):
                ours, theirs = tests.get(test, ("absent", "")), base.get(test, ("absent", ""))
                if ours[0] != theirs[0]:
                    differing += 1
                    print(f"DIFFERS {mode}: {test}: native {theirs[0]} ({theirs[1]}) / {ours[0]} ({ours[1]})")
    print(f"\n{differing} differing outcome(s)")
    return differing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("-k", dest="select")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every session")
    parser.add_argument("--modes", default="native,pack-on,pack-off")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    files = [path.resolve() for path in args.files]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        results = {mode: run(mode, files, Path(tmp), args.select, env) for mode in args.modes.split(",")}
    return 1 if report(results) else 0


if __name__ == "__main__":
    sys.exit(main())
