"""Placement: which radix-tree node leaves device memory (or host memory) first. Pure: no SGLang, no torch.

SGLang evicts whole *leaf nodes* of its radix tree, one tier at a time: device leaves while device slots are
needed, then host leaves (nodes already evicted from device) while host slots are needed. It keeps one heap of
candidates per tier and pops the lowest priority first. `integration/radix_cache.py` adapts `rank` onto SGLang's
`EvictionStrategy.get_priority`, building a `NodeView` of each candidate.

The order is SGLang's own LRU with retention on top: a node holding pages that a request asked to retain
(`policy/retention.py`, unexpired) goes after every unpinned node of its tier; among pinned nodes, and among
unpinned ones, the least recently used goes first. Pinned nodes are not locked: when nothing else is left, SGLang
still evicts them (a pin must never stall the scheduler). Ranking by learned importance instead (important tokens x
reuses per token) tied LRU on a Zipf workload whose KV exceeds device and host (benchmarks/importance.py: 0.97x
median TTFT alone and under gated loading, Intel AMX, bf16), so recency is the order.

`host_pool_shortfall` says when the host pool is too small for the SSD tier to receive every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class NodeView:
    """What the order knows about a radix node."""

    node_id: int
    last_access: float  # SGLang's logical clock: larger is more recent
    pinned: bool = False  # holds a page of an unexpired retention pin


def rank(node: NodeView) -> tuple[bool, float]:
    """The eviction rank of `node` among the candidates of its tier, lowest first: unpinned before pinned, then least
    recently used first. A pure function of the view, so a heap built from it stays valid."""
    return (node.pinned, node.last_access)


def host_pool_shortfall(host_tokens: int, device_tokens: int) -> Optional[str]:
    """What an operator must know when the host pool is smaller than the device pool, else None. SGLang writes pages
    to storage from its host pool, so a prompt whose KV does not fit there at once never reaches the SSD tier (a
    20-page prompt behind a pool that SGLang, sizing it to the memory free at start, shrank to 1,152 tokens)."""
    if host_tokens >= device_tokens:
        return None
    return (f"the host pool holds {host_tokens} tokens, fewer than the device pool's {device_tokens}: a prompt "
            f"longer than that never reaches the SSD tier (SGLang writes to storage from the host pool). Give "
            f"--tiered-host-size at least the device pool's size (e.g. 2x); left unset, SGLang sizes the host pool "
            f"to the memory free at start")
