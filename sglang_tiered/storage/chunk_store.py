"""Position-0 KV of text chunks (for blending), found by content hash wherever the chunk appears again.

Contracts
* A chunk's KV is [layers, tokens, 2 (k, v), kv_heads, head_dim], computed as if the chunk started at position 0
  (keys post-RoPE at positions 0 .. tokens-1). Its key (`chunk_key`) hashes the chunk's token ids *and the tenant's
  seed* (SGLang's `storage_namespace_seed(extra_key, cache_salt)`, None without one), so a chunk computed for one
  tenant or LoRA adapter is never found under another; the namespace (model, dtype, shapes, salt) separates the
  rest, as for KV pages.
* Memory tier: bytes-bounded LRU. `put` never exceeds `memory_bytes` (a chunk larger than it is not kept in memory).
* SSD (optional): the server's one SSD tier (`SSDTier`), write-through on a background thread, one file per chunk
  (entry `c.<key>`, kind "chunk": counted against the tier's one capacity, evicted in its one order) with one
  segment per layer, so a loader reads layer by layer and every layer is checksummed on read. A corrupt or vanished
  layer is a `ChunkMiss` (the tier counts and removes the file).
* A chunk read from the SSD (its last layer read) is copied into memory on the background thread if it fits: the
  next blend that reuses it reads memory. Nothing is lost when memory evicts it (the SSD copy stays).
* `layer()` returns a tensor the caller may keep; memory hits are views of the stored tensor (do not write to them).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from sglang_tiered.storage.page_file import CorruptPage
from sglang_tiered.storage.ssd_tier import CHUNK_PREFIX, SSDTier


class ChunkMiss(KeyError):
    """The chunk (or one of its layers) is not available."""


def chunk_key(token_ids: Sequence[int], seed: Optional[str] = None) -> str:
    """32 hex digits over the tenant seed and the token ids (int64 little endian)."""
    digest = hashlib.sha256(b"\x01" + seed.encode() + b"\x00" if seed is not None else b"\x00")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.hexdigest()[:32]


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class ChunkStore:
    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, memory_bytes: int,
                 ssd: Optional[SSDTier] = None) -> None:
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.memory_bytes = int(memory_bytes)
        self.ssd = ssd
        self._mem: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-write") if ssd is not None else None
        self.hits = {"memory": 0, "ssd": 0}
        self.misses = 0

    # ----------------------------------------------------------------- queries
    def in_memory(self, key: str) -> bool:
        with self._lock:
            return key in self._mem

    def contains(self, key: str) -> bool:
        """True if the chunk is in memory or on SSD (index lookups only, no I/O)."""
        if self.in_memory(key):
            return True
        return self.ssd is not None and self.ssd.contains(CHUNK_PREFIX + key)

    @property
    def used_memory_bytes(self) -> int:
        with self._lock:
            return self._used

    # ----------------------------------------------------------------- data
    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store a chunk's KV [layers, tokens, 2, kv_heads, head_dim], copied into host memory (from a device
        tensor too: the memory tier is host DRAM, as `--tiered-blend-memory` counts it)."""
        expect = (self.layers, 2, self.kv_heads, self.head_dim)
        if kv.dim() != 5 or (kv.shape[0], *kv.shape[2:]) != expect:
            raise ValueError(f"chunk KV must be [layers, tokens, 2, kv_heads, head_dim] with {expect}, got "
                             f"{tuple(kv.shape)}")
        kv = kv.detach().to("cpu", self.dtype, copy=True).contiguous()
        self._keep(key, kv)
        if self._writer is not None:
            self._writer.submit(self._write_ssd, key, kv)

    def _keep(self, key: str, kv: torch.Tensor) -> None:
        """`kv` into the memory LRU as its newest entry, evicting the oldest, unless it is there or cannot fit."""
        nbytes = kv.numel() * kv.element_size()
        with self._lock:
            if key not in self._mem and nbytes <= self.memory_bytes:
                while self._used + nbytes > self.memory_bytes:
                    _, old = self._mem.popitem(last=False)
                    self._used -= old.numel() * old.element_size()
                self._mem[key] = kv
                self._used += nbytes

    def _write_ssd(self, key: str, kv: torch.Tensor) -> None:
        self.ssd.write_pages([(CHUNK_PREFIX + key, [_view(kv[i]) for i in range(self.layers)])], kind="chunk")

    def layer(self, key: str, layer: int, tokens: int) -> torch.Tensor:
        """The chunk's KV of one layer, [tokens, 2, kv_heads, head_dim]. Raises ChunkMiss."""
        with self._lock:
            kv = self._mem.get(key)
            if kv is not None:
                self._mem.move_to_end(key)
        if kv is not None:
            if kv.shape[1] != tokens:
                raise ChunkMiss(f"chunk {key} has {kv.shape[1]} tokens, not {tokens}")
            self._count("memory", layer)
            return kv[layer]
        if self.ssd is not None:
            out = self._read_ssd(key, layer, tokens)
            if out is not None:
                self._count("ssd", layer)
                if layer == self.layers - 1 and self._writer is not None:
                    self._writer.submit(self._promote, key, tokens)
                return out
        with self._lock:
            self.misses += 1
        raise ChunkMiss(f"chunk {key} layer {layer}")

    def _read_ssd(self, key: str, layer: int, tokens: int) -> Optional[torch.Tensor]:
        entry = CHUNK_PREFIX + key
        out = torch.empty(tokens, 2, self.kv_heads, self.head_dim, dtype=self.dtype)
        reader = self.ssd.open_page(entry, [out.numel() * out.element_size()] * self.layers)
        if reader is None:  # missing, or another length (a foreign size is a miss and removed)
            return None
        try:
            _view(out)[:] = reader.read(layer, 1)[0]
        except CorruptPage as exc:
            self.ssd.drop_corrupt(entry, exc)
            return None
        finally:
            reader.close()
        return out

    def _promote(self, key: str, tokens: int) -> None:
        """The SSD copy of a chunk into memory (whole, every layer verified), if it fits and is not there."""
        kv = torch.empty(self.layers, tokens, 2, self.kv_heads, self.head_dim, dtype=self.dtype)
        if kv.numel() * kv.element_size() > self.memory_bytes or self.in_memory(key):
            return
        if self.ssd.read_pages([(CHUNK_PREFIX + key, [_view(kv[i]) for i in range(self.layers)])])[0]:
            self._keep(key, kv)

    def _count(self, tier: str, layer: int) -> None:
        if layer == self.layers - 1:  # one hit per chunk load (every mode loads the last layer)
            with self._lock:
                self.hits[tier] += 1

    def flush(self) -> None:
        """Wait for pending SSD writes."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
