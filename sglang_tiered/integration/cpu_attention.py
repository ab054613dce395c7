"""Routes SGLang's `torch_native` attention (the CPU fallback) through our prefix-aware kernel.

Seam (listed in plugin.py): AROUND hooks on `TorchNativeAttnBackend._run_sdpa_forward_extend` and
`_run_sdpa_forward_decode`. Installed on servers without CUDA started with `--tiered-cpu-attention prefix_aware` (the
default with `--kv-backend tiered`); on a CUDA server with gated loading as a preview
(`SGLANG_TIERED_CUDA_PREVIEW=1`, `--attention-backend torch_native`) only the decode over a sparse load's holes runs
here. Cases the kernel does not cover (encoder-decoder, cross-attention, sliding windows, non-causal) go to SGLang's
original code, and so does a call in which our kernel raises (logged and counted in
`sglang_tiered:hook_errors_total`): the batch is computed by SGLang instead.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from sglang_tiered.integration import faults
from sglang_tiered.kernels.extend_attention import causal_attention, extend_attention

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")
_TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def _supported(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    return encoder_lens is None and not is_cross_attn and (sliding_window_size is None or sliding_window_size < 0)


class CPUAttention:
    """This process's attention hooks, with the layer and requests of the decode step in progress (gated sparse
    loading: `_decode` skips the prefix positions a sparse load did not fill)."""

    def __init__(self, rt: Runtime, holes_only: bool = False) -> None:
        """`holes_only`: only a decode over a sparse load's holes runs here, everything else is SGLang's (CUDA)."""
        self.rt = rt
        self.holes_only = holes_only
        self._batch = threading.local()
        self._batch.rids = None
        self._failures = 0

    def _failed(self) -> None:
        self._failures += 1
        self.rt.events.count("hook_errors")
        if self._failures == 1:
            logger.exception("tiered cpu attention: the prefix-aware kernel failed; SGLang's torch_native runs "
                             "instead")
        elif self._failures % 1000 == 0:
            logger.error("tiered cpu attention: the prefix-aware kernel failed %d times", self._failures)

    def extend(self, original, backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
               extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
               is_cross_attn=False, sliding_window_size=None):
        if causal and _supported(encoder_lens, is_cross_attn, sliding_window_size):
            try:
                faults.check("cpu_attention")
                return extend_attention(query, k_cache, v_cache, req_to_token, req_pool_indices, extend_prefix_lens,
                                        extend_seq_lens, scale=scaling, out=output)
            except Exception:
                self._failed()
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)

    def decode(self, original, backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
               encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
               sliding_window_size=None):
        if _supported(encoder_lens, is_cross_attn, sliding_window_size):
            try:  # (SGLang's own decode runs below, outside: its failures are not counted as ours)
                faults.check("cpu_attention")
                door, rids = self.rt.door, getattr(self._batch, "rids", None)
                sparse = door.loader("sparse") if door is not None else None
                if sparse is not None and rids and any(sparse.holes(rid) is not None for rid in rids):
                    return self._decode_over_holes(sparse, query, output, k_cache, v_cache, req_to_token,
                                                   req_pool_indices, seq_lens.tolist(), scaling)
                if not self.holes_only:  # (on a GPU the lengths' read-back would wait for the device every layer)
                    lens = seq_lens.tolist()
                    return extend_attention(query, k_cache, v_cache, req_to_token, req_pool_indices,
                                            [n - 1 for n in lens], [1] * len(lens), scale=scaling, out=output)
            except Exception:
                self._failed()
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)

    def _decode_over_holes(self, sparse, query, output, k_cache, v_cache, req_to_token, req_pool_indices, lens,
                           scaling):
        """Decode where some requests' prefixes were loaded sparsely (sparse.py): each such request's query
        attends only to the positions that hold loaded KV on this layer."""
        for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), lens)):
            h = sparse.holes(self._batch.rids[i])
            pos = h.positions(self._batch.layer, n) if h is not None else torch.arange(n)
            slots = req_to_token[row, pos]
            output[i : i + 1] = causal_attention(query[i : i + 1], k_cache[slots].to(query.dtype),
                                                 v_cache[slots].to(query.dtype), len(pos) - 1, scaling)
        return output

    def around_forward_decode(self, original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
        """Remembers the layer and the requests of the decode step for `decode` (which SGLang calls without them)."""
        self._batch.layer, self._batch.rids = layer.layer_id, forward_batch.rids
        try:
            return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self._batch.rids = None


def register_hooks(rt: Runtime) -> bool:
    """Register the hooks if this process should use them. Returns True if registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = rt.settings
    if current is None:
        return False
    gated = current.config.importance_load == "gated"
    if current.cpu_only and current.config.cpu_attention == "prefix_aware":
        attention = CPUAttention(rt)
        HookRegistry.register(f"{_TARGET}._run_sdpa_forward_extend", attention.extend, HookType.AROUND)
    elif current.cuda_preview and gated:  # (the launcher required --attention-backend torch_native)
        attention = CPUAttention(rt, holes_only=True)
    else:
        return False
    HookRegistry.register(f"{_TARGET}._run_sdpa_forward_decode", attention.decode, HookType.AROUND)
    if gated:
        HookRegistry.register(f"{_TARGET}.forward_decode", attention.around_forward_decode, HookType.AROUND)
    return True
