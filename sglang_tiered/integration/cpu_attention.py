"""Routes SGLang's `torch_native` attention (the CPU fallback) through our prefix-aware kernel.

Seam: AROUND hooks on `TorchNativeAttnBackend._run_sdpa_forward_extend` and `_run_sdpa_forward_decode`. Installed
only when CUDA is absent and the launcher asked for it (`--tiered-cpu-attention prefix_aware`, the default with
`--kv-backend tiered`; carried to scheduler processes in SGLANG_TIERED_CPU_ATTENTION). Cases the kernel does not
cover (encoder-decoder, cross-attention, sliding windows, non-causal) go to SGLang's original code.
"""

from __future__ import annotations

import os

from sglang_tiered.config import CPU_ATTENTION_CHOICES
from sglang_tiered.kernels.extend_attention import extend_attention

ENV = "SGLANG_TIERED_CPU_ATTENTION"
CHOICES = CPU_ATTENTION_CHOICES
_TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def _supported(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    return encoder_lens is None and not is_cross_attn and (sliding_window_size is None or sliding_window_size < 0)


def _extend(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
            is_cross_attn=False, sliding_window_size=None):
    if causal and _supported(encoder_lens, is_cross_attn, sliding_window_size):
        return extend_attention(query, k_cache, v_cache, req_to_token, req_pool_indices, extend_prefix_lens,
                                extend_seq_lens, scale=scaling, out=output)
    return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                    causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)


def _decode(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
            sliding_window_size=None):
    if _supported(encoder_lens, is_cross_attn, sliding_window_size):
        lens = seq_lens.tolist()
        return extend_attention(query, k_cache, v_cache, req_to_token, req_pool_indices, [n - 1 for n in lens],
                                [1] * len(lens), scale=scaling, out=output)
    return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                    scaling=scaling, enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                    sliding_window_size=sliding_window_size)


def register_hooks() -> bool:
    """Register the hooks if this process should use them. Returns True if registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tiered.integration.cpu_shims import cuda_absent

    if os.environ.get(ENV) != "prefix_aware" or not cuda_absent():
        return False
    HookRegistry.register(f"{_TARGET}._run_sdpa_forward_extend", _extend, HookType.AROUND)
    HookRegistry.register(f"{_TARGET}._run_sdpa_forward_decode", _decode, HookType.AROUND)
    return True
