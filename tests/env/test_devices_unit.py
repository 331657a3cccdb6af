"""Devices of packed tests (issue 14), without processes: which device indices each rank of a test is given.

A packed ``ranks(2)`` test may sit on agents 4 and 5 of a node: its LOCAL_RANKs are 0 and 1, its devices 4 and
5. Every place that picks a device (the rank child, a sub-world rank, a recipe's Lightning Trainer) must pick
from the test's agents' devices, or two tests side by side share one. End to end: test_packing.py.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from pytest_sprite.launch.pool import AgentPool, Placement, _Agent, place
from pytest_sprite.subworld import _subworld_place
from pytest_sprite.world import World

pytestmark = pytest.mark.cpu

NODE_A = ("node-a", None)
NODE_B = ("node-b", None)


def test_a_test_on_agents_4_and_5_of_a_node_gets_devices_4_and_5() -> None:
    assert place([(NODE_A, 4), (NODE_A, 5)]) == [
        Placement(local_rank=0, local_size=2, node=0, device_index=4, local_devices=(4, 5)),
        Placement(local_rank=1, local_size=2, node=0, device_index=5, local_devices=(4, 5)),
    ]


def test_a_test_alone_gets_devices_0_to_n_minus_1_as_before() -> None:
    placements = place([(NODE_A, d) for d in range(4)])
    assert [p.local_rank for p in placements] == [p.device_index for p in placements] == [0, 1, 2, 3]
    assert {p.local_devices for p in placements} == {(0, 1, 2, 3)}


def test_a_test_across_two_nodes_gets_each_nodes_own_devices() -> None:
    placements = place([(NODE_A, 10), (NODE_A, 11), (NODE_B, 2), (NODE_B, 3)])
    assert [(p.node, p.local_rank, p.local_size) for p in placements] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    assert [p.local_devices for p in placements] == [(10, 11), (10, 11), (2, 3), (2, 3)]
    for p in placements:
        assert p.local_devices[p.local_rank] == p.device_index


def test_devices_follow_the_ranks_order_not_the_device_order() -> None:
    placements = place([(NODE_A, 7), (NODE_B, 0), (NODE_A, 3)])
    assert [p.local_devices for p in placements] == [(7, 3), (0,), (7, 3)]
    assert [p.local_rank for p in placements] == [0, 0, 1]


def test_the_pool_places_a_test_on_its_agents_launcher_local_ranks() -> None:
    pool = object.__new__(AgentPool)
    sock = socket.socket()
    try:
        pool.agents = {
            rank: _Agent(rank=rank, sock=sock, host="h", local_rank=rank % 8, node=("h", rank // 8), pid=rank)
            for rank in range(16)
        }
        assert [p.local_devices for p in pool.placement((4, 5))] == [(4, 5), (4, 5)]
        assert [p.device_index for p in pool.placement((13, 6))] == [5, 6]
        assert [p.local_devices for p in pool.placement((13, 6))] == [(5,), (6,)]
    finally:
        sock.close()


def test_a_sub_world_rank_takes_the_device_of_the_test_rank_it_runs_on() -> None:
    # a 4-rank test on devices 4..7 of one node starts a sub-world of 2: its ranks sit on test ranks 0 and 1
    layout = [(0, 4), (0, 5), (0, 6), (0, 7)]
    assert [_subworld_place(layout, 2, r) for r in (0, 1)] == [
        dict(rank=0, world_size=2, local_rank=0, local_size=2, node=0, device_index=4, local_devices=(4, 5)),
        dict(rank=1, world_size=2, local_rank=1, local_size=2, node=0, device_index=5, local_devices=(4, 5)),
    ]
    # across two nodes each node keeps its own devices
    layout = [(0, 10), (0, 11), (1, 2), (1, 3)]
    spread = [_subworld_place(layout, 4, r) for r in range(4)]
    assert [(s["local_rank"], s["device_index"], s["local_devices"]) for s in spread] == [
        (0, 10, (10, 11)),
        (1, 11, (10, 11)),
        (0, 2, (2, 3)),
        (1, 3, (2, 3)),
    ]


def fake_world(device: torch.device, local_devices: tuple[int, ...], size: int = 2) -> World:
    return World(
        rank=0,
        size=size,
        local_rank=0,
        local_size=len(local_devices),
        local_devices=local_devices,
        node=0,
        device=device,
        backend="gloo",
        _sink=lambda *a: None,
    )


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the recipes pass to the code under test's ``trainer_kwargs``."""
    lightning = pytest.importorskip("pytest_sprite.lightning")
    calls: list[dict[str, Any]] = []

    def trainer_kwargs(strategy: str, **kwargs: Any) -> dict[str, Any]:
        calls.append(dict(strategy=strategy, **kwargs))
        return {}

    monkeypatch.setattr(lightning, "trainer_kwargs", trainer_kwargs)
    return calls


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("accelerator", ["xpu", "cuda"])
def test_recipes_give_lightning_the_tests_own_devices_on_an_accelerator(
    recorded: list[dict[str, Any]], kind: str, accelerator: str
) -> None:
    from pytest_sprite.recipes.fit_kit import lightning_kwargs

    lightning_kwargs(kind, fake_world(torch.device(accelerator, 4), (4, 5)), "bf16-mixed")
    assert recorded == [
        dict(strategy=kind, devices=[4, 5], num_nodes=1, precision="bf16-mixed", accelerator=accelerator)
    ]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_recipes_keep_a_count_of_devices_on_cpu(recorded: list[dict[str, Any]], kind: str) -> None:
    from pytest_sprite.recipes.fit_kit import lightning_kwargs

    # a packed test's indices mean nothing on cpu: Lightning gets the number of local ranks, as before
    lightning_kwargs(kind, fake_world(torch.device("cpu"), (4, 5), size=4), "32-true")
    assert recorded == [dict(strategy=kind, devices=2, num_nodes=2, precision="32-true", accelerator="cpu")]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_world_spanning_its_nodes_unevenly_is_one_node_of_its_size(
    recorded: list[dict[str, Any]], kind: str
) -> None:
    from pytest_sprite.recipes.fit_kit import lightning_kwargs

    # a ranks(3) test on two hosts of two ranks: 2 + 1 (issue 25). Lightning's nodes are all alike, so a
    # rank whose node's share does not divide the world describes one node of the world's size
    lightning_kwargs(kind, fake_world(torch.device("cpu"), (0, 1), size=3), "32-true")  # host1's ranks
    lightning_kwargs(kind, fake_world(torch.device("cpu"), (0,), size=3), "32-true")  # host2's rank
    assert [(c["devices"], c["num_nodes"]) for c in recorded] == [(3, 1), (1, 3)]


