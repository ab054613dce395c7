"""The `tiered` radix-cache backend: SGLang's `UnifiedRadixCache` with hierarchical cache attached, and the seam
where our placement policies (`policy/placement.py`) decide which node leaves device and host memory first.

SGLang ranks eviction candidates with `tree_core.eviction_strategy.get_priority(node)`, one heap per tier (device
leaves; host leaves), lowest first. `PlacementStrategy` is that strategy for any `Placement`: it builds a
`NodeView` of the node and asks the policy. Only SGLang's Python tree core calls it: the default Rust core receives
the *name* of `--radix-eviction-policy` and never runs Python strategies, so `TieredRadixCache.use_placement`
refuses a Rust core, and a placement other than SGLang's own needs the cache built with `tree_core_backend =
"python"`: `--tiered-placement importance` builds it so; `lru` (the default) keeps SGLang's LRU on the Rust core.
A node's view carries what the importance table knows of its pages (important tokens, reuses per page) and SGLang's
access clock (the counter `last_access_time` is drawn from) at the time of ranking.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_cache.components import base as tree_clock
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_tiered.integration import importance, settings
from sglang_tiered.policy.placement import NodeView, Placement, make_placement

logger = logging.getLogger("sglang_tiered")

BACKEND_NAME = "tiered"


def node_view(node) -> NodeView:
    """Our view of an SGLang `UnifiedTreeNode`, with what the importance table knows of its pages."""
    keys = tuple(node.hash_value or ())
    table = importance.table()
    return NodeView(node_id=int(node.id), tokens=len(node.key), last_access=float(node.last_access_time),
                    created=float(node.creation_time), hits=int(node.hit_count), on_host=bool(node.evicted),
                    page_keys=keys, important_tokens=table.important_tokens(keys) if table and keys else 0.0,
                    reuses=table.reuses(keys) // max(1, len(keys)) if table and keys else 0,
                    clock=float(tree_clock._LAST_ACCESS_TIME_COUNTER_FLOAT))


class PlacementStrategy(EvictionStrategy):
    """SGLang's eviction strategy interface over a `Placement`."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def get_priority(self, node) -> tuple:
        return self.placement.priority(node_view(node))


class TieredRadixCache(UnifiedRadixCache):
    """A `UnifiedRadixCache` whose eviction order a `Placement` can decide."""

    def use_placement(self, placement: Placement) -> None:
        """Rank eviction candidates of both tiers by `placement` from now on. Raises RuntimeError on SGLang's Rust
        tree core, which would silently ignore it."""
        backend = getattr(self, "_tree_core_backend", None)
        if backend != "python":
            raise RuntimeError(f"placement {placement.name!r} needs SGLang's Python tree core; this cache runs "
                               f"{backend!r}, which takes only the name of a built-in eviction policy")
        self.tree_core.eviction_strategy = PlacementStrategy(placement)


def build_tiered_radix_cache(ctx: TreeCacheBuildContext):
    if ctx.disable_radix_cache:
        raise ValueError("--kv-backend tiered needs the radix cache; remove --disable-radix-cache")
    if not ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend tiered needs the hierarchical cache: start with --kv-backend tiered")
    current = settings.current()
    placement = current.config.placement if current is not None else "lru"
    if placement == "lru":  # SGLang's own LRU, on its (faster) Rust tree core
        return create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
    ctx.params.tree_core_backend = "python"  # the Rust core would ignore a Python eviction strategy
    cache = create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
    cache.use_placement(make_placement(placement))
    logger.info("tiered placement: %s on SGLang's %s tree core", placement, cache._tree_core_backend)
    return cache
