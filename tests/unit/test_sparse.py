"""Gated sparse loading on the layer-by-layer engine (no SGLang): the exact fallback equals a full prefill, the gate
loads fewer tokens when the sampled heads agree, and what it loads is what the span served."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.sparse import sparse_prefill

GQA = LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=2, head_dim=16, intermediate=192, vocab=300)
TOL = 1e-4


class Span:
    """A stored span held in memory, counting what was read."""

    def __init__(self, kv: torch.Tensor, units=None) -> None:  # [layers, tokens, 2, H, D]
        self.kv, self.tokens, self.units = kv, kv.shape[1], units
        self.probed: list[int] = []
        self.loaded: list[int] = []

    def probe(self, layer, kv_heads):
        self.probed.append(layer)
        return self.kv[layer, :, 0, kv_heads]

    def load(self, layer, idx):
        self.loaded.append(int(idx.shape[0]))
        return self.kv[layer, idx]


@pytest.fixture(scope="module")
def setup():
    model = LlamaModel.random(GQA, seed=5)
    ids = torch.randint(0, GQA.vocab, (120,), generator=torch.Generator().manual_seed(1))
    return model, ids, model.prefill(ids)


@pytest.mark.parametrize("p", [0, 16])
@pytest.mark.parametrize("overlap", [True, False])
def test_forced_fail_loads_everything_and_equals_full_prefill(setup, p, overlap):
    model, ids, full = setup
    s_end = 100  # P = [0, p), S = [p, 100), C = [100, 120)
    span = Span(full.kv[:, p:s_end])
    r = sparse_prefill(model, ids[s_end:], prefix_len=p, span=span, prefix_loader=lambda layer: full.kv[layer, :p],
                       force="fail", overlap=overlap)
    assert (r.logits - full.logits).abs().max().item() <= TOL
    assert (r.kv - full.kv[:, s_end:]).abs().max().item() <= TOL
    assert span.loaded == [s_end - p] * GQA.layers and r.loaded_fraction == 1.0
    assert all(not g.passed for g in r.gates)
    assert span.probed == []  # the exact path reads no probe


def test_a_passing_gate_loads_only_the_picks(setup):
    model, ids, full = setup
    span = Span(full.kv[:, :100])
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=span, ratio=0.1, force="pass")
    assert span.probed == list(range(GQA.layers))
    assert span.loaded == [10] * GQA.layers  # k = ceil(0.1 * 100) single tokens
    assert r.loaded_fraction == 0.1
    for idx, kv, layer in zip(r.kept, r.kept_kv, range(GQA.layers)):
        assert idx.tolist() == sorted(set(idx.tolist()))  # ascending, no repeats
        assert torch.equal(kv, full.kv[layer, idx])  # the loaded KV is the span's own, per token
    assert torch.isfinite(r.logits).all()


def test_the_picks_are_the_top_k_of_the_attention_of_every_head_reading_a_probed_kv_head(setup):
    from sglang_tiered.kernels.importance import head_scores

    model, ids, full = setup
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.1, force="pass",
                       heads=3, window=8)
    # GQA 6 query / 2 KV heads: the 3 sampled heads read both KV heads, so all 6 query heads are scored
    pos = torch.arange(100, 120)
    q, k, _ = model.qkv(0, model.embed(ids[100:]), pos)
    keys = torch.cat([full.kv[0, :100, 0], k])
    mass = head_scores(q[-8:], keys, pos[-8:], list(range(GQA.heads)))[:, :100].sum(0)
    assert r.kept[0].tolist() == sorted(torch.topk(mass, 10).indices.tolist())
    only_sampled = head_scores(q[-8:], keys, pos[-8:], [0, 1, 3])[:, :100].sum(0)
    assert set(torch.topk(only_sampled, 10).indices.tolist()) != set(r.kept[0].tolist())  # the group mates count


def test_a_span_in_units_is_loaded_by_whole_units_up_to_the_budget(setup):
    model, ids, full = setup
    units = torch.arange(100) // 10  # ten 10-token units
    span = Span(full.kv[:, :100], units)
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=span, ratio=0.2, force="pass")
    for idx in r.kept:
        chosen = set((idx // 10).tolist())
        assert len(chosen) == 2 and idx.tolist() == [t for t in range(100) if t // 10 in chosen]  # 20 tokens


def test_the_gate_compares_jaccard_with_the_threshold(setup):
    model, ids, full = setup
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.2, alpha=0.6)
    for g in r.gates:
        assert g.passed == (g.jaccard >= g.threshold)
        assert 0 < g.loaded <= 100 and (g.passed or g.loaded == 100)
    # alpha -> 0 makes the threshold 1: only identical picks pass, so (almost) every layer loads everything
    strict = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.2, alpha=1e-9)
    assert all(g.threshold > 0.99 for g in strict.gates)


def test_the_mass_gate_compares_the_dropped_attention_with_its_bound(setup):
    """drop = the window's attention (every scored head, over [P, S, C]) on the tokens of S the picks leave out,
    recomputed here from the scores; the gate passes iff drop <= max_drop, and its picks are the Jaccard gate's."""
    from sglang_tiered.kernels.importance import head_scores

    model, ids, full = setup
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.1, gate="mass",
                       max_drop=1.0, window=8)
    assert all(g.passed and g.loaded == 10 for g in r.gates)  # nothing exceeds a bound of all the attention
    pos = torch.arange(100, 120)
    q, k, _ = model.qkv(0, model.embed(ids[100:]), pos)
    scores = head_scores(q[-8:], torch.cat([full.kv[0, :100, 0], k]), pos[-8:], list(range(GQA.heads)))
    left_out = torch.ones(100, dtype=torch.bool)
    left_out[r.kept[0]] = False
    assert r.gates[0].drop == pytest.approx(float(scores[:, :100][:, left_out].sum() / scores.sum()), rel=1e-5)
    jaccard = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.1,
                             force="pass", window=8)
    assert all(torch.equal(a, b) for a, b in zip(r.kept, jaccard.kept))
    bound = sorted(g.drop for g in r.gates)[1]
    split = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.1, gate="mass",
                           max_drop=bound, window=8)
    # (a layer's drop depends on what the layers before it loaded, so compare each run with its own)
    assert split.gates[0].drop == r.gates[0].drop
    assert all(g.passed == (g.drop <= bound) and g.loaded == (10 if g.passed else 100) for g in split.gates)
    assert 0 < sum(g.passed for g in split.gates) < GQA.layers
    exact = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.1, gate="mass",
                           max_drop=0.0)
    assert exact.loaded_fraction == 1.0 and (exact.logits - full.logits).abs().max().item() <= TOL


