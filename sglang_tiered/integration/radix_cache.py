"""The `tiered` radix-cache backend: SGLang's `UnifiedRadixCache` with hierarchical cache attached, and the seam
where our placement policies (`policy/placement.py`) and retention pins decide which node leaves device and host
memory first.

SGLang ranks eviction candidates with `tree_core.eviction_strategy.get_priority(node)`, one heap per tier (device
leaves; host leaves), lowest first. `PlacementStrategy` is that strategy for any `Placement`: it builds a
`NodeView` of the node and ranks it with `placement.rank` (pinned nodes after every unpinned one, then the policy).
Only SGLang's Python tree core calls it: the default Rust core receives the *name* of `--radix-eviction-policy` and
never runs Python strategies, so `TieredRadixCache.use_placement` refuses a Rust core, and the cache is built on the
Python tree core (`tree_core_backend = "python"`) whenever a Python strategy must run: `--tiered-placement
importance`, or retention on (`--tiered-max-retain` > 0, the default). `lru` with retention off keeps SGLang's LRU
on the Rust core. A node's view carries what the importance table knows of its pages (important tokens, reuses per
page), whether a retention pin holds one of them, and SGLang's access clock (the counter `last_access_time` is drawn
from) at the time of ranking -- all read from this process's store (`runtime.Store`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_cache.components import base as tree_clock
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_tiered.integration import runtime
from sglang_tiered.policy.placement import NodeView, Placement, make_placement, rank

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")

BACKEND_NAME = "tiered"


def node_view(node, rt: Optional[Runtime] = None) -> NodeView:
    """Our view of an SGLang `UnifiedTreeNode`, with what the store of `rt` (this process's by default) knows of
    its pages."""
    keys = tuple(node.hash_value or ())
    store = (rt or runtime.process()).store
    table = store.importance if store is not None else None
    pinned = store is not None and len(store.retention) > 0 and any(map(store.retention.pinned, keys))
    return NodeView(node_id=int(node.id), tokens=len(node.key), last_access=float(node.last_access_time),
                    created=float(node.creation_time), hits=int(node.hit_count), on_host=bool(node.evicted),
                    page_keys=keys, important_tokens=table.important_tokens(keys) if table and keys else 0.0,
                    reuses=table.reuses(keys) // max(1, len(keys)) if table and keys else 0,
                    clock=float(tree_clock._LAST_ACCESS_TIME_COUNTER_FLOAT), pinned=pinned)


class PlacementStrategy(EvictionStrategy):
    """SGLang's eviction strategy interface over a `Placement` and this process's retention pins."""

    def __init__(self, placement: Placement, rt: Optional[Runtime] = None) -> None:
        self.placement, self.rt = placement, rt or runtime.process()

    def get_priority(self, node) -> tuple:
        return rank(self.placement, node_view(node, self.rt))


class TieredRadixCache(UnifiedRadixCache):
    """A `UnifiedRadixCache` whose eviction order a `Placement` (and retention) can decide."""

    def use_placement(self, placement: Placement, rt: Optional[Runtime] = None) -> None:
        """Rank eviction candidates of both tiers by `placement.rank` from now on. Raises RuntimeError on SGLang's
        Rust tree core, which would silently ignore it."""
        backend = getattr(self, "_tree_core_backend", None)
        if backend != "python":
            raise RuntimeError(f"placement {placement.name!r} needs SGLang's Python tree core; this cache runs "
                               f"{backend!r}, which takes only the name of a built-in eviction policy")
        self.tree_core.eviction_strategy = PlacementStrategy(placement, rt)


def build_tiered_radix_cache(ctx: TreeCacheBuildContext):
    if ctx.disable_radix_cache:
        raise ValueError("--kv-backend tiered needs the radix cache; remove --disable-radix-cache")
    if not ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend tiered needs the hierarchical cache: start with --kv-backend tiered")
    rt = runtime.process()
    current = rt.settings
    placement = current.config.placement if current is not None else "lru"
    retention = current is not None and current.config.max_retain > 0
    if placement == "lru" and not retention:  # SGLang's own LRU, on its (faster) Rust tree core
        return create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
    ctx.params.tree_core_backend = "python"  # the Rust core would ignore a Python eviction strategy
    cache = create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
    cache.use_placement(make_placement(placement), rt)
    logger.info("tiered placement: %s on SGLang's %s tree core%s", placement, cache._tree_core_backend,
                " (pinned nodes go last: retention)" if retention else "")
    return cache
