"""Contract tests every placement policy must pass (pure: no SGLang), and each policy's exact eviction order on a
scripted set of candidates."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random

import pytest

from sglang_tiered.policy.placement import (
    PLACEMENTS,
    ImportancePlacement,
    LRUPlacement,
    NodeView,
    make_placement,
    rank,
)


def view(node_id: int, **kw) -> NodeView:
    base = dict(tokens=64, last_access=float(node_id), created=0.0, hits=1, on_host=False)
    return NodeView(node_id=node_id, **{**base, **kw})


def eviction_order(policy, nodes: list[NodeView]) -> list[int]:
    """The order SGLang's heap would pop these candidates in (ties broken by node id, as a stable heap would)."""
    heap = [(policy.priority(n), n.node_id) for n in nodes]
    heapq.heapify(heap)
    return [heapq.heappop(heap)[1] for _ in range(len(heap))]


def random_nodes(seed: int, n: int = 40) -> list[NodeView]:
    rng = random.Random(seed)
    return [view(i, tokens=64 * rng.randint(1, 8), last_access=float(rng.randint(0, 20)),
                 created=float(rng.randint(0, 20)), hits=rng.randint(0, 5), on_host=rng.random() < 0.5,
                 page_keys=tuple(f"k{i}.{j}" for j in range(rng.randint(1, 3))),
                 important_tokens=rng.random() * 64, reuses=rng.randint(0, 4),
                 clock=float(rng.choice([20, 100])), pinned=rng.random() < 0.2) for i in range(n)]


@pytest.fixture(params=sorted(PLACEMENTS))
def policy(request):
    return make_placement(request.param)


def test_priorities_are_tuples_comparable_across_any_nodes(policy):
    nodes = random_nodes(0)
    prios = [policy.priority(n) for n in nodes]
    assert all(isinstance(p, tuple) for p in prios)
    sorted(prios)  # a total order: no TypeError between any two


def test_priority_is_a_pure_function_of_the_view(policy):
    for a, b in itertools.product(random_nodes(1, 10), repeat=2):
        assert policy.priority(a) == policy.priority(view(a.node_id, **{k: getattr(a, k) for k in (
            "tokens", "last_access", "created", "hits", "on_host", "page_keys", "important_tokens", "reuses",
            "clock", "pinned")}))
        policy.priority(b)  # asking about another node changes nothing
    nodes = random_nodes(2, 10)
    assert [policy.priority(n) for n in nodes] == [policy.priority(n) for n in nodes]


def test_ties_go_to_the_least_recently_used(policy):
    old, new = view(1, last_access=3.0), view(2, last_access=9.0)
    assert policy.priority(old) < policy.priority(new)
    assert eviction_order(policy, [new, old]) == [1, 2]


def test_name_is_the_registry_key(policy):
    assert PLACEMENTS[policy.name] is type(policy)


def test_importance_keeps_the_node_with_more_important_tokens_per_token_and_more_reuses():
    p = make_placement("importance")
    base = view(1, tokens=128, important_tokens=32.0, reuses=1)
    assert p.priority(view(2, tokens=128, important_tokens=16.0, reuses=1)) < p.priority(base)  # less important
    assert p.priority(view(3, tokens=128, important_tokens=32.0, reuses=0)) < p.priority(base)  # reused less
    assert p.priority(view(4, tokens=1280, important_tokens=64.0, reuses=1)) < p.priority(base)  # long, dilute
    assert p.priority(view(5, tokens=128, important_tokens=32.0, reuses=1, last_access=0.5)) < p.priority(base)


