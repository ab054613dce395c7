"""A stored span served from a repacked group on the SSD tier: the `StoredSpan` that `sparse_prefill` reads.

The span is the tokens [first * page_size, (first + pages) * page_size) of the group (its member pages first ..
first + pages - 1). `probe` dequantizes the group's probe; `load` reads only the chunks that hold the wanted tokens
and returns their K and V. Every read is checksummed by the tier; a miss raises `SpanMiss`. Bytes read are counted
in `bytes_read` (what was asked of the file system; the tier reads groups without readahead, so the block device
reads the same bytes, rounded out to 4 KiB pages).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_tiered.engine.span_miss import SpanMiss
from sglang_tiered.storage.group_file import GroupMeta, dequantize_probe
from sglang_tiered.storage.ssd_tier import SSDTier

_TORCH = {2: {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}, 4: {"torch.float32": torch.float32}}


class GroupSpan:
    def __init__(self, tier: SSDTier, meta: GroupMeta, first: int, pages: int) -> None:
        if first < 0 or pages < 1 or first + pages > len(meta.keys):
            raise ValueError(f"pages {first}..{first + pages} are not in a group of {len(meta.keys)}")
        self.tier, self.meta = tier, meta
        self.start = first * meta.page_size
        self.tokens = pages * meta.page_size
        self.dtype = _TORCH[meta.itemsize][tier.namespace.dtype]
        self.units = torch.arange(self.start, self.start + self.tokens) // meta.chunk  # the I/O unit: a chunk
        self.bytes_read = 0

    def probe(self, layer: int, kv_heads: Sequence[int]) -> torch.Tensor:
        got = self.tier.groups.read_probe(self.meta.gid, layer)
        if got is None:
            raise SpanMiss(f"probe of layer {layer} of group {self.meta.gid}")
        q, scale = got
        self.bytes_read += q.nbytes + scale.nbytes
        cols = [self.meta.probe_heads.index(h) for h in kv_heads]
        span = slice(self.start, self.start + self.tokens)  # per token and head: only the span's rows are decoded
        return torch.from_numpy(dequantize_probe(q[span][:, cols], scale[span][:, cols], self.meta.probe_bits))

    def load(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        m = self.meta
        tokens = idx + self.start  # the span's tokens `idx` as tokens of the group
        wanted = torch.unique(tokens // m.chunk)  # ascending
        chunks = wanted.tolist()
        got = self.tier.groups.read_chunks(m.gid, layer, chunks)
        if got is None:
            raise SpanMiss(f"layer {layer} of group {m.gid}")
        # the chunks side by side: chunk i of `chunks` starts at row i * m.chunk (only the group's last chunk may be
        # shorter, and it sorts last)
        k, v = (bytearray().join(got[c][j] for c in chunks) for j in (0, 1))
        self.bytes_read += len(k) + len(v)
        where = torch.empty(m.chunks, dtype=torch.int64)
        where[wanted] = torch.arange(len(chunks))
        rows = where[tokens // m.chunk] * m.chunk + tokens % m.chunk
        shape = (-1, m.heads, m.dim)
        return torch.stack([torch.frombuffer(k, dtype=self.dtype).view(shape)[rows],
                            torch.frombuffer(v, dtype=self.dtype).view(shape)[rows]], 1)