def test_the_mass_gate_over_a_device_prefix(setup):
    """With an exact prefix P in memory the window's attention is shared over [P, S, C]: bound 0 still loads all of
    S (exact), bound 1 only the picks, and each share lies in [0, 1)."""
    model, ids, full = setup
    kw = dict(prefix_len=16, prefix_loader=lambda layer: full.kv[layer, :16], ratio=0.1, gate="mass")
    exact = sparse_prefill(model, ids[100:], span=Span(full.kv[:, 16:100]), max_drop=0.0, **kw)
    assert exact.loaded_fraction == 1.0 and (exact.logits - full.logits).abs().max().item() <= TOL
    loose = sparse_prefill(model, ids[100:], span=Span(full.kv[:, 16:100]), max_drop=1.0, **kw)
    assert all(g.passed and g.loaded == 9 and 0.0 <= g.drop < 1.0 for g in loose.gates)  # k = ceil(0.1 * 84)


def test_skipped_layers_load_everything_unprobed_and_the_rest_is_unchanged(setup):
    """A skipped layer does what a failed gate does (all of S) without reading the probe: skipping every layer is
    the exact path; skipping layer 1 leaves layer 0's gate and picks as they were."""
    model, ids, full = setup
    every = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.2,
                           skip=range(GQA.layers))
    assert (every.logits - full.logits).abs().max().item() <= TOL and every.loaded_fraction == 1.0
    free = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.2, force="pass")
    span = Span(full.kv[:, :100])
    one = sparse_prefill(model, ids[100:], prefix_len=0, span=span, ratio=0.2, force="pass", skip={1})
    assert span.probed == [0, 2, 3] and sorted(span.loaded) == [20, 20, 20, 100]  # (the loader runs ahead)
    assert one.gates[0] == free.gates[0] and torch.equal(one.kept[0], free.kept[0])
    assert math.isnan(one.gates[1].jaccard) and not one.gates[1].passed and one.gates[1].loaded == 100


