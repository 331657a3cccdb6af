"""An agent's pristine zygote: nothing is forked until a test child asks for one (issue 23). No pytest session."""

from __future__ import annotations

import os
import select
from pathlib import Path

import pytest

from pytest_sprite.subworld import Pristine, Zygote

pytestmark = pytest.mark.cpu


def test_the_pristine_zygote_is_forked_at_the_first_request_and_ends_with_its_askers(tmp_path: Path) -> None:
    pristine = Pristine()
    assert pristine.pid is None and pristine.waiting() is not None
    held_r, held_w = os.pipe()  # a descriptor of the agent's that the zygote must not hold
    asker = os.fork()
    if asker == 0:  # a test child: asks for its own zygote, which answers with its pid
        code = 1
        try:
            zygote = Zygote.connect(pristine.client, 0)
            code = 0 if zygote.pid not in (0, os.getpid()) else 1
            zygote.close()
        finally:
            os._exit(code)
    asking = pristine.waiting()
    assert asking is not None
    ready, _, _ = select.select([asking], [], [], 60)
    assert ready, "the request never reached the agent's end"
    forgot = tmp_path / "forgot"

    def forget() -> None:  # runs in the zygote, after it closed the agent's descriptors
        try:
            os.fstat(held_w)
            forgot.write_text("held")
        except OSError:
            forgot.write_text("closed")

    pristine.start(close_fds=[held_w], forget=forget)
    assert pristine.pid is not None and pristine.waiting() is None
    _, status = os.waitpid(asker, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert forgot.read_text() == "closed"
    pristine.close()  # the last asking end: the zygote reads end of file and exits
    _, status = os.waitpid(pristine.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.close(held_r)
    os.close(held_w)


def _children() -> set[int]:
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        out |= {int(pid) for pid in Path(f"/proc/self/task/{tid}/children").read_text().split()}
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads processes from /proc (Linux)")
def test_a_pristine_never_asked_for_forks_nothing() -> None:
    before = _children()
    pristine = Pristine()
    assert _children() == before
    pristine.close()
    assert pristine.pid is None and _children() == before
