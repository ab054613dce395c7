"""Blending of precomputed chunk KV into a prompt by selective recompute (CacheBlend), on the layer-by-layer engine.

A prompt is a list of spans. A span with stored KV (computed as if the chunk started at position 0) is *reused*;
any other span (the question, new text) is *fresh* and always computed fully. Per layer:

  1. the reused spans' stored KV of this layer is loaded and its keys re-rotated to their real offsets
     (RoPE: R(p + delta) = R(delta) R(p)), by the engine's `LayerLoader` one layer ahead of the compute;
  2. the *active* tokens (fresh tokens + the reused tokens still selected) get new Q, K, V; their new K, V replace
     the reused ones;
  3. on a selective layer the selection shrinks (see below), ranked by this layer's new K, V. Tokens that leave
     keep this layer's new K, V, skip its attention and MLP (their output would feed nothing), and from the next
     layer on their reused KV stands in for them;
  4. the tokens still active attend to all tokens at or before their position, then the layer's MLP.

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

Ranking (`select`): `deviation` (CacheBlend's) ranks the candidates by KV deviation alone; `importance` adds the
attention each candidate receives at that layer from the prompt's last `window` tokens (the question; every query
head, as `kernels.importance.window_scores`), each of the two scores as a share of its sum over the candidates, so
a token the question reads closely is recomputed even where its KV moved little. `position` (EPIC's LegoLink,
arXiv 2410.15332) ranks nothing: the first `position_tokens` tokens of every reused span are recomputed on every
layer -- where a chunk computed on its own put its attention sink -- with no check layer and no deviation pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_tiered.engine.blend_plan import Span, check_spans
from sglang_tiered.engine.layer_loader import LayerLoader
from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.kernels.extend_attention import causal_attention, positioned_attention
from sglang_tiered.kernels.importance import window_scores
from sglang_tiered.policy.loading import DEFAULT_RATIO, POSITION_TOKENS, LoadingController

MODES = ("full", "prefix", "reuse", "single", "blend")
SELECTS = ("deviation", "importance", "position")

# (layer, span index) -> that stored span's KV of that layer, [span tokens, 2, kv_heads, head_dim], computed at
# positions offset .. offset + length - 1. Called only for spans with `stored=True`, possibly from a loader thread.
SpanLoader = Callable[[int, int], torch.Tensor]
Trace = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, positions, attention output [n, Hq, D])


@dataclass
class BlendResult:
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


def observe(controller: LoadingController, result: BlendResult, reused_tokens: int, token_layer_bytes: int,
            elapsed_s: float) -> None:
    """Feed the loading controller both speeds from one `blend_prefill` that took `elapsed_s` and reused
    `reused_tokens` tokens of KV: loading moved that KV on every loaded layer; compute is the time not spent waiting
    for the loader."""
    controller.observe_load(result.load_s, token_layer_bytes * reused_tokens * len(result.computed))
    controller.observe_compute(max(elapsed_s - result.load_wait_s, 1e-9), sum(result.computed))


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


def deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """KV deviation per row [rows] (fp32): squared differences of K and of V, summed over heads and dims."""
    return (k_new.float() - k_old.float()).pow(2).sum((1, 2)) + (v_new.float() - v_old.float()).pow(2).sum((1, 2))


def top_rows(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices (ascending) of the `keep` rows with the highest `score`."""
    keep = max(0, min(keep, score.shape[0]))
    return torch.topk(score, keep).indices.sort().values


def top_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor,
                  keep: int) -> torch.Tensor:
    """Indices (into the given rows, ascending) of the `keep` rows whose KV deviates most."""
    return top_rows(deviation(k_new, v_new, k_old, v_old), keep)


def shares(*scores: torch.Tensor) -> torch.Tensor:
    """The sum of the scores, each as a share of its own total (an all-zero score adds nothing)."""
    return sum(x / x.sum() if x.sum() > 0 else torch.zeros_like(x) for x in scores)


