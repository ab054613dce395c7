"""The `tiered` radix-cache backend: SGLang's `UnifiedRadixCache` with hierarchical cache attached.

Placement and load-back policy (importance-aware placement) will live in `TieredRadixCache`; today it keeps
SGLang's own policy (LRU on device and host, write-through to host and on to the SSD tier).
"""

from __future__ import annotations

from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

BACKEND_NAME = "tiered"


class TieredRadixCache(UnifiedRadixCache):
    """A `UnifiedRadixCache`; the subclass is the seam for placement decisions."""


def build_tiered_radix_cache(ctx: TreeCacheBuildContext):
    if ctx.disable_radix_cache:
        raise ValueError("--kv-backend tiered needs the radix cache; remove --disable-radix-cache")
    if not ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend tiered needs the hierarchical cache: start with --kv-backend tiered")
    return create_unified_radix_cache(ctx, cache_class=TieredRadixCache)
