"""Placement: which radix-tree node leaves device memory (or host memory) first. Pure: no SGLang, no torch.

SGLang evicts whole *leaf nodes* of its radix tree, one tier at a time: device leaves while device slots are
needed, then host leaves (nodes already evicted from device) while host slots are needed. It keeps one heap of
candidates per tier and pops the lowest priority first; a policy only ranks the candidates it is shown, it cannot
pin a node or evict an inner one. `integration/radix_cache.py` adapts a `Placement` onto SGLang's
`EvictionStrategy.get_priority`, building a `NodeView` of each candidate.

Contract of `Placement.priority(node) -> tuple`:
* lower is evicted first; tuples compare element by element, and every policy's last element is the node's
  `last_access` so that ties between otherwise equal nodes go to the least recently used;
* a pure function of the view (no state changes, same view -> same priority), so a heap built from it is valid;
* comparable across all nodes of one tier (device candidates are ranked against device candidates, host
  against host; `on_host` says which heap is asking).
"""

from __future__ import annotations

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


class ImportancePlacement:
    """IMPRESS: keep what matters where it is fast. Score = important tokens x access frequency, per token of the
    node (SGLang evicts whole leaf nodes of any length; unnormalized, a long node would always outrank a short one),
    with frequency = 1 + reuses so that a node never reused still ranks by its importance. Lowest score first; among
    equal scores the least recently used."""

    name = "importance"

    def priority(self, node: NodeView) -> tuple:
        score = node.important_tokens * (1 + node.reuses) / max(1, node.tokens)
        return (score, node.last_access)


PLACEMENTS: dict[str, type] = {"lru": LRUPlacement, "importance": ImportancePlacement}


def make_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; expected one of {sorted(PLACEMENTS)}") from None
