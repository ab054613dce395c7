"""Everything one SGLang process of a `--kv-backend tiered` server keeps, in one object built in one place.

`process()` is this process's `Runtime` (the module's only mutable state). `plugin.register` builds it and hands
it to every hook it registers (hooks are bound methods of objects that hold it); SGLang's storage class
(`storage_backend.py`) opens the process's `Store` through it (`open_store`, the moment the KV geometry is known);
the radix cache (`radix_cache.py`) ranks eviction candidates with what it holds. Nothing else in `sglang_tiered/`
keeps module-level state.

A `Store` is everything kept on behalf of requests, behind one capacity and one key scheme: the SSD tier (pages,
activation pages, chunk KV, repacked groups with their probes, meta files: `storage/ssd_tier.py`), the chunk store's
memory LRU, the stash, the repacker, the remote tier, retention pins and the statistics reporter.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from sglang_tiered.config import parse_size
from sglang_tiered.integration import settings as settings_mod
from sglang_tiered.integration.metrics import Events, StatsReporter, prometheus_enabled
from sglang_tiered.kernels.importance import probed_kv_heads
from sglang_tiered.policy.placement import host_pool_shortfall
from sglang_tiered.policy.retention import Retention
from sglang_tiered.storage.chunk_store import ChunkStore
from sglang_tiered.storage.foreground import ForegroundGate
from sglang_tiered.storage.groups import ITEMSIZE
from sglang_tiered.storage.mooncake_store import MooncakeStore
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.remote_tier import RemoteTier
from sglang_tiered.storage.repack_worker import RepackWorker
from sglang_tiered.storage.repacker import Repacker
from sglang_tiered.storage.ssd_tier import SSDTier
from sglang_tiered.storage.stash import PayloadStash

if TYPE_CHECKING:
    from sglang_tiered.integration.door import Door
    from sglang_tiered.integration.model_forward import ForwardHook

logger = logging.getLogger("sglang_tiered")

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass
class Store:
    """What one scheduler process keeps for requests (see the module docstring). Built by `open_store`."""

    namespace: Namespace
    tier: SSDTier
    chunks: ChunkStore
    retention: Retention
    stash: Optional[PayloadStash]
    repacker: Optional[Repacker]
    remote: Optional[RemoteTier]
    reporter: Optional[StatsReporter]

    @property
    def page_size(self) -> int:
        return self.namespace.page_size

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.reporter is not None:
            self.reporter.stop()
        if self.repacker is not None:
            self.repacker.close()
        self.chunks.close()
        self.tier.close()


class Runtime:
    """One process's state. `plugin.register` builds the forward hook (its handler list) and the door (its loader
    list), to which each mechanism on in this process adds itself; `open_store` the store, in scheduler processes.
    Mechanisms that need the store or SGLang's own reads subscribe instead of holding a slot here."""

    def __init__(self) -> None:
        self.registered = False  # plugin.register ran in this process
        self._raw: Optional[str] = None
        self._settings: Optional[settings_mod.Settings] = None
        self.events = Events()
        self.foreground = ForegroundGate()  # enabled on CPU-only servers (ForwardHook.gate_background_writes)
        self.store: Optional[Store] = None
        self.forward: Optional[ForwardHook] = None  # the Llama forward hook and its handlers
        self.door: Optional[Door] = None  # the one admission decision for stored spans (its loaders), retention pins
        self.on_store: list[Callable[[Store, int, str], None]] = []  # called with (store, KV itemsize, host layout)
        #                                                              once the store is open
        self.on_read: list[Callable[[int, float], None]] = []  # called with (bytes, seconds) of SGLang's own L3 reads
        self.directory_claims: dict[str, int] = {}  # launcher: SSD directory -> the descriptor holding its claim

    @property
    def settings(self) -> Optional[settings_mod.Settings]:
        """This process's settings (None: not a `--kv-backend tiered` server, or a launcher before its flags are
        parsed); parsed again only when the launcher publishes new ones."""
        raw = os.environ.get(settings_mod.ENV)
        if raw != self._raw:
            self._raw, self._settings = raw, settings_mod.parse(raw)
        return self._settings


_process: Optional[Runtime] = None


def process() -> Runtime:
    """This process's runtime (created at the first call)."""
    global _process
    if _process is None:
        _process = Runtime()
    return _process


