"""The one hook on SGLang's Llama forward, shared by the mechanisms that compute a prefill themselves (fusion of
chunk KV in blend.py, chained prefill in runahead.py), and the glue they share: our layer-by-layer engine over
SGLang's weights, reading a cached prefix's KV from SGLang's pool and writing an extend's KV into it.

Seam: `sglang.srt.models.llama.LlamaModel.forward` (AROUND, scheduler processes). For an extend batch without input
embeddings or pipeline proxies, each registered handler is asked in order; the first that returns a tensor has
done the forward: the request's new KV is in its slots (`forward_batch.out_cache_loc`) and the returned
[extend tokens, hidden] tensor holds the final-normed hidden state of the last token in its last row (the rows
before it are zeros: SGLang's logits processor reads only the last row unless input logprobs or hidden states were
requested, which handlers must decline). A handler returns None to leave the batch to SGLang's own forward.
On CPU-only servers every forward (also SGLang's own) is marked as foreground work, so that the SSD
write-through yields to it (`gate_background_writes`, storage/foreground.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.storage.foreground import FOREGROUND

Handler = Callable[..., Optional[torch.Tensor]]  # (module, input_ids, positions, forward_batch) -> hidden | None
_handlers: list[Handler] = []
_engines: dict[int, LlamaModel] = {}


_hooked = False


def _ensure_hook() -> None:
    global _hooked
    if not _hooked:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.models.llama.LlamaModel.forward", _around_forward, HookType.AROUND)
        _hooked = True


def add_handler(handler: Handler) -> None:
    """Register `handler` (idempotent); the forward hook itself is registered once."""
    _ensure_hook()
    if handler not in _handlers:
        _handlers.append(handler)


def gate_background_writes() -> None:
    """CPU-only servers: SSD write-through waits while a forward runs (storage/foreground.py)."""
    FOREGROUND.enabled = True
    _ensure_hook()


def _around_forward(original, self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None,
                    **kwargs):
    with FOREGROUND.busy():
        if input_embeds is None and pp_proxy_tensors is None and forward_batch.forward_mode.is_extend():
            for handler in _handlers:
                hidden = handler(self, input_ids, positions, forward_batch)
                if hidden is not None:
                    return hidden
        return original(self, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, **kwargs)


def engine_from_sglang(module) -> LlamaModel:
    """Our layer-by-layer engine over the weights of SGLang's `LlamaModel` (views of the fused projections, no
    copy), one per module. Raises NotImplementedError when the module holds a tensor-parallel shard."""
    if id(module) in _engines:
        return _engines[id(module)]
    hf = module.config
    cfg = LlamaConfig.from_dict(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    embed = module.embed_tokens.weight
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed, "model.norm.weight": module.norm.weight,
                                  "lm_head.weight": embed}  # the engine's logits are not used in the server
    for i, layer in enumerate(module.layers):
        qkv = layer.self_attn.qkv_proj.weight
        if qkv.shape[0] != q + 2 * kv:
            raise NotImplementedError("needs the whole model in one rank (TP = 1)")
        gate_up = layer.mlp.gate_up_proj.weight
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": layer.input_layernorm.weight,
                  p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                  p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q : q + kv],
                  p + "self_attn.v_proj.weight": qkv[q + kv :],
                  p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                  p + "mlp.gate_proj.weight": gate_up[: cfg.intermediate],
                  p + "mlp.up_proj.weight": gate_up[cfg.intermediate :],
                  p + "mlp.down_proj.weight": layer.mlp.down_proj.weight})
    _engines[id(module)] = LlamaModel(cfg, w, dtype=embed.dtype)
    return _engines[id(module)]


def whole_model_in_rank(module) -> bool:
    """False under pipeline parallelism (the module runs only some layers)."""
    layers = len(module.layers)
    return getattr(module, "start_layer", 0) == 0 and getattr(module, "end_layer", layers) == layers


def prefix_kv_reader(fb) -> Callable[[int], torch.Tensor]:
    """layer -> [prefix, 2, kv_heads, head_dim]: the KV of the single request's cached prefix, read from the pool."""
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    prefix = int(fb.extend_prefix_lens_cpu[0])
    pool = get_token_to_kv_pool()
    row = get_req_to_token_pool().req_to_token[fb.req_pool_indices[0], :prefix].to(torch.int64)

    def read(layer: int) -> torch.Tensor:
        return torch.stack([pool.get_key_buffer(layer)[row], pool.get_value_buffer(layer)[row]], 1)

    return read


def write_extend(fb, engine: LlamaModel, new_kv: torch.Tensor, last_hidden: torch.Tensor) -> torch.Tensor:
    """Store `new_kv` [layers, extend tokens, 2, kv_heads, head_dim] in the request's slots and return the forward's
    output for SGLang's logits processor, built from the last token's residual stream `last_hidden` [hidden]."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    pool = get_token_to_kv_pool()
    slots = fb.out_cache_loc
    loc = KVWriteLoc(slots, physical=True)
    for layer in range(engine.cfg.layers):
        pool.set_kv_buffer(None, loc, new_kv[layer, :, 0], new_kv[layer, :, 1], layer_id_override=layer)
    hidden = torch.zeros(new_kv.shape[1], engine.cfg.hidden, dtype=engine.dtype, device=slots.device)
    hidden[-1] = engine.final_norm(last_hidden[None])[0]
    return hidden
