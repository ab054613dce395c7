"""`TieredSSDStorage`: SGLang's L3 (`HiCacheStorage`) backed by our store's SSD tier, loaded through SGLang's
`dynamic` storage backend with `interface_v1` (zero copy: pages move straight between files and the host KV pool).

SGLang constructs it as `TieredSSDStorage(storage_config, kwargs)` in each scheduler process and calls it from its
prefetch and backup threads, never from the scheduler loop. The process's store is opened in
`register_mem_pool_host`, the first moment the page geometry (dtype, layout, heads) is known
(`runtime.open_store`: everything the process keeps is built there).

Supported host layouts: `layer_first` (2 x layers segments per page, gathered with one preadv/pwritev), `page_first`
and `page_first_direct` (2 segments per page). MHA pools only (not MLA/DSA/hybrid pools): anything else stops the
server at startup with a clear error.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from sglang_tiered.integration import runtime
from sglang_tiered.integration.runtime import Store
from sglang_tiered.storage.ssd_tier import SSDTier

logger = logging.getLogger("sglang_tiered")


class TieredSSDStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.rt = runtime.process()
        if self.rt.settings is None:
            raise RuntimeError("TieredSSDStorage needs the server to be started with --kv-backend tiered")
        self.storage_config = storage_config
        self.store: Optional[Store] = None
        self.page_size = 0

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.store = runtime.open_store(self.rt, mem_pool_host, self.storage_config)
        self.page_size = self.store.page_size

    def _tier(self) -> SSDTier:
        if self.store is None:
            raise RuntimeError("TieredSSDStorage used before register_mem_pool_host")
        return self.store.tier

    def _page_segments(self, keys: list[str], host_indices: torch.Tensor) -> list[tuple[str, list[memoryview]]]:
        """Zero-copy views of each page's bytes in the host pool, in SGLang's per-page pointer order."""
        n = len(keys)
        if host_indices.numel() != n * self.page_size:
            raise ValueError(f"{host_indices.numel()} host slots for {n} pages of {self.page_size} tokens")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // n
        views = [memoryview((ctypes.c_char * size).from_address(ptr)).cast("B") for ptr, size in zip(ptrs, sizes)]
        return [(keys[i], views[i * per_page : (i + 1) * per_page]) for i in range(n)]

    # ------------------------------------------------------------------ zero-copy interface (used)
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        pages = self._page_segments(keys, host_indices)
        t0 = time.perf_counter()
        found = self._tier().read_pages(pages)
        if self.rt.on_read:  # SGLang's own reads tell compute-or-load the disk's speed
            read, seconds = sum(v.nbytes for (_, segs), ok in zip(pages, found) if ok for v in segs), \
                time.perf_counter() - t0
            for observer in self.rt.on_read:
                observer(read, seconds)
        missing = [i for i, ok in enumerate(found) if not ok]
        remote = self.store.remote
        if remote is not None and missing:  # local misses from the shared store, in one round trip
            for i, ok in zip(missing, remote.fetch([pages[i] for i in missing])):
                found[i] = ok
        return found

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        stored = self._tier().write_pages(self._page_segments(keys, host_indices))
        if self.store.remote is not None:
            self.store.remote.publish([k for k, ok in zip(keys, stored) if ok])
        return stored

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        local = self._tier().leading_hits(keys)
        if self.store.remote is None or local == len(keys):
            return local
        return local + self.store.remote.leading_hits(keys[local:])

    def exists(self, key: str) -> bool:
        return self._tier().contains(key)

    def clear(self) -> None:
        self._tier().clear()

    def get_stats(self):
        return None  # our counters go out through StatsReporter (see metrics.py)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------------ legacy copy interface (not used)
    # SGLang calls these only without `interface_v1`, which our flag translation always sets. They would need a
    # second byte order for the same pages, so they refuse rather than write pages the v1 path cannot read.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        raise NotImplementedError("TieredSSDStorage serves pages through batch_get_v1 (interface_v1=1)")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        raise NotImplementedError("TieredSSDStorage serves pages through batch_get_v1 (interface_v1=1)")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("TieredSSDStorage stores pages through batch_set_v1 (interface_v1=1)")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None):
        raise NotImplementedError("TieredSSDStorage stores pages through batch_set_v1 (interface_v1=1)")