def test_ratio_one_loads_everything_exactly(setup):
    model, ids, full = setup
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=1.0, force="pass")
    assert (r.logits - full.logits).abs().max().item() <= TOL


def test_bad_arguments(setup):
    model, ids, full = setup
    with pytest.raises(ValueError, match="prefix_loader"):
        sparse_prefill(model, ids[100:], prefix_len=4, span=Span(full.kv[:, 4:100]))
    with pytest.raises(ValueError, match="force"):
        sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), force="maybe")
    with pytest.raises(ValueError, match="gate"):
        sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), gate="vote")


# ---------------------------------------------------------------------------------------------- from a repacked group
def stored_group(tmp_path, kv: torch.Tensor, page_size: int = 16):
    """Write the KV [layers, T, 2, H, D] (fp32) as layer_first pages and repack them; (tier, group meta)."""
    from sglang_tiered.storage.namespace import Namespace
    from sglang_tiered.storage.ssd_tier import SSDTier

    layers, tokens, _, heads, dim = kv.shape
    ns = Namespace(model="m", dtype="torch.float32", page_size=page_size, layout="layer_first", layer_num=layers,
                   kv_heads=heads, head_dim=dim)
    tier = SSDTier(tmp_path, ns, 1 << 26)
    keys = [f"{i:064x}" for i in range(tokens // page_size)]
    for j, key in enumerate(keys):
        rows = kv[:, j * page_size : (j + 1) * page_size]
        segs = [memoryview(rows[layer, :, kv_i].contiguous().numpy().tobytes()) for layer in range(layers)
                for kv_i in (0, 1)]
        assert tier.write_pages([(key, segs)]) == [True]
    assert tier.groups.repack(keys, probe_heads=list(range(heads)))
    return tier, tier.group_of(keys[0])


def test_a_group_span_serves_the_exact_kv_and_reads_only_the_chunks_it_needs(tmp_path, setup):
    from sglang_tiered.engine.group_span import GroupSpan

    model, ids, full = setup
    tier, meta = stored_group(tmp_path, full.kv[:, :96])
    span = GroupSpan(tier, meta, first=0, pages=6)
    exact = sparse_prefill(model, ids[96:], prefix_len=0, span=span, force="fail")
    assert (exact.logits - full.logits).abs().max().item() <= TOL
    assert torch.equal(span.load(2, torch.tensor([0, 5, 95])), full.kv[2, [0, 5, 95]])
    before = span.bytes_read
    span.load(1, torch.tensor([94, 95]))  # both in the last 16-token chunk: one chunk read
    assert span.bytes_read - before == 2 * 16 * GQA.kv_heads * GQA.head_dim * 4
    before = span.bytes_read
    span.load(1, torch.tensor([15, 16]))  # on both sides of a chunk boundary: two chunks
    assert span.bytes_read - before == 2 * 2 * 16 * GQA.kv_heads * GQA.head_dim * 4
    probe = span.probe(3, [1])
    assert probe.shape == (96, 1, GQA.head_dim)
    exact_keys = full.kv[3, :96, 0, 1:2]
    # 4 bits after an orthonormal rotation: each rotated value off by at most half a step (max |rotated key| / 7,
    # at most |key| / 7), and rotating back keeps the error's length
    err = (probe - exact_keys).norm(dim=-1)
    assert meta.probe_bits == 4 and (err <= exact_keys.norm(dim=-1) * GQA.head_dim ** 0.5 / 14 * 1.01).all()
    # a later span of the group: pages 2..5 (tokens 32..95), after an exact prefix of 32 tokens
    tail = GroupSpan(tier, meta, first=2, pages=4)
    r = sparse_prefill(model, ids[96:], prefix_len=32, span=tail, prefix_loader=lambda layer: full.kv[layer, :32],
                       force="fail")
    assert (r.logits - full.logits).abs().max().item() <= TOL
