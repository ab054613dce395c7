"""`TieredSSDStorage`: SGLang's L3 (`HiCacheStorage`) backed by our SSD tier, loaded through SGLang's `dynamic`
storage backend with `interface_v1` (zero copy: pages move straight between files and the host KV pool).

SGLang constructs it as `TieredSSDStorage(storage_config, kwargs)` in each scheduler process and calls it from its
prefetch and backup threads, never from the scheduler loop. The tier is opened in `register_mem_pool_host`, the
first moment the page geometry (dtype, layout, heads) is known.

Supported host layouts: `layer_first` (2 x layers segments per page, gathered with one preadv/pwritev), `page_first`
and `page_first_direct` (2 segments per page). MHA pools only (not MLA/DSA/hybrid pools): anything else stops the
server at startup with a clear error.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from sglang_tiered.config import parse_size
from sglang_tiered.integration import importance, kvpr
from sglang_tiered.integration.metrics import StatsReporter, prometheus_enabled
from sglang_tiered.integration.settings import current as current_settings
from sglang_tiered.kernels.importance import probed_kv_heads
from sglang_tiered.storage.foreground import FOREGROUND
from sglang_tiered.storage.groups import ITEMSIZE
from sglang_tiered.storage.importance_table import ImportanceTable
from sglang_tiered.storage.mooncake_store import MooncakeStore
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.remote_tier import RemoteTier
from sglang_tiered.storage.repacker import Repacker
from sglang_tiered.storage.ssd_tier import SSDTier
from sglang_tiered.storage.stash import PayloadStash

logger = logging.getLogger("sglang_tiered")

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class TieredSSDStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        current = current_settings()
        if current is None:
            raise RuntimeError("TieredSSDStorage needs the server to be started with --kv-backend tiered")
        self.config = current.config
        self.model_id = current.model
        self.storage_config = storage_config
        self.tier: Optional[SSDTier] = None
        self.importance: Optional[ImportanceTable] = None
        self.repacker: Optional[Repacker] = None
        self.reporter: Optional[StatsReporter] = None
        self.remote: Optional[RemoteTier] = None
        self.page_size = 0

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        if not hasattr(mem_pool_host, "head_num") or not hasattr(mem_pool_host, "get_page_buffer_meta"):
            raise NotImplementedError(
                f"--kv-backend tiered: host pool {type(mem_pool_host).__name__} is not an MHA pool; "
                "only MHA (Llama-style) KV caches are supported"
            )
        if layout not in SUPPORTED_LAYOUTS:
            raise NotImplementedError(
                f"--kv-backend tiered: --hicache-mem-layout {layout} is not supported; use one of {SUPPORTED_LAYOUTS}"
            )
        sc = self.storage_config
        self.page_size = int(mem_pool_host.page_size)
        namespace = Namespace(
            model=self.model_id,
            dtype=str(mem_pool_host.dtype),
            page_size=self.page_size,
            layout=layout,
            layer_num=int(mem_pool_host.layer_num),
            kv_heads=int(mem_pool_host.head_num),
            head_dim=int(mem_pool_host.head_dim),
            tp_rank=sc.tp_rank,
            tp_size=sc.tp_size,
            pp_rank=sc.pp_rank,
            pp_size=sc.pp_size,
            salt=self.config.namespace,
        )
        shards = max(1, sc.tp_size * sc.pp_size)
        capacity = self.config.ssd_capacity // shards
        page_bytes = namespace.page_bytes(mem_pool_host.dtype.itemsize)
        if capacity < page_bytes:
            raise ValueError(
                f"--tiered-ssd-capacity: {self.config.ssd_capacity} bytes over {shards} rank(s) is smaller than one "
                f"KV page ({page_bytes} bytes)"
            )
        self.tier = SSDTier(self.config.ssd_dir, namespace, capacity, io_threads=self.config.io_threads,
                            before_write=FOREGROUND.wait_idle)  # a no-op unless enabled (CPU-only servers)
        kvpr.attach_tier(self.tier, mem_pool_host.dtype.itemsize, layout)
        if self.config.importance_heads > 0:
            self.importance = ImportanceTable(self.page_size, directory=self.tier.dir)
            importance.attach_table(self.importance)
        if self.config.importance_load == "gated" and self.importance is not None:
            if layout != "layer_first" or namespace.dtype not in ITEMSIZE:
                raise NotImplementedError(f"--tiered-importance-load gated: needs the layer_first host layout and a "
                                          f"16/32-bit KV dtype, got {layout} / {namespace.dtype}")
            heads = current_settings().attention_heads or int(mem_pool_host.head_num)
            kv = int(mem_pool_host.head_num)
            probe = probed_kv_heads(heads, kv, min(self.config.importance_heads, heads))
            stash = PayloadStash(parse_size(self.config.importance_repack_memory))
            self.tier.attach_stash(stash)
            self.repacker = Repacker(self.tier, self.importance, probe, before_repack=FOREGROUND.wait_idle,
                                     by_importance=self.config.importance_order == "importance",
                                     probe_bits=self.config.importance_probe_bits, stash=stash)
            importance.attach_repacker(self.repacker, self.tier)
        remote = self.config.remote_settings()
        if remote is not None:
            address, segment = remote
            largest = page_bytes + 64 * 1024  # a page file: payload + header (a few KB)
            self.remote = RemoteTier(
                lambda: MooncakeStore(address, segment_bytes=segment, object_bytes=largest,
                                      local_host=self.config.remote_host),
                self.tier, importance=self.importance, before_put=FOREGROUND.wait_idle)
            logger.info("tiered remote: mooncake master %s, metadata %s, lending %d bytes", address.master,
                        address.metadata, segment)
        self.reporter = StatsReporter(
            self.tier.stats,
            json_path=Path(self.config.ssd_dir) / "stats" / f"{namespace.id}.json",
            page_size=self.page_size,
            capacity_bytes=capacity,
            tp_rank=sc.tp_rank,
            describe=namespace.describe,
            prometheus=prometheus_enabled(sc.enable_storage_metrics),
            log_interval=self.config.stats_interval,
            extras=lambda: {"importance": self.importance.coverage()} if self.importance is not None else {},
        )
        logger.info(
            "tiered ssd: rank %d namespace %s (%s, page %d tokens = %d bytes, layout %s), capacity %d bytes",
            sc.tp_rank, namespace.id, self.model_id, self.page_size, page_bytes, layout, capacity,
        )

    def _tier(self) -> SSDTier:
        if self.tier is None:
            raise RuntimeError("TieredSSDStorage used before register_mem_pool_host")
        return self.tier

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
        found = self._tier().read_pages(pages)
        missing = [i for i, ok in enumerate(found) if not ok]
        if self.remote is not None and missing:  # local misses from the shared store, in one round trip
            for i, ok in zip(missing, self.remote.fetch([pages[i] for i in missing])):
                found[i] = ok
        return found

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        stored = self._tier().write_pages(self._page_segments(keys, host_indices))
        if self.remote is not None:
            self.remote.publish([k for k, ok in zip(keys, stored) if ok])
        return stored

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        local = self._tier().leading_hits(keys)
        if self.remote is None or local == len(keys):
            return local
        return local + self.remote.leading_hits(keys[local:])

    def exists(self, key: str) -> bool:
        return self._tier().contains(key)

    def clear(self) -> None:
        self._tier().clear()

    def get_stats(self):
        return None  # our counters go out through StatsReporter (see metrics.py)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.reporter is not None:
            self.reporter.stop()
        if self.repacker is not None:
            self.repacker.close()
        if self.tier is not None:
            self.tier.close()
        if self.importance is not None:
            self.importance.close()

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
