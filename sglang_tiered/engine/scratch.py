"""A reusable KV buffer for a server's forwards on a CPU.

A fresh buffer costs its first touch: the kernel zero-fills every page on its first write. For the 531 MB of an
8064-token span of the MHA benchmark model (30 layers, 9 KV heads of 64, bf16) that was 0.146 s against 0.028 s to
fill a buffer already touched (2-core AMD EPYC, medians of 5), on every load. Torch's CPU allocator hands large
buffers back to the system, so each request paid it again. On CUDA the caching allocator already reuses memory (and
memory held here would be outside SGLang's accounting), so there `take` allocates each time.
"""

from __future__ import annotations

from typing import Optional

import torch


class KVScratch:
    """One buffer, grown to the largest request and kept (at most one request's KV, its cached prefix included: the
    server's context length bounds it). `take(model, tokens)` returns a contiguous [layers, tokens, 2, kv_heads,
    head_dim] view of it; the caller must be done with one view before it takes the next (one forward at a time:
    the scheduler's)."""

    def __init__(self) -> None:
        self._flat: Optional[torch.Tensor] = None

    def take(self, model, tokens: int) -> torch.Tensor:
        c = model.cfg
        shape = (c.layers, tokens, 2, c.kv_heads, c.head_dim)
        if model.device.type != "cpu":
            return model.empty_kv(tokens)
        need = c.layers * tokens * 2 * c.kv_heads * c.head_dim
        flat = self._flat
        if flat is None or flat.numel() < need or flat.dtype != model.dtype:
            self._flat = None  # (the old buffer goes before the new one is touched)
            flat = self._flat = torch.empty(need, dtype=model.dtype)
        return flat[:need].view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()
