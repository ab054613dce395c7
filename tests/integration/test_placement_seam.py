"""`TieredRadixCache.use_retention` on SGLang's real radix cache (no server; SGLang's pools on CPU): without pins it
evicts exactly what SGLang's own LRU strategy evicts, pinned leaves go after every unpinned one, and the Rust tree
core (which would ignore a Python strategy) is refused."""

from __future__ import annotations

from array import array

import pytest
import torch

pytestmark = pytest.mark.sglang

LEAVES = 6
TOKENS = 10  # per leaf


def build(backend: str):
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_tiered.integration.radix_cache import TieredRadixCache

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
    pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=256, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    params = CacheInitParams(req_to_token_pool=ReqToTokenPool(size=4, max_context_len=256, device="cpu",
                                                              enable_memory_saver=False),
                             token_to_kv_pool_allocator=alloc, page_size=1, disable=False, eviction_policy="lru",
                             tree_components=(ComponentType.FULL,), tree_core_backend=backend)
    return TieredRadixCache(params=params), alloc


def script(cache, alloc) -> None:
    """Insert LEAVES disjoint prompts, then reuse some of them, in an order that is not insertion order."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    for leaf in range(LEAVES):
        tokens = array("q", [1000 * (leaf + 1) + j for j in range(TOKENS)])
        cache.insert(InsertParams(key=RadixKey(tokens), value=alloc.alloc(TOKENS)))
    for leaf in (3, 0, 5):
        cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1000 * (leaf + 1) + j for j in
                                                                       range(TOKENS)]))))


def evicted_leaves(cache, leaves: int) -> list[int]:
    """Evict `leaves` leaves' worth of tokens; the leaves gone from the tree, ascending."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=leaves * TOKENS))
    alive = {n.key.token_ids[0] // 1000 - 1 for n in cache.tree_core.evictable_device_leaves}
    return [leaf for leaf in range(LEAVES) if leaf not in alive]


def test_without_pins_it_evicts_what_sglang_lru_evicts():
    ours, alloc_a = build("python")
    ours.use_retention()
    theirs, alloc_b = build("python")
    script(ours, alloc_a)
    script(theirs, alloc_b)
    assert evicted_leaves(ours, 3) == evicted_leaves(theirs, 3) == [1, 2, 4]


def test_the_rust_tree_core_is_refused():
    cache, _ = build("rust")
    if getattr(cache, "_tree_core_backend", None) != "rust":
        pytest.skip("SGLang's Rust tree core is not available on this machine")
    with pytest.raises(RuntimeError, match="needs SGLang's Python tree core"):
        cache.use_retention()


def test_pinned_leaves_leave_after_every_unpinned_one():
    """Retention on SGLang's real cache: the leaves holding pinned pages are evicted only once no unpinned leaf is
    left; when the pins expire they rank like any other leaf again."""
    from types import SimpleNamespace

    from sglang_tiered.integration.radix_cache import node_view
    from sglang_tiered.integration.runtime import Runtime
    from sglang_tiered.policy.retention import Retention

    now = [0.0]
    retention = Retention(max_seconds=60, max_pages=100, clock=lambda: now[0])
    rt = Runtime()
    rt.store = SimpleNamespace(retention=retention)
    cache, alloc = build("python")
    cache.use_retention(rt)
    script(cache, alloc)
    keys = {}
    for n in cache.tree_core.evictable_device_leaves:  # page size 1: one key per token; pin each leaf's last key
        n.hash_value = [f"k{n.key.token_ids[0]}"]
        keys[n.key.token_ids[0] // 1000 - 1] = n.hash_value[0]
    retention.pin([keys[1]], 30)  # 1 and 2 are the least recently used: LRU takes 1, 2, 4 first
    retention.pin([keys[2]], 30)
    views = {leaf: node_view(n, rt) for n in cache.tree_core.evictable_device_leaves
             for leaf in [n.key.token_ids[0] // 1000 - 1]}
    assert {leaf for leaf, v in views.items() if v.pinned} == {1, 2}
    assert evicted_leaves(cache, 3) == [0, 3, 4]
    assert evicted_leaves(cache, 1) == [0, 3, 4, 5]  # every unpinned leaf went before either pinned one
    now[0] = 31.0  # expired: evictable like any other leaf
    assert evicted_leaves(cache, 1) == [0, 1, 3, 4, 5]
