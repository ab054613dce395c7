"""The engine's prefill against SGLang's own Llama layer steps, bit for bit, in bf16 and fp32 (in process, no server).

SGLang 0.5.23's Llama on a CPU server (no AMX: its native ops; the attention is ours, `causal_attention`, which the
server's CPU attention runs) is written out here from SGLang's own modules (`RMSNorm`, `SiluAndMul`, `get_rope`)
in `LlamaDecoderLayer`'s order: the fused add + RMSNorm, the fused QKV and gate-up projections. Two-sided loading
(`meet_prefill`) of a span whose stored KV SGLang computed, at every meet point, with and without a device-cached
prefix: the pages computed from token ids are the stored ones bit for bit, and the new tokens' KV and the last
hidden state are those of SGLang's load of the span (the span's KV read, the new tokens computed by SGLang)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.meet import MemoryPages, meet_prefill
from sglang_tiered.kernels.extend_attention import causal_attention

pytestmark = pytest.mark.sglang

CFG = LlamaConfig(hidden=192, layers=3, heads=6, kv_heads=2, head_dim=32, intermediate=384, vocab=1000)
PAGE = 64


@pytest.fixture(scope="module")
def sglang_layers():
    """SGLang's layer modules as a CPU server's processes have them."""
    import sys

    from sglang_tiered.integration import cpu_shims

    saved_path, saved_env = list(sys.path), dict(os.environ)
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    cpu_shims.apply_early()
    cpu_shims.apply_in_process()
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope

    yield RMSNorm, SiluAndMul, get_rope
    sys.path[:] = saved_path
    os.environ.clear()
    os.environ.update(saved_env)


class SGLangLlama:
    """SGLang's `LlamaModel.forward` over an extend, from its own modules, with the weights of `model`."""

    def __init__(self, model: LlamaModel, layers) -> None:
        rms_norm, silu_and_mul, get_rope = layers
        c = model.cfg
        self.model, self.act = model, silu_and_mul()
        self.rotary = get_rope(c.head_dim, rotary_dim=c.head_dim, max_position=8192, base=c.rope_theta,
                               is_neox_style=True, dtype=model.dtype)

        def norm(weight: torch.Tensor):
            m = rms_norm(c.hidden, eps=c.rms_eps)
            m.weight.data = weight
            return m

        self.norms = [(norm(w.input_norm), norm(w.post_norm)) for w in model.layer_weights]
        self.final = norm(model.norm)
        # the engine's `Rope` over SGLang's kernel, as the server passes it (over the shape of SGLang's LlamaModel
        # that it reads: layers[i].self_attn.rotary_emb)
        from sglang_tiered.integration.kvpr import sglang_rope

        layer = SimpleNamespace(self_attn=SimpleNamespace(rotary_emb=self.rotary))
        self.rope = sglang_rope(SimpleNamespace(layers=[layer] * c.layers))

    def extend(self, ids: torch.Tensor, start: int, kv: torch.Tensor) -> torch.Tensor:
        """Prefill ids[start:] over kv[:, :start] (cached), writing their KV into kv; the last token's output."""
        m, c = self.model, self.model.cfg
        n, q_dim, kv_dim = ids.shape[0] - start, c.heads * c.head_dim, c.kv_heads * c.head_dim
        positions = torch.arange(start, ids.shape[0])
        hidden, residual = m.embed_tokens[ids[start:]], None
        for layer, w in enumerate(m.layer_weights):
            input_norm, post_norm = self.norms[layer]
            if residual is None:
                residual, h = hidden, input_norm(hidden)
            else:
                h, residual = input_norm(hidden, residual)
            q, k, v = F.linear(h, torch.cat([w.wq, w.wk, w.wv])).split([q_dim, kv_dim, kv_dim], -1)
            q, k = self.rotary(positions, q.clone(), k.clone())
            kv[layer, start : start + n, 0] = k.view(n, c.kv_heads, c.head_dim)
            kv[layer, start : start + n, 1] = v.reshape(n, c.kv_heads, c.head_dim)
            attn = causal_attention(q.view(n, c.heads, c.head_dim), kv[layer, : start + n, 0],
                                    kv[layer, : start + n, 1], start)
            hidden = F.linear(attn.reshape(n, -1), w.wo)
            h, residual = post_norm(hidden, residual)
            hidden = F.linear(self.act(F.linear(h, torch.cat([w.w_gate, w.w_up]))), w.w_down)
        return self.final(hidden, residual)[0][-1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefix,total", [(0, 1100), (192, 1500)])
def test_every_meet_point_is_sglangs_prefill_bit_for_bit(sglang_layers, dtype, prefix, total):
    model = LlamaModel.random(CFG, seed=5, dtype=dtype)
    sglang = SGLangLlama(model, sglang_layers)
    ids = torch.randint(0, CFG.vocab, (total,), generator=torch.Generator().manual_seed(total))
    span = (total - prefix - 40) // PAGE * PAGE
    with torch.inference_mode():
        stored = model.empty_kv(total)
        if prefix:
            sglang.extend(ids[:prefix], 0, stored)  # the device prefix, computed earlier
        sglang.extend(ids, prefix, stored)  # the request computed once: the span's pages were stored from this
        loaded = stored.clone()
        want = sglang.extend(ids, prefix + span, loaded)  # SGLang's load: the span read, the new tokens computed
        pages = span // PAGE
        for split in (0, 1, pages // 2, pages - 1, pages):
            res = meet_prefill(model, ids[prefix : prefix + span], ids[prefix + span :], prefix_len=prefix,
                               source=MemoryPages(stored[:, prefix : prefix + span].clone(), PAGE),
                               prefix_loader=(lambda layer: stored[layer, :prefix]) if prefix else None,
                               split=split, chunk=4, rope=sglang.rope)
            assert torch.equal(res.kv[:, : split * PAGE], stored[:, prefix : prefix + split * PAGE]), split
            assert torch.equal(res.kv[:, span:], loaded[:, prefix + span :]), split
            assert torch.equal(model.final_norm(res.hidden[None])[0], want), split


def test_the_norm_rounds_as_sglangs_not_as_hugging_faces(sglang_layers):
    """Why the engine rounds as it does: SGLang scales by the norm's weight in fp32 and rounds once, Hugging Face's
    Llama rounds before the weight; in bf16 the two differ, and the engine's is SGLang's."""
    model = LlamaModel.random(CFG, seed=5, dtype=torch.bfloat16)
    sglang = SGLangLlama(model, sglang_layers)
    x = torch.randn(300, CFG.hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ours = model.attention_input(0, x)
    assert torch.equal(ours, sglang.norms[0][0](x))
    xf = x.float()
    hugging_face = model.layer_weights[0].input_norm * (
        xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + CFG.rms_eps)).to(torch.bfloat16)
    assert not torch.equal(ours, hugging_face)
