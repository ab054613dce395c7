"""Placement: which radix-tree node leaves device memory (or host memory) first. Pure: no SGLang, no torch.

SGLang evicts whole *leaf nodes* of its radix tree, one tier at a time: device leaves while device slots are
needed, then host leaves (nodes already evicted from device) while host slots are needed. It keeps one heap of
candidates per tier and pops the lowest priority first; a policy only ranks the candidates it is shown, it cannot
evict an inner one. `integration/radix_cache.py` adapts `rank` onto SGLang's `EvictionStrategy.get_priority`,
building a `NodeView` of each candidate.

The eviction order of a tier, one comparison: `rank(placement, node) = (node.pinned, *placement.priority(node))`. A
node holding pages that a request asked to retain (`policy/retention.py`, unexpired) goes after every unpinned
node, whatever the policy; among pinned nodes, and among unpinned ones, the policy decides. Pinned nodes are not
locked: when nothing else is left, SGLang still evicts them (a pin must never stall the scheduler).

Contract of `Placement.priority(node) -> tuple`:
* lower is evicted first; tuples compare element by element, and every policy's last element is the node's
  `last_access` so that ties between otherwise equal nodes go to the least recently used;
* a pure function of the view (no state changes, same view -> same priority), so a heap built from it is valid;
* comparable across all nodes of one tier (device candidates are ranked against device candidates, host
  against host; `on_host` says which heap is asking).

A host node that SGLang has just loaded from SSD must not go first: an L3 prefetch lands in the host tier, unlocked,
and waits there until the scheduler admits its request; evicting it meanwhile throws the load away and the request
computes the span instead (SGLang counts it as `cache_admission_shortfall`). LRU never does that (such a node is the
newest); a score-only order does whenever the node's score is low (a document's first reuse has no reuses yet). So
the importance order ranks host candidates accessed within the last `recent` ticks of SGLang's access clock after
all other host candidates, least recently used first. The waiting queue is re-matched every scheduling round, which
refreshes `last_access` of a pending request's nodes, so such a node stays recent while it waits. Device candidates
are not protected: a node a request needs on device is locked by SGLang while it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NodeView:
    """What a placement policy may know about a radix node (a run of `tokens` tokens, whole pages)."""

    node_id: int
    tokens: int
    last_access: float  # SGLang's logical clock: larger is more recent
    created: float
    hits: int  # times requests reused the node (SGLang counts device hits only)
    on_host: bool  # already evicted from device: a host-tier candidate
    page_keys: tuple[str, ...] = ()  # storage keys of the node's pages (stable across splits and restarts)
    important_tokens: float = 0.0  # learned: sum over the node's tokens of their "important" average (0..tokens)
    reuses: int = 0  # learned: times requests reused the node's pages (every tier, unlike SGLang's hit_count)
    clock: float = math.inf  # SGLang's access clock when the candidates are ranked (inf: unknown, nothing is recent)
    pinned: bool = False  # holds a page of an unexpired retention pin


class Placement(Protocol):
    name: str

    def priority(self, node: NodeView) -> tuple:
        """Eviction rank of `node` among the candidates of its tier: lowest first (see the module contract)."""
        ...


class LRUPlacement:
    """Least recently used first: SGLang's default (`--radix-eviction-policy lru`)."""

    name = "lru"

    def priority(self, node: NodeView) -> tuple:
        return (node.last_access,)


# SGLang's access clock advances once per match or insert: about 8 ticks per request in the benchmark's workload
# (2 clients), so 32 covers the last few requests
RECENT_TICKS = 32.0


class ImportancePlacement:
    """IMPRESS: keep what matters where it is fast. Score = important tokens x access frequency, per token of the
    node (SGLang evicts whole leaf nodes of any length; unnormalized, a long node would always outrank a short one),
    with frequency = 1 + reuses so that a node never reused still ranks by its importance. Lowest score first; among
    equal scores the least recently used. Host candidates accessed within the last `recent` ticks go after all other
    host candidates, least recently used first (see the module docstring)."""

    name = "importance"

    def __init__(self, recent: float = RECENT_TICKS) -> None:
        if recent < 0:
            raise ValueError(f"recent must be >= 0 ticks, got {recent}")
        self.recent = recent

    def priority(self, node: NodeView) -> tuple:
        if node.on_host and node.clock - node.last_access < self.recent:
            return (1, 0.0, node.last_access)
        score = node.important_tokens * (1 + node.reuses) / max(1, node.tokens)
        return (0, score, node.last_access)


PLACEMENTS: dict[str, type] = {"lru": LRUPlacement, "importance": ImportancePlacement}


def rank(placement: Placement, node: NodeView) -> tuple:
    """The eviction rank of `node` in its tier, lowest first: pinned nodes after every unpinned one, then the
    policy's priority."""
    return (node.pinned, *placement.priority(node))


def make_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; expected one of {sorted(PLACEMENTS)}") from None
