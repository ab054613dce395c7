"""Fusion of precomputed chunk KV into a prompt by selective recompute (CacheBlend), on the layer-by-layer engine.

A prompt is a list of spans. A span with stored KV (computed as if the chunk started at position 0) is *reused*;
any other span (the question, new text) is *fresh* and always computed fully. Per layer:

  1. the reused spans' stored KV of this layer is loaded and its keys re-rotated to their real offsets
     (RoPE: R(p + delta) = R(delta) R(p)), by a prefetch thread one layer ahead of the compute;
  2. the *active* tokens (fresh tokens + the reused tokens still selected) get new Q, K, V; their new K, V replace
     the reused ones; they attend to all tokens at or before their position;
  3. the selection shrinks for the next layer (see below). Tokens that leave the selection keep their hidden state
     frozen; from the next layer on their reused KV stands in for them.

Selection (`mode`):
  full    every token, every layer: plain prefill (the quality reference).
  prefix  exact reuse of a stored span that starts at position 0 (what a radix/prefix cache can do), the rest
          computed as an extend.
  reuse   full KV reuse: only fresh tokens are computed.
  single  one check layer (LMCache's scheme): layers 0..check_layer run on every token; at the check layer the
          `ratio` reused tokens with the highest KV deviation are kept and recomputed on all later layers.
  blend   gradual filtering (the paper's scheme): like `single` up to the check layer, then on every later layer
          the selection is re-ranked by that layer's deviation and shrinks; the per-layer ratios decrease linearly
          from ratio*(1+spread) to ratio*(1-spread) so that they average `ratio` (see `filter_schedule`).

KV deviation of a token = sum over heads and dims of (K_new - K_reused)^2 + (V_new - V_reused)^2 (fp32).
Layer 0's input is the token embedding, so reused KV equals fresh KV there (up to re-rotation rounding); the
deviation first shows at layer 1, which is why `check_layer` defaults to 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.kernels.extend_attention import causal_attention, positioned_attention

MODES = ("full", "prefix", "reuse", "single", "blend")
DEFAULT_RATIO = 0.15


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the prompt; `stored` says whether stored KV of these tokens is available: tokens
    offset .. offset + length - 1 of a chunk whose KV was computed at positions 0 .. (so the span's keys are re-rotated
    by start - offset). A chunk cut by a cached prefix or by a prefill piece boundary is a span with offset > 0 or
    a shorter length: causal attention makes the first k tokens' stored KV independent of the rest."""

    start: int
    end: int
    stored: bool
    offset: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start


# (layer, span index) -> that stored span's KV of that layer, [span tokens, 2, kv_heads, head_dim], computed at
# positions offset .. offset + length - 1. Called only for spans with `stored=True`, possibly from a loader thread.
LayerLoader = Callable[[int, int], torch.Tensor]


@dataclass
class FusionResult:
    logits: torch.Tensor  # [vocab] fp32, last prompt token
    kv: torch.Tensor  # [layers, tokens, 2, kv_heads, head_dim]
    computed: list[int] = field(default_factory=list)  # tokens computed on each layer
    load_wait_s: float = 0.0  # time the compute waited for the loader (0 when loading hides behind compute)
    load_s: float = 0.0  # time spent loading + re-rotating, summed over layers (overlapped or not)
    hidden: Optional[torch.Tensor] = None  # [hidden] residual stream of the last token after the last layer

    @property
    def recompute_fraction(self) -> float:
        """Computed token-layers / all token-layers."""
        return sum(self.computed) / (len(self.computed) * self.kv.shape[1])