def test_importance_evicts_recently_accessed_host_nodes_last_whatever_their_score():
    """A host node SGLang just loaded from SSD for a waiting request has the newest `last_access`; evicting it first
    would throw the load away. Within `recent` ticks of the clock a host node goes after every older one, least
    recently used first; older nodes rank by score. Device candidates rank by score whatever their age."""
    p = ImportancePlacement(recent=10.0)
    clock = 100.0
    popular = view(1, last_access=50.0, important_tokens=64.0, reuses=9)  # old, high score
    loaded = view(2, last_access=95.0, important_tokens=1.0)  # just prefetched, lowest score
    newest = view(3, last_access=99.0, important_tokens=64.0, reuses=9)
    stale = view(4, last_access=89.0, important_tokens=2.0)  # 11 ticks old: ranked by score
    host = [dataclasses.replace(n, on_host=True, clock=clock) for n in (popular, loaded, newest, stale)]
    assert eviction_order(p, host) == [4, 1, 2, 3]
    assert eviction_order(ImportancePlacement(recent=0.0), host) == [2, 4, 1, 3]
    device = [dataclasses.replace(n, clock=clock) for n in (popular, loaded, newest, stale)]
    assert eviction_order(p, device) == [2, 4, 1, 3]
    with pytest.raises(ValueError, match="recent"):
        ImportancePlacement(recent=-1.0)


def test_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="unknown placement 'mru'"):
        make_placement("mru")


EXPECTED = {  # node ids in eviction order for the scripted candidates below
    "lru": [4, 2, 0, 3, 1, 6, 7, 5],
    # scores (important tokens x (1 + reuses) / tokens): 0: 64*1/640=0.1, 1: 16*1/64=0.25, 2: 16*3/64=0.75,
    # 3: 0.25 (ties with 1, older), 4: 256*2/1280=0.4; 5: 1/64 and 6: 64*6/64=6 on host, recent (within 32 ticks
    # of the clock, 200): last, by recency; 7: 1/64 on device, recent but not protected
    "importance": [7, 0, 3, 1, 4, 2, 6, 5],
}


def test_exact_order_on_a_scripted_set():
    nodes = [view(0, last_access=5.0, hits=9, tokens=640, important_tokens=64.0),
             view(1, last_access=9.0, important_tokens=16.0),
             view(2, last_access=2.0, important_tokens=16.0, reuses=2),
             view(3, last_access=7.0, on_host=True, important_tokens=16.0),
             view(4, last_access=1.0, tokens=64 * 20, important_tokens=256.0, reuses=1),
             view(5, last_access=190.0, important_tokens=1.0, on_host=True),
             view(6, last_access=175.0, important_tokens=64.0, reuses=5, on_host=True),
             view(7, last_access=180.0, important_tokens=1.0)]
    nodes = [dataclasses.replace(n, clock=200.0) for n in nodes]
    assert sorted(EXPECTED) == sorted(PLACEMENTS), "every policy needs its scripted order"
    for name, order in EXPECTED.items():
        assert eviction_order(make_placement(name), nodes) == order, name
    assert eviction_order(LRUPlacement(), nodes) == sorted(range(8), key=lambda i: nodes[i].last_access)


def test_pinned_nodes_go_after_every_unpinned_node_of_their_tier(policy):
    """Retention: whatever the policy ranks first, a node holding pinned pages is evicted only when no unpinned
    candidate is left; among pinned nodes the policy's order holds."""
    nodes = random_nodes(3)
    heap = [(rank(policy, n), n.node_id) for n in nodes]
    heapq.heapify(heap)
    order = [heapq.heappop(heap)[1] for _ in range(len(heap))]
    pinned = [n.node_id for n in nodes if n.pinned]
    assert pinned and order[-len(pinned):] == sorted(pinned, key=lambda i: policy.priority(nodes[i]))
    unpinned = [n for n in nodes if not n.pinned]
    assert order[: len(unpinned)] == eviction_order(policy, unpinned)


def test_a_pin_outranks_importance_and_recency_exactly():
    nodes = [view(0, last_access=1.0, important_tokens=0.0, pinned=True),  # oldest, least important
             view(1, last_access=9.0, important_tokens=64.0, reuses=9),
             view(2, last_access=5.0, important_tokens=1.0)]
    for name, expected in {"lru": [2, 1, 0], "importance": [2, 1, 0]}.items():
        p = make_placement(name)
        assert sorted(range(3), key=lambda i: rank(p, nodes[i])) == expected, name
