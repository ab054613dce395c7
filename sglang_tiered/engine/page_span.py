"""A stored span of plain pages on the SSD tier, read layer by layer for the partial-recompute loader (KVPR).

The span is consecutive KV pages `keys` (layer_first layout). Its first `recompute_pages` pages come as activations
(storage/activations.py) where those are stored; every other page, and any page whose activation page is missing
or turns out corrupt on some layer, comes as KV -- from then on, for that page. A KV page that is missing or
corrupt ends the load (`SpanMiss`): the caller computes the span instead. Pages are read on the tier's I/O threads;
every segment is checked against its own checksum. Counters: `bytes_x`, `bytes_kv`, `act_missing`, `act_corrupt`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_tiered.engine.group_span import SpanMiss
from sglang_tiered.engine.kvpr import LayerData
from sglang_tiered.storage import activations
from sglang_tiered.storage.geometry import KVGeometry
from sglang_tiered.storage.page_file import CorruptPage, PageReader
from sglang_tiered.storage.ssd_tier import SSDTier


class PageSpan:
    def __init__(self, tier: SSDTier, keys: Sequence[str], *, layers: int, page_size: int, kv_heads: int,
                 head_dim: int, hidden: int, dtype: torch.dtype, recompute_pages: int) -> None:
        self.tier, self.keys, self.ps, self.dtype = tier, list(keys), page_size, dtype
        self.tokens = len(self.keys) * page_size
        self.kv_shape, self.hidden = (page_size, kv_heads, head_dim), hidden
        size = dtype.itemsize
        self.bytes_x = self.bytes_kv = self.act_missing = self.act_corrupt = 0
        self._kv: list[PageReader] = []
        self._x: list[PageReader | None] = []
        try:
            kv_segs = activations.kv_segment_bytes(KVGeometry(layers, kv_heads, head_dim, size), page_size)
            for key in self.keys:
                reader = tier.open_page(key, kv_segs)
                if reader is None:
                    raise SpanMiss(f"KV page {key} is not readable")
                self._kv.append(reader)
            x_segs = activations.segment_bytes(layers, page_size, hidden, size)
            for i, key in enumerate(self.keys):
                act = activations.activation_key(key)
                reader = tier.open_page(act, x_segs) if i < recompute_pages and tier.contains(act) else None
                self.act_missing += int(i < recompute_pages and reader is None)
                self._x.append(reader)
        except BaseException:
            self.close()
            raise

    def _read(self, job: tuple[int, int]) -> tuple[int, bool, list[bytearray]]:
        page, layer = job
        x = self._x[page]
        if x is not None:
            try:
                return page, True, x.read(layer, 1)
            except CorruptPage as exc:
                self.tier.drop_corrupt(activations.activation_key(self.keys[page]), exc)
                self.act_corrupt += 1
                self._x[page] = None
                x.close()
        try:
            return page, False, self._kv[page].read(2 * layer, 2)
        except CorruptPage as exc:
            self.tier.drop_corrupt(self.keys[page], exc)
            raise SpanMiss(f"KV page {self.keys[page]}: {exc}") from exc

    def fetch(self, layer: int) -> LayerData:
        got = self.tier.run_io(self._read, [(i, layer) for i in range(len(self.keys))])
        ps = self.ps
        x_pages = [(p, b[0]) for p, is_x, b in got if is_x]
        kv_pages = [(p, b) for p, is_x, b in got if not is_x]
        self.bytes_x += sum(len(b) for _, b in x_pages)
        self.bytes_kv += sum(len(k) + len(v) for _, (k, v) in kv_pages)

        def rows(pages) -> torch.Tensor:
            return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p, _ in pages]) if pages else \
                torch.empty(0, dtype=torch.int64)

        x = torch.stack([torch.frombuffer(b, dtype=self.dtype).view(ps, self.hidden) for _, b in x_pages]) \
            .view(-1, self.hidden) if x_pages else torch.empty(0, self.hidden, dtype=self.dtype)
        kv = torch.stack([torch.stack([torch.frombuffer(k, dtype=self.dtype).view(self.kv_shape),
                                       torch.frombuffer(v, dtype=self.dtype).view(self.kv_shape)], 1)
                          for _, (k, v) in kv_pages]).view(-1, 2, *self.kv_shape[1:]) if kv_pages else \
            torch.empty(0, 2, *self.kv_shape[1:], dtype=self.dtype)
        return LayerData(rows(x_pages), x, rows(kv_pages), kv)

    def close(self) -> None:
        for r in [*self._kv, *self._x]:
            if r is not None:
                r.close()
        self._kv, self._x = [], []


class TierPages:
    """Whole stored pages of a span on the SSD tier, one read each (the two-sided loader's source,
    `engine.meet.PageSource`): every layer's K and V of page i of `keys` (layer_first layout), checked against their
    checksums. A page that is missing or corrupt is a `SpanMiss` (the tier counts it and removes a corrupt file)."""

    def __init__(self, tier: SSDTier, keys: Sequence[str], *, layers: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        self.tier, self.keys, self.page_size, self.pages = tier, list(keys), page_size, len(keys)
        self.shape, self.dtype = (layers, 2, page_size, kv_heads, head_dim), dtype
        self.bytes_read = 0

    def read(self, page: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype)
        segments = [memoryview(buf[layer, i].view(torch.uint8).numpy()) for layer in range(self.shape[0])
                    for i in range(2)]
        if not self.tier.read_pages([(self.keys[page], segments)])[0]:
            raise SpanMiss(f"KV page {self.keys[page]} is not readable")
        self.bytes_read += buf.numel() * buf.element_size()
        return buf.permute(0, 2, 1, 3, 4)  # [layers, page_size, 2, kv_heads, head_dim]
