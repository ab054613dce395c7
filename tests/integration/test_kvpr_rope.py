"""Compute-or-load's recomputed keys against SGLang's own computation (in process, no server): with the served
model's RoPE kernel (`integration.kvpr.sglang_rope`), K = X W_K recomputed from a layer's bf16 input is the key
SGLang computes from the same input bit for bit; the engine's own rotation is not (one bf16 ulp apart)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel

pytestmark = pytest.mark.sglang


def test_recomputed_keys_are_sglangs_bit_for_bit(monkeypatch):
    import sys

    from sglang_tiered.integration import cpu_shims

    monkeypatch.setattr(sys, "path", list(sys.path))  # what apply_early changes is undone after the test
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    cpu_shims.apply_early()  # as in a CPU server's processes
    cpu_shims.apply_in_process()
    from sglang.srt.layers.rotary_embedding import get_rope

    from sglang_tiered.integration.kvpr import sglang_rope

    cfg = LlamaConfig(hidden=256, layers=1, heads=4, kv_heads=4, head_dim=64, intermediate=64, vocab=100)
    model = LlamaModel.random(cfg, seed=3, dtype=torch.bfloat16)
    w = model.layer_weights[0]
    rotary = get_rope(64, rotary_dim=64, max_position=8192, base=cfg.rope_theta, is_neox_style=True,
                      dtype=torch.bfloat16)

    class Attn:  # the shape of SGLang's LlamaModel that sglang_rope reads: layers[i].self_attn.rotary_emb
        rotary_emb = rotary

    class Layer:
        self_attn = Attn()

    class Module:
        layers = [Layer()]

    x = torch.randn(700, cfg.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    pos = torch.arange(300, 1000)
    qkv = F.linear(x, torch.cat([w.wq, w.wk, w.wv]))  # SGLang's fused projection over the whole prompt
    q, k = qkv[:, :256], qkv[:, 256:512]
    _, stored = rotary(pos, q.clone(), k.clone())
    stored = stored.view(700, 4, 64)

    ours, v = model.kv_from_input(0, x[200:], pos[200:], sglang_rope(Module()))  # the last 500 tokens recomputed
    assert torch.equal(ours, stored[200:]) and torch.equal(v.reshape(500, -1), qkv[200:, 512:])
    engine_only, _ = model.kv_from_input(0, x[200:], pos[200:])
    assert not torch.equal(engine_only, stored[200:])  # why the server passes its own kernel
