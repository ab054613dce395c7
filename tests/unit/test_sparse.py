"""Gated sparse loading on the layer-by-layer engine (no SGLang): the exact fallback equals a full prefill, the gate
loads fewer tokens when the sampled heads agree, and what it loads is what the span served."""

from __future__ import annotations

import pytest
import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.sparse import sparse_prefill

GQA = LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=2, head_dim=16, intermediate=192, vocab=300)
TOL = 1e-4


class Span:
    """A stored span held in memory, counting what was read."""

    def __init__(self, kv: torch.Tensor) -> None:  # [layers, tokens, 2, H, D]
        self.kv, self.tokens = kv, kv.shape[1]
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
def test_forced_fail_loads_everything_and_equals_full_prefill(setup, p):
    model, ids, full = setup
    s_end = 100  # P = [0, p), S = [p, 100), C = [100, 120)
    span = Span(full.kv[:, p:s_end])
    r = sparse_prefill(model, ids[s_end:], prefix_len=p, span=span, prefix_loader=lambda layer: full.kv[layer, :p],
                       force="fail")
    assert (r.logits - full.logits).abs().max().item() <= TOL
    assert (r.kv - full.kv[:, s_end:]).abs().max().item() <= TOL
    assert span.loaded == [s_end - p] * GQA.layers and r.loaded_fraction == 1.0
    assert all(not g.passed for g in r.gates)


def test_a_passing_gate_loads_only_the_picks(setup):
    model, ids, full = setup
    span = Span(full.kv[:, :100])
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=span, ratio=0.1, force="pass")
    assert span.probed == list(range(GQA.layers))
    k = 10  # ceil(0.1 * 100) per head, 3 sampled heads
    assert all(k <= n <= 3 * k for n in span.loaded), span.loaded
    assert r.loaded_fraction == sum(span.loaded) / (GQA.layers * 100) < 0.31
    for idx, kv, layer in zip(r.kept, r.kept_kv, range(GQA.layers)):
        assert idx.tolist() == sorted(set(idx.tolist()))  # ascending, no repeats
        assert torch.equal(kv, full.kv[layer, idx])  # the loaded KV is the span's own, per token
    assert torch.isfinite(r.logits).all()


def test_the_gate_compares_jaccard_with_the_threshold(setup):
    model, ids, full = setup
    r = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.2, alpha=0.6)
    for g in r.gates:
        assert g.passed == (g.jaccard >= g.threshold)
        assert 0 < g.loaded <= 100 and (g.passed or g.loaded == 100)
    # alpha -> 0 makes the threshold 1: only identical picks pass, so (almost) every layer loads everything
    strict = sparse_prefill(model, ids[100:], prefix_len=0, span=Span(full.kv[:, :100]), ratio=0.2, alpha=1e-9)
    assert all(g.threshold > 0.99 for g in strict.gates)


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
