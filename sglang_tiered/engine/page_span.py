"""A stored span of plain pages on the SSD tier, one whole page per read: the two-sided loader's source
(`engine.meet.PageSource`).

Page i of `keys` (layer_first layout) comes as its activations (every layer's attention input X, storage/
activations.py) when `activations` is on and they are stored -- the loader recomputes K and V from them (KVPR) -- and
as its KV otherwise, or when the activation page turns out missing or corrupt (counted). A KV page that is missing or
corrupt ends the load (`SpanMiss`): the caller computes the span instead. Every segment is checked against its own
checksum; the tier counts a miss and removes a corrupt file. Counters: `bytes_x`, `bytes_kv`, `act_misses`, `read_s`
(wall seconds during which at least one of the tier's reads ran: the read rate without the loader's recomputes and
copies, reads on several threads at once counted once). `read` may run on several threads at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from sglang_tiered.engine.meet import StoredPage
from sglang_tiered.engine.span_miss import SpanMiss
from sglang_tiered.storage import activations
from sglang_tiered.storage.ssd_tier import SSDTier


class TierPages:
    def __init__(self, tier: SSDTier, keys: Sequence[str], *, layers: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, hidden: int = 0, activations: bool = False) -> None:
        self.tier, self.keys, self.page_size, self.pages = tier, list(keys), page_size, len(keys)
        self.kv_shape, self.dtype = (layers, 2, page_size, kv_heads, head_dim), dtype
        self.x_shape = (layers, page_size, hidden)
        self.activations = activations and hidden > 0
        self.bytes_x = self.bytes_kv = self.act_misses = 0
        self.read_s = 0.0
        self._reading = 0  # reads running now
        self._since = 0.0  # when the running ones began to overlap (the first of them started)
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return self.bytes_x + self.bytes_kv

    def read(self, page: int) -> StoredPage:
        """Page `page` (see the module docstring)."""
        key = self.keys[page]
        if self.activations:
            act = activations.activation_key(key)
            if self.tier.contains(act):
                x = torch.empty(self.x_shape, dtype=self.dtype)
                if self._fill(act, [x[layer] for layer in range(self.x_shape[0])]):
                    with self._lock:
                        self.bytes_x += x.numel() * x.element_size()
                    return StoredPage(x=x)
            with self._lock:
                self.act_misses += 1
        kv = torch.empty(self.kv_shape, dtype=self.dtype)
        if not self._fill(key, [kv[layer, i] for layer in range(self.kv_shape[0]) for i in range(2)]):
            raise SpanMiss(f"KV page {key} is not readable")
        with self._lock:
            self.bytes_kv += kv.numel() * kv.element_size()
        return StoredPage(kv=kv.permute(0, 2, 1, 3, 4))  # [layers, page_size, 2, kv_heads, head_dim]

    def _fill(self, key: str, parts: list[torch.Tensor]) -> bool:
        """Read the stored file `key`'s segments into `parts` (contiguous views); False for a miss of any kind."""
        with self._lock:
            if not self._reading:
                self._since = time.perf_counter()
            self._reading += 1
        try:
            return self.tier.read_pages([(key, [memoryview(t.view(torch.uint8).numpy()) for t in parts])])[0]
        finally:
            with self._lock:
                self._reading -= 1
                if not self._reading:
                    self.read_s += time.perf_counter() - self._since
