"""Where each rank of a test sits on its nodes, and which devices it computes on.

Stdlib only: the controller places a test's ranks on its agents, and a rank places a sub-world's ranks on
the test's own ranks, by the same rule.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """Where one rank of a test sits: its local rank among the test's ranks on its node, their number,
    the node's index among the test's nodes, and its agent's device index (the launcher's local rank)."""

    local_rank: int
    local_size: int
    node: int
    device_index: int
    local_devices: tuple[int, ...]
    """The device indices of the test's ranks on this node, in local-rank order (``local_devices[local_rank]``
    is ``device_index``): what a Lightning Trainer needs as ``devices=`` so its LOCAL_RANK pick is this test's."""


def place(ranks: Sequence[tuple[Hashable, int]]) -> list[Placement]:
    """Where each rank of a test sits, from its agent's (node, device index), test rank r at ``ranks[r]``.

    Ranks share a node when their agents share a host and launcher node id; the test's nodes are numbered
    in order of their first rank, and its local ranks count its own ranks on each node. The device index is
    the agent's launcher local rank, so tests side by side never share a device; each rank also gets the
    device indices of its node's ranks of the test, which differ from 0..local_size-1 once tests are packed.
    """
    nodes: list[Hashable] = []
    devices: dict[Hashable, list[int]] = {}
    local: list[int] = []
    for node, device in ranks:
        if node not in nodes:
            nodes.append(node)
        on_node = devices.setdefault(node, [])
        local.append(len(on_node))
        on_node.append(device)
    return [
        Placement(
            local_rank=local[rank],
            local_size=len(devices[node]),
            node=nodes.index(node),
            device_index=device,
            local_devices=tuple(devices[node]),
        )
        for rank, (node, device) in enumerate(ranks)
    ]