def rerotate_keys(model: LlamaModel, k: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys [n, H, D] that were RoPE-rotated at positions p, rotated to positions p + delta."""
    if delta == 0:
        return k
    return model.rope(k, torch.full((k.shape[0],), delta, dtype=torch.int64))


def filter_schedule(ratio: float, layers: int, check_layer: int, spread: float = 0.3) -> list[float]:
    """Fractions of reused tokens selected at layers check_layer .. layers-2 (the selection made at layer l is
    recomputed at layer l+1). Linear from ratio*(1+spread) down to ratio*(1-spread); the mean is `ratio`."""
    m = layers - 1 - check_layer
    if m <= 0:
        return []
    if m == 1:
        return [ratio]
    spread = min(spread, (1 - ratio) / ratio) if ratio > 0 else 0.0  # keep every fraction <= 1, the mean = ratio
    hi, lo = ratio * (1 + spread), ratio * (1 - spread)
    return [hi + (lo - hi) * j / (m - 1) for j in range(m)]


def top_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor,
                  keep: int) -> torch.Tensor:
    """Indices (into the given rows, ascending) of the `keep` rows whose KV deviates most."""
    dev = (k_new.float() - k_old.float()).pow(2).sum((1, 2)) + (v_new.float() - v_old.float()).pow(2).sum((1, 2))
    keep = max(0, min(keep, dev.shape[0]))
    return torch.topk(dev, keep).indices.sort().values


def check_spans(spans: Sequence[Span], tokens: int, start: int = 0) -> None:
    pos = start
    for s in spans:
        if s.start != pos or s.end <= s.start:
            raise ValueError(f"spans must tile the prompt in order without gaps: {s} after position {pos}")
        pos = s.end
    if pos != tokens:
        raise ValueError(f"spans cover {pos} tokens, the prompt has {tokens}")


class _Prefetcher:
    """Loads (and re-rotates) layer l + 1 on a thread while layer l computes."""

    def __init__(self, model: LlamaModel, spans: Sequence[Span], loader: LayerLoader, first: int, overlap: bool):
        self.model, self.loader, self.overlap = model, loader, overlap
        self.stored = [(i, s) for i, s in enumerate(spans) if s.stored]
        self.load_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="blend-load") if overlap else None
        self._next: Optional[Future] = None
        if overlap and first < model.cfg.layers:
            self._next = self._pool.submit(self._load, first)

    def _load(self, layer: int) -> torch.Tensor:
        t0 = time.perf_counter()
        parts = []
        for i, span in self.stored:
            kv = self.loader(layer, i)
            if kv.shape[0] != span.length:
                raise ValueError(f"stored KV has {kv.shape[0]} tokens for a span of {span.length}")
            kv = kv.to(self.model.dtype)
            parts.append(torch.stack([rerotate_keys(self.model, kv[:, 0], span.start - span.offset), kv[:, 1]], 1))
        out = torch.cat(parts) if parts else self.model.empty_kv(0)[0]
        self.load_s += time.perf_counter() - t0
        return out

    def get(self, layer: int) -> tuple[torch.Tensor, float]:
        """KV of the stored spans' tokens (in prompt order) at `layer`, and the seconds the caller waited."""
        if not self.overlap:
            t0 = time.perf_counter()
            return self._load(layer), time.perf_counter() - t0
        t0 = time.perf_counter()
        kv = self._next.result()
        waited = time.perf_counter() - t0
        self._next = self._pool.submit(self._load, layer + 1) if layer + 1 < self.model.cfg.layers else None
        return kv, waited

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@torch.inference_mode()
def fuse(
    model: LlamaModel,
    ids: torch.Tensor,
    spans: Sequence[Span],
    loader: LayerLoader,
    *,
    mode: str = "blend",
    ratio: float = DEFAULT_RATIO,
    check_layer: int = 1,
    spread: float = 0.3,
    overlap: bool = True,
    trace: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None,
    prefix_len: int = 0,
    prefix_loader: Optional[Callable[[int], torch.Tensor]] = None,
) -> FusionResult:
    """Prefill `ids` reusing stored span KV per `mode` (see module docstring). `ratio` is the fraction of reused
    tokens recomputed per selective layer, averaged over layers; 1.0 recomputes everything (= full prefill).
    `trace(layer, positions, attn)` sees each layer's attention output [n, Hq, D] of the computed tokens.
    `prefix_len` tokens at the start already have exact KV (a radix-cache hit): `prefix_loader(layer)` gives it
    ([prefix_len, 2, kv_heads, head_dim], at its real positions); they are never recomputed and `spans` tile
    [prefix_len, len(ids))."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    n, layers, p = ids.shape[0], model.cfg.layers, prefix_len
    check_spans(spans, n, p)
    if p and prefix_loader is None:
        raise ValueError("prefix_len > 0 needs a prefix_loader")
    if mode == "full":
        spans = [Span(p, n, False)]  # nothing reused: every token on every layer
    if mode == "prefix":
        if p:
            raise ValueError("mode 'prefix' is the radix cache itself; it takes no extra prefix")
        return _prefix_extend(model, ids, spans, loader, trace)
    if not 0 <= check_layer < layers:
        raise ValueError(f"check_layer must be in [0, {layers}), got {check_layer}")

    reused_mask = torch.zeros(n, dtype=torch.bool)
    for s in spans:
        if s.stored:
            reused_mask[s.start : s.end] = True
    reused_idx = reused_mask.nonzero().squeeze(1)
    n_reused = reused_idx.shape[0]
    schedule = filter_schedule(ratio, layers, check_layer, spread) if mode == "blend" else []
    full_layers = check_layer + 1 if mode in ("single", "blend") else 0  # layers that compute every token
    first_loaded = check_layer if mode in ("single", "blend") else 0  # deviation needs the check layer's KV

    kv = model.empty_kv(n)
    fresh_mask = ~reused_mask
    fresh_mask[:p] = False
    active = torch.arange(p, n) if full_layers else fresh_mask.nonzero().squeeze(1)
    x = model.embed(ids[active])
    computed: list[int] = []
    waited = 0.0
    prefetch = _Prefetcher(model, spans, loader, first_loaded, overlap)
    try:
        for layer in range(layers):
            if p:
                kv[layer, :p] = prefix_loader(layer)
            if layer >= first_loaded:
                loaded, w = prefetch.get(layer)
                waited += w
                kv[layer, reused_idx] = loaded
            q, k, v = model.qkv(layer, x, active)
            keep = None  # positions in `active` that stay active after this layer
            if (mode == "single" and layer == check_layer) or (mode == "blend" and check_layer <= layer < layers - 1):
                frac = ratio if mode == "single" else schedule[layer - check_layer]
                is_reused = reused_mask[active]
                r_rows = is_reused.nonzero().squeeze(1)
                a_rows = active[r_rows]
                chosen = r_rows[top_deviation(k[r_rows], v[r_rows], kv[layer, a_rows, 0], kv[layer, a_rows, 1],
                                              math.ceil(frac * n_reused))]
                keep = torch.cat([(~is_reused).nonzero().squeeze(1), chosen]).sort().values
            kv[layer, active, 0], kv[layer, active, 1] = k, v
            computed.append(active.shape[0])
            if active.shape[0] == n - p:
                attn = causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], p)
            else:
                # selected tokens are spread over the prompt: small blocks keep the masked-out keys few
                # (460 of 3078 tokens, CPU: 17 ms per layer in blocks of 64, 20 ms in blocks of 256)
                attn = positioned_attention(q, kv[layer, :, 0], kv[layer, :, 1], active, block=64)
            if trace is not None:
                trace(layer, active, attn)
            x = model.finish_layer(layer, x, attn)
            if keep is not None:
                x, active = x[keep], active[keep]
    finally:
        prefetch.close()
    if active[-1] != n - 1:
        raise AssertionError("the last prompt token must stay active (it is never part of a stored span)")
    return FusionResult(model.logits(x[-1:])[0], kv, computed, waited, prefetch.load_s, hidden=x[-1])


def _prefix_extend(model: LlamaModel, ids: torch.Tensor, spans: Sequence[Span], loader: LayerLoader,
                   trace: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]]) -> FusionResult:
    """Exact prefix reuse: a stored span at position 0 is the prefix; everything after it is computed."""
    n, layers = ids.shape[0], model.cfg.layers
    prefix = spans[0].end if spans[0].stored and spans[0].end < n else 0
    kv = model.empty_kv(n)
    positions = torch.arange(prefix, n)
    x = model.embed(ids[prefix:])
    t_load = 0.0
    for layer in range(layers):
        if prefix:
            t0 = time.perf_counter()
            kv[layer, :prefix] = loader(layer, 0)
            t_load += time.perf_counter() - t0
        q, k, v = model.qkv(layer, x, positions)
        kv[layer, prefix:, 0], kv[layer, prefix:, 1] = k, v
        attn = causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], prefix)
        if trace is not None:
            trace(layer, positions, attn)
        x = model.finish_layer(layer, x, attn)
    return FusionResult(model.logits(x[-1:])[0], kv, [n - prefix] * layers, t_load, t_load, hidden=x[-1])


@torch.inference_mode()
def greedy_continue(model: LlamaModel, kv: torch.Tensor, logits: torch.Tensor, steps: int,
                    stop: frozenset[int] = frozenset()) -> list[int]:
    """At most `steps` greedy tokens after a prefill that produced `kv` [layers, n, ...] and last-token `logits`;
    ends after the first token in `stop` (included), as a server's output does."""
    n = kv.shape[1]
    cache = torch.cat([kv, model.empty_kv(steps)[:, :]], 1)
    out = [int(logits.argmax())]
    for t in range(steps - 1):
        if out[-1] in stop:
            break
        pos = n + t
        x = model.embed(torch.tensor([out[-1]]))
        for layer in range(model.cfg.layers):
            q, k, v = model.qkv(layer, x, torch.tensor([pos]))
            cache[layer, pos, 0], cache[layer, pos, 1] = k[0], v[0]
            x = model.finish_layer(layer, x, causal_attention(q, cache[layer, : pos + 1, 0],
                                                              cache[layer, : pos + 1, 1], pos))
        out.append(int(model.logits(x)[0].argmax()))
    return out