def open_store(rt: Runtime, mem_pool_host, storage_config) -> Store:
    """Open this scheduler's store over SGLang's host KV pool (its geometry names the namespace). Raises
    NotImplementedError for pools or layouts we cannot serve and ValueError for a capacity below one page."""
    current = rt.settings
    if current is None:
        raise RuntimeError("the tiered store needs the server to be started with --kv-backend tiered")
    cfg = current.config
    layout = getattr(mem_pool_host, "layout", None)
    if not hasattr(mem_pool_host, "head_num") or not hasattr(mem_pool_host, "get_page_buffer_meta"):
        raise NotImplementedError(f"--kv-backend tiered: host pool {type(mem_pool_host).__name__} is not an MHA "
                                  "pool; only MHA (Llama-style) KV caches are supported")
    if layout not in SUPPORTED_LAYOUTS:
        raise NotImplementedError(f"--kv-backend tiered: --hicache-mem-layout {layout} is not supported; use one of "
                                  f"{SUPPORTED_LAYOUTS}")
    sc = storage_config
    page_size = int(mem_pool_host.page_size)
    itemsize = mem_pool_host.dtype.itemsize
    namespace = Namespace(model=current.model, dtype=str(mem_pool_host.dtype), page_size=page_size, layout=layout,
                          layer_num=int(mem_pool_host.layer_num), kv_heads=int(mem_pool_host.head_num),
                          head_dim=int(mem_pool_host.head_dim), tp_rank=sc.tp_rank, tp_size=sc.tp_size,
                          pp_rank=sc.pp_rank, pp_size=sc.pp_size, salt=cfg.namespace)
    shards = max(1, sc.tp_size * sc.pp_size)
    capacity = cfg.ssd_capacity // shards
    page_bytes = namespace.page_bytes(itemsize)
    if capacity < page_bytes:
        raise ValueError(f"--tiered-ssd-capacity: {cfg.ssd_capacity} bytes over {shards} rank(s) is smaller than one "
                         f"KV page ({page_bytes} bytes)")
    # retention may pin at most this share of the smallest tier (device, host, SSD), counted in pages
    host_tokens = int(mem_pool_host.size)
    device_tokens = int(getattr(mem_pool_host, "device_capacity_tokens", 0) or 0)  # 0: not known
    tier_pages = min((device_tokens or host_tokens) // page_size, host_tokens // page_size, capacity // page_bytes)
    retention = Retention(cfg.max_retain, int(cfg.retain_share * tier_pages))
    shortfall = host_pool_shortfall(host_tokens, device_tokens)
    if shortfall is not None:
        logger.warning("tiered ssd: %s", shortfall)
    first_rank = sc.tp_rank == 0 and sc.pp_rank == 0
    tier = SSDTier(cfg.ssd_dir, namespace, capacity, io_threads=cfg.io_threads,
                   before_write=rt.foreground.wait_idle,  # a no-op unless enabled (CPU-only servers)
                   pinned=retention.pinned, scan_foreign=first_rank)
    chunks = ChunkStore(layers=namespace.layer_num, kv_heads=namespace.kv_heads, head_dim=namespace.head_dim,
                        dtype=mem_pool_host.dtype, memory_bytes=current.blend_memory_bytes, ssd=tier)
    stash, repacker = _gated_loading(rt, tier, layout) if cfg.importance_load == "gated" else (None, None)
    remote = _remote_tier(rt, tier, page_bytes)
    stats_file = f"stats/{namespace.id}.json"
    reporter = StatsReporter(
        tier.stats, json_path=Path(cfg.ssd_dir) / stats_file,
        write_json=lambda data: tier.meta.write(stats_file, data), page_size=page_size, capacity_bytes=capacity,
        tp_rank=sc.tp_rank, describe=namespace.describe, prometheus=prometheus_enabled(sc.enable_storage_metrics),
        log_interval=cfg.stats_interval,
        extras=lambda: _extras(tier, retention, rt))
    store = Store(namespace, tier, chunks, retention, stash, repacker, remote, reporter)
    rt.store = store
    for subscriber in rt.on_store:
        subscriber(store, itemsize, layout)
    logger.info("tiered ssd: rank %d namespace %s (%s, page %d tokens = %d bytes, layout %s), capacity %d bytes; "
                "retention: up to %.0f s, %d pages", sc.tp_rank, namespace.id, current.model, page_size, page_bytes,
                layout, capacity, retention.max_seconds, retention.max_pages)
    return store


def _gated_loading(rt: Runtime, tier: SSDTier, layout: str) -> tuple[PayloadStash, Repacker]:
    """The payload stash and repacker of `--tiered-importance-load gated`, the stash attached to `tier`. Raises
    NotImplementedError for a layout or KV dtype gated loading cannot read."""
    current, namespace = rt.settings, tier.namespace
    cfg = current.config
    if layout != "layer_first" or namespace.dtype not in ITEMSIZE:
        raise NotImplementedError(f"--tiered-importance-load gated: needs the layer_first host layout and a "
                                  f"16/32-bit KV dtype, got {layout} / {namespace.dtype}")
    heads = current.attention_heads or namespace.kv_heads
    probe = probed_kv_heads(heads, namespace.kv_heads, min(cfg.importance_heads, heads))
    stash = PayloadStash(parse_size(cfg.importance_repack_memory))
    tier.attach_stash(stash)
    repacker = Repacker(tier, probe, before_repack=rt.foreground.wait_idle, probe_bits=cfg.importance_probe_bits,
                        stash=stash, worker=RepackWorker())
    return stash, repacker


def _remote_tier(rt: Runtime, tier: SSDTier, page_bytes: int) -> Optional[RemoteTier]:
    """The shared tier over Mooncake Store that `--tiered-remote` names, or None without it (it connects on its
    own, and keeps trying: a master that is down leaves the local tiers serving)."""
    cfg = rt.settings.config
    remote_cfg = cfg.remote_settings()
    if remote_cfg is None:
        return None
    address, segment = remote_cfg
    largest = page_bytes + 64 * 1024  # a page file: payload + header (a few KB)
    remote = RemoteTier(lambda: MooncakeStore(address, segment_bytes=segment, object_bytes=largest,
                                              local_host=cfg.remote_host),
                        tier, before_put=rt.foreground.wait_idle)
    logger.info("tiered remote: mooncake master %s, metadata %s, lending %d bytes", address.master,
                address.metadata, segment)
    return remote


def _extras(tier: SSDTier, retention: Retention, rt: Runtime) -> dict:
    """Fields of the statistics file beyond the tier's counters (`sglang-tiered stats`)."""
    return {"bytes_by_kind": tier.bytes_by_kind(), "retention": _retention_stats(tier, retention, rt)}


def _retention_stats(tier: SSDTier, retention: Retention, rt: Runtime) -> dict:
    on = rt.door.residency if rt.door is not None else {}
    pins = len(retention)
    return {"pins": pins, "pages": len(retention.pages()), "ssd_pinned_bytes": tier.pinned_bytes() if pins else 0,
            "device_pinned_pages": on.get("device", 0), "host_pinned_pages": on.get("host", 0)}
