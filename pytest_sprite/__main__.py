"""``python -m pytest_sprite judge DIR``: re-judge stored assertion records offline (exit 1 on a failure).

``python -m pytest_sprite hosts N -- <pytest command>``: run a pytest command across N hosts made on this
machine (see :mod:`pytest_sprite.hosts`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pytest_sprite.errors import SpriteUsageError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 passed, 1 a failure or a changed verdict, 2 bad usage)."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["hosts"]:  # its own parser: everything after `--` is the pytest command, untouched
        from pytest_sprite.hosts.cli import main as hosts_main

        return hosts_main(words[1:])
    parser = argparse.ArgumentParser(prog="python -m pytest_sprite", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    judge = commands.add_parser(
        "judge",
        help="judge every stored assertion under DIR again (a --sprite-artifacts directory, or a copy of it)",
    )
    judge.add_argument("directory", metavar="DIR", type=Path)
    judge.add_argument("-q", "--quiet", action="store_true", help="print only failing rows and the counts")
    commands.add_parser(
        "hosts", help="run a pytest command across N hosts made here (hosts --help)", add_help=False
    )
    args = parser.parse_args(words)

    from pytest_sprite.report.rejudge import judge_directory
    from pytest_sprite.report.terminal import build_tables, render_text

    try:
        judged = judge_directory(args.directory)
    except SpriteUsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_text(build_tables((j.test_id, [j.result]) for j in judged), short=args.quiet))
    for j in judged:
        if any("reused from" in o for o in j.origins):
            print(f"clean references of {j.test_id}: {'; '.join(j.origins)}")
    changed = [(j, line) for j in judged for line in j.changed]
    for j, line in changed:
        print(f"verdict changed since the run: {j.test_id}: {line}")
    failed = sum(1 for j in judged if j.failed)
    print(f"\njudged {len(judged)} stored assertions: {failed} failed, {len(changed)} verdicts changed")
    return 1 if failed or changed else 0


if __name__ == "__main__":
    sys.exit(main())
