"""tmp_path of a ranks test: the controller's one basetemp, the same directories on every rank (issue 9)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.tmp_path import make_test_dir, prune_test_dir, share_tmp_path, tmp_path_name

pytestmark = pytest.mark.cpu

ITEM = "test_save_and_load[ranks2-with a long parameter]"


def configure(pytester: pytest.Pytester, *args: str) -> pytest.Config:
    return pytester.parseconfigure(*args)


def test_names_follow_pytests_tmp_path() -> None:
    assert tmp_path_name(ITEM) == "test_save_and_load_ranks2_with"


def test_every_rank_gets_the_controllers_directories(pytester: pytest.Pytester) -> None:
    controller = configure(pytester, f"--basetemp={pytester.path / 'base'}")
    basetemp, test_dir = make_test_dir(controller, ITEM, now=True, run_id=1)
    assert (basetemp, test_dir) == (
        pytester.path / "base",
        pytester.path / "base" / "test_save_and_load_ranks2_with0",
    )
    assert test_dir.is_dir()
    seen = []
    for _rank in range(
        2
    ):  # each rank's child has its own config (a fork): the same calls give the same paths
        child = configure(pytester, f"--basetemp={pytester.path / 'base'}")
        share_tmp_path(child, basetemp=basetemp, test_dir=test_dir, item_name=ITEM)
        factory = child._tmp_path_factory  # type: ignore[attr-defined]
        seen.append(
            (
                factory.getbasetemp(),
                factory.mktemp(tmp_path_name(ITEM), numbered=True),  # what the tmp_path fixture asks for
                factory.mktemp("data"),
                factory.mktemp("data"),
                factory.mktemp("fixed", numbered=False),
            )
        )
    name = test_dir.name
    assert (
        seen[0]
        == seen[1]
        == (
            basetemp,
            test_dir,
            basetemp / f"{name}-data0",
            basetemp / f"{name}-data1",
            basetemp / f"{name}-fixed",
        )
    )
    assert sorted(p.name for p in basetemp.iterdir() if not p.is_symlink()) == sorted(
        [name, f"{name}-data0", f"{name}-data1", f"{name}-fixed"]
    )


def test_a_second_test_gets_a_fresh_directory(pytester: pytest.Pytester) -> None:
    controller = configure(pytester)
    _, first = make_test_dir(controller, "test_x", now=True, run_id=1)
    _, second = make_test_dir(controller, "test_x", now=True, run_id=2)
    assert (first.name, second.name) == ("test_x0", "test_x1")


def test_a_test_that_asks_for_no_tmp_path_gets_its_directory_when_a_rank_first_needs_it(
    pytester: pytest.Pytester,
) -> None:
    """Named up front, out of pytest's numbering; made by the first rank that uses it (issue 23)."""
    controller = configure(pytester)
    basetemp, lazy = make_test_dir(controller, "test_x", now=False, run_id=4)
    assert lazy == basetemp / "test_x-run4" and not lazy.exists()
    _, numbered = make_test_dir(controller, "test_x", now=True, run_id=5)
    assert numbered.name == "test_x0"  # pytest's numbering does not count the named one
    for _rank in range(2):
        child = configure(pytester)
        share_tmp_path(child, basetemp=basetemp, test_dir=lazy, item_name="test_x")
        assert child._tmp_path_factory.mktemp("test_x") == lazy  # type: ignore[attr-defined]
    assert lazy.is_dir()
    prune_test_dir(controller, lazy, passed=True)
    assert not lazy.exists()  # left empty: pruned as an unused tmp_path is


def test_a_basetemp_this_host_cannot_see_is_a_clear_error(pytester: pytest.Pytester) -> None:
    child = configure(pytester)
    missing = pytester.path / "not-shared"
    share_tmp_path(child, basetemp=missing, test_dir=missing / "test_x0", item_name="test_x")
    with pytest.raises(SpriteUsageError) as exc:
        child._tmp_path_factory.mktemp("test_x")  # type: ignore[attr-defined]
    assert str(exc.value).startswith(f"the session's basetemp {missing} does not exist on this rank's host (")
    assert str(exc.value).endswith(
        "): the ranks of a test share tmp_path, so on a cluster the basetemp must be on a filesystem every node "
        "sees: pass --basetemp=DIR with DIR on it (e.g. --basetemp=$PWD/.sprite-tmp)"
    )


@pytest.mark.parametrize("bad", ["/abs", "../up", "a/b"])
def test_names_must_stay_in_the_basetemp(pytester: pytest.Pytester, bad: str) -> None:
    child = configure(pytester)
    share_tmp_path(child, basetemp=pytester.path, test_dir=pytester.path / "t0", item_name="t")
    with pytest.raises(ValueError, match=rf"^{bad} is not a normalized and relative path$"):
        child._tmp_path_factory.mktemp(bad)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("policy", "passed", "kept"),
    [("failed", True, False), ("failed", False, True), ("all", True, True), ("none", False, False)],
)
def test_retention_is_applied_once_by_the_controller(
    pytester: pytest.Pytester, policy: str, passed: bool, kept: bool
) -> None:
    pytester.makeini(f"[pytest]\ntmp_path_retention_policy = {policy}\n")
    controller = configure(pytester)
    basetemp, test_dir = make_test_dir(controller, "test_x", now=True, run_id=1)
    (basetemp / f"{test_dir.name}-data0").mkdir()
    (test_dir / "ckpt.pt").write_text("x")
    _, other = make_test_dir(controller, "test_y", now=True, run_id=2)
    prune_test_dir(controller, test_dir, passed=passed)
    assert test_dir.exists() is kept
    assert (basetemp / f"{test_dir.name}-data0").exists() is kept
    assert other.exists(), "other tests' directories are not touched"


def test_an_unused_test_directory_is_not_kept(pytester: pytest.Pytester) -> None:
    controller = configure(pytester)
    _, test_dir = make_test_dir(controller, "test_x", now=True, run_id=1)
    prune_test_dir(controller, test_dir, passed=False)  # pytest's default policy, all, keeps what was written
    assert not test_dir.exists()


def test_children_never_delete_shared_directories(pytester: pytest.Pytester) -> None:
    child = configure(pytester)
    share_tmp_path(child, basetemp=pytester.path, test_dir=pytester.path / "t0", item_name="t")
    assert child._tmp_path_factory._retention_policy == "all"  # type: ignore[attr-defined]


def test_rank_path_is_under_the_shared_tmp_path(tmp_path: Path) -> None:
    from pytest_sprite.world import World

    def world(rank: int) -> World:
        return World(
            rank=rank,
            size=2,
            local_rank=rank,
            local_size=2,
            local_devices=(0, 1),
            node=0,
            device=None,  # type: ignore[arg-type]
            backend="gloo",
            _sink=lambda *a: None,
            _test_dir=lambda: tmp_path,
        )

    assert world(1).rank_path("shard.pt") == tmp_path / "rank1" / "shard.pt"
    assert (tmp_path / "rank1").is_dir() and not (tmp_path / "rank1" / "shard.pt").exists()
    assert world(0).rank_path() == tmp_path / "rank0"
    for bad in ("..", "a/b", ""):
        with pytest.raises(
            ValueError, match=r"^world.rank_path takes plain names \(no separators, '.' or '..'\), got "
        ):
            world(0).rank_path(bad)


def test_rank_path_in_a_test_without_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_one(world, tmp_path):
            assert world.rank_path("log.txt") == tmp_path / "rank0" / "log.txt"
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
