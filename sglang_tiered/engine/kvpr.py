"""Partial-recompute loading of a stored prefix (KVPR), exact, on the layer-by-layer engine.

A prompt = an exact prefix P (its KV already in memory), a stored span S (on a slow tier) and new tokens C. Per
layer, the span's source hands over (from the engine's `LayerLoader`, one layer ahead, on the I/O thread):

* for the tokens the split put in the recompute part: their attention inputs X (post-RMSNorm) -> K = X W_K with
  RoPE at their true positions, V = X W_V, computed here on the caller's thread while the next layer is read;
* for the other tokens: their stored K and V.

With the span's KV complete, C's layer runs over [P, S, C] exactly as a full prefill would. The result holds the
KV of S and C for every layer (to be written into the request's slots). `recomputed` may differ per layer: a
source that finds an activation page missing or corrupt hands that page's KV instead (never wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from sglang_tiered.engine.layer_loader import LayerLoader
from sglang_tiered.engine.llama import LlamaModel, Rope
from sglang_tiered.kernels.extend_attention import causal_attention


@dataclass
class LayerData:
    """One layer of the span: X of the tokens `x_idx` and K, V of the tokens `kv_idx` (indices into S; together
    they cover S exactly once)."""

    x_idx: torch.Tensor  # [a] int64
    x: torch.Tensor  # [a, hidden]
    kv_idx: torch.Tensor  # [b] int64
    kv: torch.Tensor  # [b, 2, kv_heads, head_dim]


class SpanSource(Protocol):
    tokens: int

    def fetch(self, layer: int) -> LayerData:
        """The layer's data (runs on the loader thread). Raises to abandon the load."""
        ...


@dataclass
class KVPRResult:
    kv: torch.Tensor  # [layers, |S| + |C|, 2, kv_heads, head_dim]: the span's KV, then the new tokens'
    hidden: torch.Tensor  # [hidden] residual stream of the last token after the last layer
    recomputed: int  # token-layers of S recomputed from activations
    wait_s: float  # seconds the compute waited for the loader
    load_s: float  # seconds the loader spent reading
    inputs: Optional[torch.Tensor] = None  # [layers, |C|, hidden]: the new tokens' attention inputs (if asked)


@torch.inference_mode()
def kvpr_prefill(model: LlamaModel, ids: torch.Tensor, *, prefix_len: int, span: SpanSource,
                 prefix_loader: Optional[Callable[[int], torch.Tensor]] = None,
                 overlap: bool = True, inputs: bool = False, rope: Optional[Rope] = None) -> KVPRResult:
    """Prefill the new tokens `ids` (positions prefix_len + span.tokens ..) over the exact prefix
    (`prefix_loader(layer)` -> [prefix_len, 2, kv_heads, head_dim]) and the stored span (see the module docstring).
    `inputs`: also return the new tokens' attention inputs (to store them as activations in turn). `rope`: the
    rotation of recomputed keys (`LlamaModel.kv_from_input`)."""
    n, p, s = ids.shape[0], prefix_len, span.tokens
    if n < 1 or s < 1:
        raise ValueError(f"need new tokens and a stored span, got {n} and {s}")
    if p and prefix_loader is None:
        raise ValueError("prefix_len > 0 needs a prefix_loader")
    positions = torch.arange(p + s, p + s + n)
    out = model.empty_kv(s + n)
    x = model.embed(ids)
    recomputed = 0
    xs = torch.empty(model.cfg.layers, n, model.cfg.hidden, dtype=model.dtype) if inputs else None
    with LayerLoader(span.fetch, model.cfg.layers, overlap=overlap, name="kvpr-load") as loader:
        for layer in range(model.cfg.layers):
            data = loader.get(layer)
            span_kv = out[layer, :s]
            if data.x_idx.numel():
                k, v = model.kv_from_input(layer, data.x.to(model.dtype), p + data.x_idx, rope)
                span_kv[data.x_idx, 0], span_kv[data.x_idx, 1] = k, v
                recomputed += int(data.x_idx.numel())
            if data.kv_idx.numel():
                span_kv[data.kv_idx] = data.kv.to(model.dtype)
            if xs is not None:
                xs[layer] = model.attention_input(layer, x)
            q, k, v = model.qkv(layer, x, positions)
            out[layer, s:, 0], out[layer, s:, 1] = k, v
            prefix = prefix_loader(layer) if p else out[layer, :0]
            kk = torch.cat([prefix[:, 0], out[layer, :, 0]])
            vv = torch.cat([prefix[:, 1], out[layer, :, 1]])
            x = model.finish_layer(layer, x, causal_attention(q, kk, vv, p + s))
    return KVPRResult(out, x[-1], recomputed, loader.wait_s, loader.load_s, xs)


class MemorySpan:
    """A span held in memory (tests, benchmarks of the engine): its full KV [layers, s, 2, H, D] and its attention
    inputs [layers, s, hidden]; the first `split` tokens come as activations."""

    def __init__(self, kv: torch.Tensor, x: torch.Tensor, split: int) -> None:
        self.kv, self.x, self.tokens = kv, x, kv.shape[1]
        if not 0 <= split <= self.tokens:
            raise ValueError(f"split {split} outside 0..{self.tokens}")
        self.split = split

    def fetch(self, layer: int) -> LayerData:
        a = self.split
        return LayerData(torch.arange(a), self.x[layer, :a].clone(), torch.arange(a, self.tokens),
                         self.kv[layer, a:].clone())


@torch.inference_mode()
def prefill_with_inputs(model: LlamaModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference prefill that also returns every layer's attention input: (logits, kv, x [layers, n, hidden])."""
    n = ids.shape[0]
    kv = model.empty_kv(n)
    xs = torch.empty(model.cfg.layers, n, model.cfg.hidden, dtype=model.dtype)
    positions = torch.arange(n)
    x = model.embed(ids)
    for layer in range(model.cfg.layers):
        xs[layer] = model.attention_input(layer, x)
        q, k, v = model.qkv(layer, x, positions)
        kv[layer, :, 0], kv[layer, :, 1] = k, v
        x = model.finish_layer(layer, x, causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], 0))
    return model.logits(x[-1:])[0], kv, xs