def stored_kv_fetch(model: LlamaModel, spans: Sequence[Span], loader: SpanLoader) -> Callable[[int], torch.Tensor]:
    """layer -> KV of all stored spans' tokens at that layer, in prompt order, keys re-rotated to their positions
    (all spans' keys in one rotation, by rows computed once: 1,340 keys of 10 spans, bf16, two CPU threads:
    0.38 ms per layer, 0.9 ms span by span)."""
    stored = [(i, s) for i, s in enumerate(spans) if s.stored]
    if not stored:
        return lambda layer: model.empty_kv(0)[0]
    shift = torch.cat([torch.full((s.length,), s.start - s.offset, dtype=torch.int64) for _, s in stored])
    rows = model.rope_rows(shift)  # (host positions: the table grows to them; a GPU model gets its rows there)

    def fetch(layer: int) -> torch.Tensor:
        parts = []
        for i, span in stored:
            kv = loader(layer, i)
            if kv.shape[0] != span.length:
                raise ValueError(f"stored KV has {kv.shape[0]} tokens for a span of {span.length}")
            parts.append(kv)
        kv = torch.cat(parts).to(device=model.device, dtype=model.dtype)  # (stored KV is read into host memory)
        kv[:, 0] = model.rotate(kv[:, 0], rows)
        return kv

    return fetch


@dataclass(frozen=True)
class _Selection:
    """Which layers shrink the set of recomputed reused tokens, and to what fraction of them."""

    mode: str
    ratio: float
    check_layer: int
    schedule: tuple[float, ...]  # blend: fraction selected at layers check_layer .. layers - 2
    window: int = 0  # > 0: rank by deviation and the last `window` tokens' attention (select="importance")

    def fraction(self, layer: int) -> Optional[float]:
        """Fraction of reused tokens kept active after `layer`, or None if the selection does not change there."""
        if self.mode == "single" and layer == self.check_layer:
            return self.ratio
        if self.mode == "blend" and 0 <= layer - self.check_layer < len(self.schedule):
            return self.schedule[layer - self.check_layer]
        return None

    @property
    def full_layers(self) -> int:
        """Layers that compute every token (the check layer needs everyone's fresh KV)."""
        return self.check_layer + 1 if self.mode in ("single", "blend") else 0


