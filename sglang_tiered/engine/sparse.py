"""Gated sparse loading of a stored prefix (IMPRESS), on the layer-by-layer engine.

A prompt = an exact prefix P (its KV already in memory), a stored span S (its KV on a slow tier) and new tokens C.
Per layer, instead of loading all of S's KV:

  1. the new tokens' Q, K, V are computed (true positions);
  2. the *probe* is read -- the keys of S in the KV heads the sampled query heads read -- and the window (C's last
     `window` queries) is scored against [P, S, C] in every query head that reads a probed KV head (the sampled
     heads and their GQA group mates: same keys, no extra bytes);
  3. each sampled head picks its top k = ceil(ratio * |S|) tokens of S and a selection of about k tokens is made
     (below); the gate (`policy.importance`) decides whether only the selection is loaded (its K and V, all heads)
     or all of S (exact for that layer). `gate="jaccard"` (IMPRESS): the sampled heads' top-k sets' mean pairwise
     Jaccard J reaches t = j^alpha. `gate="mass"`: the share of the window's attention (every scored head) that
     falls on the tokens of S left out is at most `max_drop` -- the attention the sparse layer takes away,
     estimated from the probe. The selection is by I/O unit (a 16-token chunk of a repacked group;
     single tokens for a span without units): the units with the most attention -- summed over every scored head
     and the window -- best first, until they hold k tokens (ContiguousKV's chunk-as-I/O-unit selection). Scoring
     the selection with all probed heads rather than the union of the three sampled heads' picks raised, on
     SmolLM2 at ratio 0.2 and about the same loaded fraction, the documents whose 8 greedy tokens equal a full
     load's from 0.17 to 0.67 (benchmarks/importance.py part quality, before and after the change);
  4. C attends to [P, the loaded S tokens, C] (keys carry RoPE from their real positions, so a gathered subset is
     attended at its original positions) and the layer finishes.

The probe of layer l + 1 is fetched by the engine's `LayerLoader` while layer l computes. `force="fail"` loads all
of S on every layer without probing or scoring (the loader fetches S's KV one layer ahead instead): the result
equals a full prefill over [P, S, C] (the exact path the gate falls back to). `skip` does the same for some layers
only (those whose gate keeps failing, `policy.importance.GateHistory`): no probe, all of S, jaccard nan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from sglang_tiered.engine.layer_loader import LayerLoader
from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.kernels.extend_attention import causal_attention
from sglang_tiered.kernels.importance import head_scores, probed_kv_heads, sampled_heads, topk_sets
from sglang_tiered.policy.importance import GATES, gate_threshold, mean_pairwise_jaccard


class StoredSpan(Protocol):
    """The stored KV of the span S (tokens at positions start .. start + tokens - 1), per layer. `units`, if not
    None, maps each token of S to the I/O unit that holds it ([tokens] ints, e.g. a 16-token chunk of a repacked
    group): a load then takes whole units, and every token of a loaded unit is used."""

    tokens: int
    units: Optional[torch.Tensor]

    def probe(self, layer: int, kv_heads: Sequence[int]) -> torch.Tensor:
        """Keys of those KV heads for every token of S: [tokens, len(kv_heads), head_dim] (post-RoPE)."""
        ...

    def load(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """K and V of the tokens `idx` of S (ascending): [len(idx), 2, kv_heads, head_dim]."""
        ...


@dataclass(frozen=True)
class Gate:
    layer: int
    jaccard: float  # nan where not measured (force="fail", skipped layers)
    threshold: float  # the Jaccard's threshold t
    passed: bool
    loaded: int  # tokens of S loaded on this layer
    drop: float  # share of the window's attention on the tokens of S the selection leaves out; nan where unmeasured


@dataclass
class SparseResult:
    logits: torch.Tensor  # [vocab] fp32, the last token
    hidden: torch.Tensor  # [hidden] residual stream of the last token after the last layer
    kv: torch.Tensor  # [layers, |C|, 2, kv_heads, head_dim]: the new tokens' KV
    kept: list[torch.Tensor] = field(default_factory=list)  # per layer: indices into S that were loaded
    kept_kv: list[torch.Tensor] = field(default_factory=list)  # per layer: their KV [len, 2, kv_heads, head_dim]
    gates: list[Gate] = field(default_factory=list)
    span_tokens: int = 0
    load_wait_s: float = 0.0  # time the compute waited for the layer loader (the probe; all of S with force="fail")

    @property
    def loaded_fraction(self) -> float:
        """Loaded token-layers of S / all token-layers of S."""
        return sum(g.loaded for g in self.gates) / max(1, len(self.gates) * self.span_tokens)


def _selection(span: StoredSpan, mass: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens of S to load once the gate passed (ascending): whole units by attention `mass` [|S|], best first, until
    they hold at least k tokens (see the module docstring)."""
    units = getattr(span, "units", None)
    mass = mass.cpu()  # (the picks index the stored span, which is read on the host)
    if units is None:
        return torch.topk(mass, k).indices.sort().values
    unit_mass = torch.zeros(int(units.max()) + 1).index_add_(0, units, mass)
    size = torch.bincount(units, minlength=unit_mass.shape[0])
    chosen, covered = [], 0
    for u in torch.argsort(unit_mass, descending=True).tolist():
        if covered >= k:
            break
        chosen.append(u)
        covered += int(size[u])
    return torch.isin(units, torch.tensor(chosen)).nonzero().squeeze(1)


