"""The eviction order of a tier (pure: no SGLang): LRU, with retention pins after every unpinned node."""

from __future__ import annotations

import heapq
import random

from sglang_tiered.policy.placement import NodeView, host_pool_shortfall, rank


def eviction_order(nodes: list[NodeView]) -> list[int]:
    """The order SGLang's heap would pop these candidates in (ties broken by node id, as a stable heap would)."""
    heap = [(rank(n), n.node_id) for n in nodes]
    heapq.heapify(heap)
    return [heapq.heappop(heap)[1] for _ in range(len(heap))]


def random_nodes(seed: int, n: int = 40) -> list[NodeView]:
    rng = random.Random(seed)
    return [NodeView(i, last_access=float(rng.randint(0, 20)), pinned=rng.random() < 0.2) for i in range(n)]


def test_unpinned_nodes_go_least_recently_used_first():
    nodes = [NodeView(0, 5.0), NodeView(1, 9.0), NodeView(2, 2.0), NodeView(3, 7.0)]
    assert eviction_order(nodes) == [2, 0, 3, 1]


def test_pinned_nodes_go_after_every_unpinned_node_in_lru_order():
    nodes = random_nodes(3)
    order = eviction_order(nodes)
    pinned = [n for n in nodes if n.pinned]
    unpinned = [n for n in nodes if not n.pinned]
    assert pinned and unpinned
    assert order[: len(unpinned)] == eviction_order(unpinned)
    assert order[len(unpinned):] == eviction_order([NodeView(n.node_id, n.last_access) for n in pinned])


def test_a_pin_outranks_recency_exactly():
    nodes = [NodeView(0, 1.0, pinned=True), NodeView(1, 9.0), NodeView(2, 5.0)]  # the oldest is pinned
    assert eviction_order(nodes) == [2, 1, 0]


def test_rank_is_a_pure_function_of_the_view():
    for node in random_nodes(1, 10):
        assert rank(node) == rank(NodeView(node.node_id, node.last_access, node.pinned))


def test_a_host_pool_smaller_than_the_device_pool_is_named_with_its_consequence():
    assert host_pool_shortfall(8192, 4096) is None and host_pool_shortfall(4096, 4096) is None
    message = host_pool_shortfall(1152, 4096)
    assert message is not None and "1152" in message and "4096" in message
    assert "never reaches the SSD tier" in message and "--tiered-host-size" in message
