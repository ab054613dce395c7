"""The `tiered` radix-cache backend: SGLang's `UnifiedRadixCache` with hierarchical cache attached, and the seam
where retention pins decide which node leaves device and host memory first (`policy/placement.py`).

SGLang ranks eviction candidates with `tree_core.eviction_strategy.get_priority(node)`, one heap per tier (device
leaves; host leaves), lowest first. `RetentionStrategy` is that strategy: it builds a `NodeView` of the node (its
`last_access_time`, and whether a retention pin holds one of its pages, read from this process's store) and ranks
it with `placement.rank` (pinned nodes after every unpinned one, then LRU). Only SGLang's Python tree core calls
it: the default Rust core receives the *name* of `--radix-eviction-policy` and never runs Python strategies, so
`TieredRadixCache.use_retention` refuses a Rust core, and the cache is built on the Python tree core
(`tree_core_backend = "python"`) whenever retention is on (`--tiered-max-retain` > 0, the default);
`--tiered-max-retain 0` keeps SGLang's LRU on the Rust core.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_tiered.integration import runtime
from sglang_tiered.policy.placement import NodeView, rank

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")

BACKEND_NAME = "tiered"


def node_view(node, rt: Optional[Runtime] = None) -> NodeView:
    """Our view of an SGLang `UnifiedTreeNode`, with the pins of the store of `rt` (this process's by default)."""
    store = (rt or runtime.process()).store
    pinned = store is not None and len(store.retention) > 0 and any(map(store.retention.pinned, node.hash_value or ()))
    return NodeView(node_id=int(node.id), last_access=float(node.last_access_time), pinned=pinned)


class RetentionStrategy(EvictionStrategy):
    """SGLang's eviction strategy interface over `placement.rank` and this process's retention pins."""

    def __init__(self, rt: Optional[Runtime] = None) -> None:
        self.rt = rt or runtime.process()

    def get_priority(self, node) -> tuple:
        return rank(node_view(node, self.rt))


class TieredRadixCache(UnifiedRadixCache):
    """A `UnifiedRadixCache` whose eviction order retention pins can decide."""

    def use_retention(self, rt: Optional[Runtime] = None) -> None:
        """Rank eviction candidates of both tiers by `placement.rank` from now on. Raises RuntimeError on SGLang's
        Rust tree core, which would silently ignore it."""
        backend = getattr(self, "_tree_core_backend", None)
        if backend != "python":
            raise RuntimeError(f"retention needs SGLang's Python tree core; this cache runs {backend!r}, which takes "
                               "only the name of a built-in eviction policy")
        self.tree_core.eviction_strategy = RetentionStrategy(rt)


def build_tiered_radix_cache(ctx: TreeCacheBuildContext):
    if ctx.disable_radix_cache:
        raise ValueError("--kv-backend tiered needs the radix cache; remove --disable-radix-cache")
    if not ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend tiered needs the hierarchical cache: start with --kv-backend tiered")
    rt = runtime.process()
    current = rt.settings
    if current is None or current.config.max_retain <= 0:  # SGLang's own LRU, on its (faster) Rust tree core
        return create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
    ctx.params.tree_core_backend = "python"  # the Rust core would ignore a Python eviction strategy
    cache = create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
    cache.use_retention(rt)
    logger.info("tiered placement: LRU with retention pins last, on SGLang's %s tree core", cache._tree_core_backend)
    return cache