@torch.inference_mode()
def sparse_prefill(model: LlamaModel, ids: torch.Tensor, *, prefix_len: int, span: StoredSpan,
                   prefix_loader: Optional[Callable[[int], torch.Tensor]] = None, heads: int = 3,
                   window: int = 32, ratio: float = 0.2, alpha: float = 0.6, gate: str = "jaccard",
                   max_drop: float = 0.15, force: Optional[str] = None, skip: Collection[int] = (),
                   overlap: bool = True) -> SparseResult:
    """Prefill the new tokens `ids` (positions prefix_len + span.tokens ..) over the exact prefix
    (`prefix_loader(layer)` -> [prefix_len, 2, kv_heads, head_dim]) and the stored span, loading the span sparsely
    (see the module docstring).
    `gate`: "jaccard" (t = j^alpha) or "mass" (dropped attention share <= max_drop), see the module docstring.
    `force`: None (the gate decides), "fail" (load everything: exact), "pass" (always load only the picks).
    `skip`: layers that load everything without a probe (as if their gate failed, unmeasured)."""
    c = model.cfg
    n, p, s = ids.shape[0], prefix_len, span.tokens
    if n < 1 or s < 1:
        raise ValueError(f"need new tokens and a stored span, got {n} and {s}")
    if p and prefix_loader is None:
        raise ValueError("prefix_len > 0 needs a prefix_loader")
    if force not in (None, "fail", "pass"):
        raise ValueError(f"force must be None, 'fail' or 'pass', got {force!r}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    group = c.heads // c.kv_heads
    q_heads = sampled_heads(c.heads, c.kv_heads, min(heads, c.heads))
    probe_heads = probed_kv_heads(c.heads, c.kv_heads, min(heads, c.heads))
    scored = [h for h in range(c.heads) if h // group in probe_heads]  # the sampled heads and their group mates
    rows = [scored.index(h) for h in q_heads]
    cols = [probe_heads.index(h // group) for h in scored]
    k_top = min(s, max(1, math.ceil(ratio * s - 1e-9)))
    threshold = gate_threshold(k_top, s, alpha)

    positions = torch.arange(p + s, p + s + n)
    w = min(window, n)
    x = model.embed(ids)
    new_kv = model.empty_kv(n)
    kept, kept_kv, gates = [], [], []
    everything = torch.arange(s)
    exact = force == "fail"  # no probe, no scoring: the loader fetches all of S one layer ahead

    def whole(layer: int) -> bool:  # this layer loads all of S, unprobed
        return exact or layer in skip

    def fetch(layer: int) -> torch.Tensor:  # (on the model's device: the span may be read into host memory)
        got = span.load(layer, everything) if whole(layer) else span.probe(layer, probe_heads)
        return got.to(model.device, non_blocking=True)

    with LayerLoader(fetch, c.layers, overlap=overlap, name="sparse-load" if exact else "sparse-probe",
                     device=model.device) as loads:
        for layer in range(c.layers):
            q, k, v = model.qkv(layer, x, positions)
            prefix = prefix_loader(layer) if p else model.empty_kv(0)[0]
            if whole(layer):
                jac = drop = math.nan
                passed, idx, loaded = False, everything, loads.get(layer).to(model.dtype)
            else:
                probe = loads.get(layer)  # [s, len(probe_heads), D]
                keys = torch.cat([prefix[:, 0, probe_heads], probe, k[:, probe_heads]])
                scores = head_scores(q[-w:], keys, positions[-w:], scored, kv_cols=cols)[:, p : p + s]
                jac = mean_pairwise_jaccard(topk_sets(scores[rows], k_top))
                mass = scores.sum(0)  # every row of head_scores hands out w units over [P, S, C]
                picks = _selection(span, mass, k_top)
                drop = float(mass.sum() - mass[picks].sum()) / (len(scored) * w)
                agree = jac >= threshold if gate == "jaccard" else drop <= max_drop
                passed = force == "pass" or (force is None and agree)
                idx = picks if passed else everything
                loaded = span.load(layer, idx).to(device=model.device, dtype=model.dtype)
            kk = torch.cat([prefix[:, 0], loaded[:, 0], k])
            vv = torch.cat([prefix[:, 1], loaded[:, 1], v])
            x = model.finish_layer(layer, x, causal_attention(q, kk, vv, p + idx.shape[0]))
            new_kv[layer, :, 0], new_kv[layer, :, 1] = k, v
            kept.append(idx)
            kept_kv.append(loaded)
            gates.append(Gate(layer, jac, threshold, passed, int(idx.shape[0]), drop))
    return SparseResult(model.logits(x[-1:])[0], x[-1], new_kv, kept, kept_kv, gates, s, loads.wait_s)
