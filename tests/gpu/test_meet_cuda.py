"""engine/meet.py on a CUDA model (component level): the loader's host -> device copies on a
stream of their own, compute on the current stream. Skipped without CUDA (the CPU path is tests/unit/test_meet.py).

Every meet point (0, one page, the middle, all but one, all, and wherever the two meet unforced) gives the KV and
the last hidden state of a full prefill on the same device (fp32: within float rounding; the loaded pages are the
stored copy bit for bit), and the result on the GPU agrees with the CPU reference."""

from __future__ import annotations

import pytest
import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel, random_weights
from sglang_tiered.engine.meet import MemoryPages, meet_prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = LlamaConfig(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
PS, PAGES, NEW = 64, 12, 16


@pytest.fixture(scope="module")
def models():
    weights = random_weights(CFG, seed=3)  # (made on the CPU: the same weights on both devices)
    return LlamaModel(CFG, weights), LlamaModel(CFG, weights, device="cuda")


@pytest.mark.parametrize("split", [0, 1, PAGES // 2, PAGES - 1, PAGES, None])
def test_every_meet_point_on_cuda_equals_a_full_prefill(models, split):
    cpu, gpu = models
    ids = torch.randint(0, CFG.vocab, (PAGES * PS + NEW,), generator=torch.Generator().manual_seed(1))
    ref = gpu.prefill(ids)
    stored = ref.kv[:, : PAGES * PS].cpu()  # the host tier's copy
    res = meet_prefill(gpu, ids[: PAGES * PS], ids[PAGES * PS :], prefix_len=0, source=MemoryPages(stored, PS),
                       chunk=4, split=split)
    assert res.kv.is_cuda and res.computed_pages + res.loaded_pages == PAGES
    if split is not None:
        assert res.computed_pages == split
    loaded = slice(res.computed_pages * PS, PAGES * PS)
    assert torch.equal(res.kv[:, loaded].cpu(), stored[:, loaded])  # the stored copy, bit for bit
    torch.testing.assert_close(res.kv, ref.kv, rtol=1e-4, atol=1e-4)
    last = gpu.logits(res.hidden[None])[0]
    torch.testing.assert_close(last, ref.logits, rtol=1e-3, atol=1e-3)
    assert int(last.argmax()) == int(cpu.prefill(ids).logits.argmax())  # the CPU reference's greedy token
