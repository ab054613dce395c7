"""Routes SGLang's `torch_native` attention (the CPU fallback) through our prefix-aware kernel.

Seam (listed in plugin.py): AROUND hooks on `TorchNativeAttnBackend._run_sdpa_forward_extend` and
`_run_sdpa_forward_decode`. Installed only on servers without CUDA started with `--tiered-cpu-attention
prefix_aware` (the default with `--kv-backend tiered`). Cases the kernel does not cover (encoder-decoder,
cross-attention, sliding windows, non-causal) go to SGLang's original code, and so does a call in which our kernel
raises (logged and counted in `sglang_tiered:hook_errors_total`): the batch is computed by SGLang instead.
"""

from __future__ import annotations

import logging
import threading

import torch

from sglang_tiered.integration import faults, metrics, settings, sparse_load
from sglang_tiered.kernels.extend_attention import causal_attention, extend_attention

logger = logging.getLogger("sglang_tiered")
_batch = threading.local()  # layer id and request ids of the decode step in progress (gated sparse loading)
_batch.rids = None
_TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def _supported(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    return encoder_lens is None and not is_cross_attn and (sliding_window_size is None or sliding_window_size < 0)


_failures = 0


def _failed() -> None:
    global _failures
    _failures += 1
    metrics.count("hook_errors")
    if _failures == 1:
        logger.exception("tiered cpu attention: the prefix-aware kernel failed; SGLang's torch_native runs instead")
    elif _failures % 1000 == 0:
        logger.error("tiered cpu attention: the prefix-aware kernel failed %d times", _failures)


def _extend(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
            is_cross_attn=False, sliding_window_size=None):
    if causal and _supported(encoder_lens, is_cross_attn, sliding_window_size):
        try:
            faults.check("cpu_attention")
            return extend_attention(query, k_cache, v_cache, req_to_token, req_pool_indices, extend_prefix_lens,
                                    extend_seq_lens, scale=scaling, out=output)
        except Exception:
            _failed()
    return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                    causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)


def _decode(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
            sliding_window_size=None):
    if _supported(encoder_lens, is_cross_attn, sliding_window_size):
        lens = seq_lens.tolist()
        try:
            faults.check("cpu_attention")
            if _batch.rids and any(sparse_load.holes(rid) is not None for rid in _batch.rids):
                return _decode_over_holes(query, output, k_cache, v_cache, req_to_token, req_pool_indices, lens,
                                          scaling)
            return extend_attention(query, k_cache, v_cache, req_to_token, req_pool_indices, [n - 1 for n in lens],
                                    [1] * len(lens), scale=scaling, out=output)
        except Exception:
            _failed()
    return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                    scaling=scaling, enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                    sliding_window_size=sliding_window_size)


def _decode_over_holes(query, output, k_cache, v_cache, req_to_token, req_pool_indices, lens, scaling):
    """Decode where some requests' prefixes were loaded sparsely (sparse_load.py): each such request's query
    attends only to the positions that hold loaded KV on this layer."""
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), lens)):
        h = sparse_load.holes(_batch.rids[i])
        pos = h.positions(_batch.layer, n) if h is not None else torch.arange(n)
        slots = req_to_token[row, pos]
        output[i : i + 1] = causal_attention(query[i : i + 1], k_cache[slots].to(query.dtype),
                                             v_cache[slots].to(query.dtype), len(pos) - 1, scaling)
    return output


def _around_forward_decode(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    """Remembers the layer and the requests of the decode step for `_decode` (which SGLang calls without them)."""
    _batch.layer, _batch.rids = layer.layer_id, forward_batch.rids
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        _batch.rids = None


def register_hooks() -> bool:
    """Register the hooks if this process should use them. Returns True if registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = settings.current()
    if current is None or not current.cpu_only or current.config.cpu_attention != "prefix_aware":
        return False
    HookRegistry.register(f"{_TARGET}._run_sdpa_forward_extend", _extend, HookType.AROUND)
    HookRegistry.register(f"{_TARGET}._run_sdpa_forward_decode", _decode, HookType.AROUND)
    if current.config.importance_load == "gated":
        HookRegistry.register(f"{_TARGET}.forward_decode", _around_forward_decode, HookType.AROUND)
    return True
