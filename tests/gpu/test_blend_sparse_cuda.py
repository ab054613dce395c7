"""Blend (CacheBlend, EPIC's position selection) and gated sparse loading on a CUDA model, component level: where
exact, the device result equals a full prefill on the device; where approximate, it matches the CPU reference of
the same selection, and the approximation itself is measured against the full prefill. Skipped without CUDA
(`TIERED_GPU_TESTS_DEVICE=cpu` runs the same checks on the CPU, to rehearse them where no GPU is lent).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from sglang_tiered.engine.blend import Span, blend_prefill
from sglang_tiered.engine.llama import LlamaConfig, LlamaModel, random_weights
from sglang_tiered.engine.sparse import sparse_prefill

DEVICE = os.environ.get("TIERED_GPU_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = LlamaConfig(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
CHUNKS, CHUNK, QUESTION = 4, 96, 24


@pytest.fixture(scope="module")
def models():
    weights = random_weights(CFG, seed=3)  # (made on the CPU: the same weights on both devices)
    return LlamaModel(CFG, weights), LlamaModel(CFG, weights, device=DEVICE)


def marked_prompt() -> tuple[torch.Tensor, list[Span]]:
    ids = torch.randint(0, CFG.vocab, (CHUNKS * CHUNK + QUESTION,), generator=torch.Generator().manual_seed(2))
    spans = [Span(i * CHUNK, (i + 1) * CHUNK, True) for i in range(CHUNKS)]
    return ids, spans + [Span(CHUNKS * CHUNK, CHUNKS * CHUNK + QUESTION, False)]


def blend(model: LlamaModel, ids: torch.Tensor, spans: list[Span], **kw):
    # stored chunk KV in host memory, as a server reads it from its store
    stored = {i: model.prefill(ids[s.start : s.end]).kv.cpu() for i, s in enumerate(spans) if s.stored}
    return blend_prefill(model, ids, spans, lambda layer, i: stored[i][layer], **kw)


@pytest.mark.parametrize("mode", ["blend", "single"])
def test_blend_recomputing_everything_equals_a_full_prefill_on_the_device(models, mode):
    _, dev = models
    ids, spans = marked_prompt()
    full, res = dev.prefill(ids), blend(dev, ids, spans, mode=mode, ratio=1.0)
    torch.testing.assert_close(res.kv, full.kv, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(res.logits, full.logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("select", ["deviation", "position"])
def test_blend_on_the_device_matches_the_cpu_reference_and_its_approximation_is_measured(models, select):
    cpu, dev = models
    ids, spans = marked_prompt()
    ref, got = blend(cpu, ids, spans, ratio=0.15, select=select), blend(dev, ids, spans, ratio=0.15, select=select)
    assert got.computed == ref.computed  # the same tokens recomputed on every layer
    torch.testing.assert_close(got.logits.cpu(), ref.logits, rtol=2e-3, atol=2e-3)
    full = cpu.prefill(ids).logits
    gap = (ref.logits - full).abs().max().item()  # the approximation itself (random weights: reported, not judged)
    print(f"blend {select} 0.15: max |logit - full prefill's| {gap:.3g}, recomputed {ref.recompute_fraction:.2f}")


def test_sparse_loading_exact_on_the_device_and_gated_as_on_the_cpu(models):
    cpu, dev = models
    ids = torch.randint(0, CFG.vocab, (640,), generator=torch.Generator().manual_seed(4))
    full_dev, full_cpu = dev.prefill(ids), cpu.prefill(ids)

    class Memory:
        def __init__(self, kv: torch.Tensor) -> None:
            self.kv, self.tokens, self.units = kv, kv.shape[1], None

        def probe(self, layer, kv_heads):
            return self.kv[layer, :, 0, kv_heads]

        def load(self, layer, idx):
            return self.kv[layer, idx.to(self.kv.device)]

    stored = Memory(full_dev.kv[:, :600].cpu())  # in host memory, as a server reads a group from its SSD tier
    exact = sparse_prefill(dev, ids[600:], prefix_len=0, span=stored, force="fail")
    torch.testing.assert_close(exact.logits, full_dev.logits, rtol=1e-3, atol=1e-3)
    got = sparse_prefill(dev, ids[600:], prefix_len=0, span=stored, ratio=0.2, force="pass")
    ref = sparse_prefill(cpu, ids[600:], prefix_len=0, span=Memory(full_cpu.kv[:, :600]), ratio=0.2, force="pass")
    assert [k.tolist() for k in got.kept[:2]] == [k.tolist() for k in ref.kept[:2]]  # the same picks where it starts
    assert got.loaded_fraction < 0.5
    torch.testing.assert_close(got.logits.cpu(), ref.logits, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("shape", ["7b-mha", "8b-gqa"] if DEVICE == "cuda" else ["small-mha"])
def test_served_shapes_exact_where_exact_and_the_approximation_measured(shape):
    """The engine at the shapes the GPU harness serves (fp32, on the device only; `small-mha` on the CPU): blend
    recomputing everything and the sparse path loading everything equal a full prefill; blend at 15 % (both
    selections) and a gated-style load of 20 % are measured against it. Stored KV lives in host memory."""
    from sglang_tiered.models import _shapes

    cfg = _shapes()[shape]
    model = LlamaModel(cfg, random_weights(cfg, seed=5, device=DEVICE))
    ids = torch.randint(0, cfg.vocab, (4 * 128 + 32,), generator=torch.Generator().manual_seed(6))
    spans = [Span(i * 128, (i + 1) * 128, True) for i in range(4)] + [Span(512, 544, False)]
    full = model.prefill(ids)
    exact = blend(model, ids, spans, mode="blend", ratio=1.0)
    torch.testing.assert_close(exact.logits, full.logits, rtol=1e-3, atol=1e-3)
    host = full.kv[:, :512].cpu()

    class Memory:
        tokens, units = 512, None

        def probe(self, layer, kv_heads):
            return host[layer, :, 0, kv_heads]

        def load(self, layer, idx):
            return host[layer, idx.cpu()]

    loaded = sparse_prefill(model, ids[512:], prefix_len=0, span=Memory(), force="fail")
    torch.testing.assert_close(loaded.logits, full.logits, rtol=1e-3, atol=1e-3)
    gaps = {}
    for select in ("deviation", "position"):
        got = blend(model, ids, spans, ratio=0.15, select=select)
        gaps[f"blend {select}"] = (got.logits - full.logits).abs().max().item()
    gated = sparse_prefill(model, ids[512:], prefix_len=0, span=Memory(), ratio=0.2, force="pass")
    gaps["sparse 0.2"] = (gated.logits - full.logits).abs().max().item()
    assert all(math.isfinite(g) for g in gaps.values())  # (random weights: the gaps are reported, not judged)
    print(f"{shape}: max |logit - full prefill's| " + ", ".join(f"{k} {v:.3g}" for k, v in gaps.items()))