def test_an_uneven_world_on_an_accelerator_pads_with_the_nodes_other_devices(
    recorded: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_sprite.errors import SpriteUsageError
    from pytest_sprite.recipes.fit_kit import lightning_kwargs

    world = fake_world(torch.device("cuda", 3), (3, 1), size=3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    lightning_kwargs("ddp", world, "32-true")
    # devices[LOCAL_RANK] stays each rank's own device; the spare (0) is one no rank of this node picks
    assert (recorded[0]["devices"], recorded[0]["num_nodes"]) == ([3, 1, 0], 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a node of two GPUs, both the test's
    with pytest.raises(SpriteUsageError, match=r"unevenly \(2 on this node\).* this node has 2 cuda devices"):
        lightning_kwargs("ddp", fake_world(torch.device("cuda", 0), (0, 1), size=3), "32-true")


def test_a_single_device_recipe_pins_the_ranks_own_device(recorded: list[dict[str, Any]]) -> None:
    from pytest_sprite.recipes.fit_kit import lightning_kwargs

    lightning_kwargs("single", fake_world(torch.device("xpu", 5), (4, 5)), "bf16-mixed")
    assert recorded[0]["devices"] == [5]


def test_lightning_gives_each_local_rank_its_listed_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator = pytest.importorskip("pytest_sprite.lightning.accelerator")
    from pytest_sprite.lightning._kwargs import trainer_kwargs

    monkeypatch.setattr(accelerator, "_xpu_count", lambda: 8)
    monkeypatch.setattr(accelerator.XPUAccelerator, "is_available", staticmethod(lambda: True))
    for kind in ("ddp", "fsdp"):
        kwargs = trainer_kwargs(kind, devices=[4, 5], accelerator="xpu", precision="32-true")
        assert kwargs["devices"] == [4, 5]
    parsed = accelerator.XPUAccelerator.parse_devices([4, 5])
    # Lightning's DDP and FSDP strategies compute on parallel_devices[LOCAL_RANK]
    assert accelerator.XPUAccelerator.get_parallel_devices(parsed) == [
        torch.device("xpu", 4),
        torch.device("xpu", 5),
    ]