@torch.inference_mode()
def blend_prefill(
    model: LlamaModel,
    ids: torch.Tensor,
    spans: Sequence[Span],
    loader: SpanLoader,
    *,
    mode: str = "blend",
    ratio: float = DEFAULT_RATIO,
    check_layer: int = 1,
    spread: float = 0.3,
    overlap: bool = True,
    trace: Optional[Trace] = None,
    prefix_len: int = 0,
    prefix_loader: Optional[Callable[[int], torch.Tensor]] = None,
    select: str = "deviation",
    window: int = 32,
    position_tokens: int = POSITION_TOKENS,
) -> BlendResult:
    """Prefill `ids` reusing stored span KV per `mode` (see module docstring). `ratio` is the fraction of reused
    tokens recomputed per selective layer, averaged over layers; 1.0 recomputes everything (= full prefill).
    `trace(layer, positions, attn)` sees each layer's attention output [n, Hq, D] of the computed tokens.
    `prefix_len` tokens at the start already have exact KV (a radix-cache hit): `prefix_loader(layer)` gives it
    ([prefix_len, 2, kv_heads, head_dim], at its real positions); they are never recomputed and `spans` tile
    [prefix_len, len(ids)). `select` ranks the tokens to recompute (`single`, `blend`): by KV deviation, or by
    deviation and the attention of the prompt's last `window` tokens, or (`position`) recomputes the first
    `position_tokens` of every reused span on every layer instead (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if position_tokens < 0:
        raise ValueError(f"position_tokens must be >= 0, got {position_tokens}")
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
    position = select == "position" and mode in ("single", "blend")
    schedule = tuple(filter_schedule(ratio, layers, check_layer, spread)) if mode == "blend" else ()
    selection = _Selection("reuse" if position else mode, ratio, check_layer, schedule,
                           window if select == "importance" else 0)

    reused_mask = torch.zeros(n, dtype=torch.bool)
    for s in spans:
        if s.stored:
            reused_mask[s.start : s.end] = True
    reused_idx = reused_mask.nonzero().squeeze(1)
    fresh_mask = ~reused_mask
    fresh_mask[:p] = False
    if position:  # the first tokens of every reused span join the fresh ones, on every layer
        chosen = fresh_mask.clone()
        for s in spans:
            if s.stored:
                chosen[s.start : min(s.end, s.start + position_tokens)] = True
        active = chosen.nonzero().squeeze(1)
    else:
        active = torch.arange(p, n) if selection.full_layers else fresh_mask.nonzero().squeeze(1)
    first_loaded = check_layer if selection.full_layers else 0  # the deviation needs the check layer's stored KV

    kv = model.empty_kv(n)
    x = model.embed(ids[active])
    computed: list[int] = []
    masks: dict = {}  # the attention masks of the current `active`, kept over layers while it stays the same
    with LayerLoader(stored_kv_fetch(model, spans, loader), layers, first=first_loaded, overlap=overlap,
                     name="blend-load", device=model.device) as stored:
        for layer in range(layers):
            if p:
                kv[layer, :p] = prefix_loader(layer)
            if layer >= first_loaded:
                kv[layer, reused_idx] = stored.get(layer)
            computed.append(active.shape[0])
            x, active = _layer(model, layer, x, active, kv[layer], reused_mask, reused_idx.shape[0],
                               selection.fraction(layer), selection.window, p, masks, trace)
    if active[-1] != n - 1:
        raise AssertionError("the last prompt token must stay active (it is never part of a stored span)")
    return BlendResult(model.logits(x[-1:])[0], kv, computed, stored.wait_s, stored.load_s, hidden=x[-1])


def _layer(model: LlamaModel, layer: int, x: torch.Tensor, active: torch.Tensor, kv: torch.Tensor,
           reused_mask: torch.Tensor, n_reused: int, fraction: Optional[float], window: int, prefix: int,
           masks: dict, trace: Optional[Trace]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer over the `active` tokens (hidden states `x`); `kv` [tokens, 2, H, D] holds this layer's stored
    and prefix KV and receives the active tokens' fresh KV. If `fraction` is set, the active reused tokens are
    re-ranked (by KV deviation; with `window` > 0 also by the attention the last `window` tokens give them) and
    only `fraction` of all reused tokens stay active (fresh tokens always do). A token that leaves has its fresh KV
    of this layer written, and nothing more: its attention and MLP here would only feed a hidden state no later
    layer reads. `masks` keeps the attention masks of `active` over layers (`positioned_attention`; emptied when
    `active` shrinks). Returns the next layer's (x, active)."""
    q, k, v = model.qkv(layer, x, active)
    if fraction is not None:
        is_reused = reused_mask[active]
        rows = is_reused.nonzero().squeeze(1)
        at = active[rows]
        score = deviation(k[rows], v[rows], kv[at, 0], kv[at, 1])
    kv[active, 0], kv[active, 1] = k, v
    if fraction is not None:
        if window:
            w = active >= kv.shape[0] - window  # the window's rows (the question: fresh, always active)
            heard = window_scores(q[w], kv[:, 0], active[w], range(q.shape[1]))
            score = shares(score, heard[at])
        chosen = rows[top_rows(score, math.ceil(fraction * n_reused)).to(rows.device)]  # (scores on the model's device)
        keep = torch.cat([(~is_reused).nonzero().squeeze(1), chosen]).sort().values  # rows of `active` kept
        if keep.shape[0] < active.shape[0]:
            q, x, active = q[keep], x[keep], active[keep]
            masks.clear()
    if active.shape[0] == kv.shape[0] - prefix:
        attn = causal_attention(q, kv[:, 0], kv[:, 1], prefix)
    else:
        # selected tokens are spread over the prompt: small blocks keep the masked-out keys few
        # (460 of 3078 tokens, CPU: 17 ms per layer in blocks of 64, 20 ms in blocks of 256)
        attn = positioned_attention(q, kv[:, 0], kv[:, 1], active, block=64, masks=masks)
    if trace is not None:
        trace(layer, active, attn)
    return model.finish_layer(layer, x, attn), active


def _prefix_extend(model: LlamaModel, ids: torch.Tensor, spans: Sequence[Span], loader: SpanLoader,
                   trace: Optional[Trace]) -> BlendResult:
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
    return BlendResult(model.logits(x[-1:])[0], kv, [n - prefix] * layers, t_load, t_load, hidden=x[-1])


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
