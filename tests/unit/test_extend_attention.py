"""Prefix-aware attention against the naive full-sequence computation (no SGLang)."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_tiered.kernels.extend_attention import (
    causal_attention,
    chunk_attention,
    extend_attention,
    part_attention,
    positioned_attention,
    reference_attention,
)
from tests.rounding import attention_rows_alone


def paged_batch(rng: random.Random, hq: int, hkv: int, d: int, reqs: list[tuple[int, int]], dtype):
    """A random slot pool with requests scattered over non-contiguous slots, as SGLang's allocator leaves them."""
    total = sum(p + n for p, n in reqs)
    slots = 1 + total + 37
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, hkv, d, generator=g).to(dtype)
    free = list(range(1, slots))
    rng.shuffle(free)
    req_to_token = torch.zeros(len(reqs) + 3, max(p + n for p, n in reqs) + 5, dtype=torch.int64)
    rows = rng.sample(range(len(reqs) + 3), len(reqs))
    for row, (p, n) in zip(rows, reqs):
        req_to_token[row, : p + n] = torch.tensor([free.pop() for _ in range(p + n)])
    q = torch.randn(sum(n for _, n in reqs), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, req_to_token, rows


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 8), (8, 1), (4, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_matches_full_sequence_reference(dtype, hq, hkv, seed):
    rng = random.Random(hash((hq, hkv, seed)) & 0xFFFF)
    n_req = rng.randint(1, 4)
    reqs = []
    for _ in range(n_req):
        prefix = rng.choice([0, 1, rng.randint(2, 90)])
        new = rng.choice([1, 2, rng.randint(3, 70)])
        reqs.append((prefix, new))
    d = rng.choice([16, 64])
    q, kc, vc, r2t, rows = paged_batch(rng, hq, hkv, d, reqs, dtype)
    prefixes, news = [p for p, _ in reqs], [n for _, n in reqs]
    got = extend_attention(q, kc, vc, r2t, torch.tensor(rows), torch.tensor(prefixes), torch.tensor(news))
    want = reference_attention(q, kc, vc, r2t, rows, prefixes, news)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("prefix", [0, 1, 63, 64, 200])
def test_every_prefix_length_in_one_batch_decode_included(prefix):
    rng = random.Random(prefix)
    reqs = [(prefix, 5), (prefix + 3, 1), (0, 7), (prefix, 1)]  # extends, a decode step, a fresh prompt
    q, kc, vc, r2t, rows = paged_batch(rng, 9, 3, 64, reqs, torch.float32)
    args = (q, kc, vc, r2t, rows, [p for p, _ in reqs], [n for _, n in reqs])
    torch.testing.assert_close(extend_attention(*args, scale=0.1), reference_attention(*args, scale=0.1),
                               atol=2e-5, rtol=2e-5)


def test_prefix_actually_matters():
    """Changing a prefix key changes the output: the prefix is attended, not skipped."""
    rng = random.Random(5)
    q, kc, vc, r2t, rows = paged_batch(rng, 4, 2, 16, [(20, 4)], torch.float32)
    before = extend_attention(q, kc, vc, r2t, rows, [20], [4]).clone()
    vc[r2t[rows[0], 3]] += 10.0
    assert not torch.allclose(before, extend_attention(q, kc, vc, r2t, rows, [20], [4]))


def test_bad_shapes_are_rejected():
    q = torch.zeros(3, 9, 8)
    kv = torch.zeros(10, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        extend_attention(q, kv, kv, torch.zeros(1, 10, dtype=torch.int64), [0], [0], [3])
    kv = torch.zeros(10, 3, 8)
    with pytest.raises(ValueError, match="sum"):
        extend_attention(q, kv, kv, torch.zeros(1, 10, dtype=torch.int64), [0], [0], [2])


@pytest.mark.parametrize("block", [1, 7, 256])
def test_positioned_attention_blocks_and_gaps_match_a_dense_masked_softmax(block):
    """Queries at scattered positions (what blending computes) and long offset runs (several blocks)."""
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(700, 2, 16, generator=g), torch.randn(700, 2, 16, generator=g)
    for q_pos in (torch.arange(300, 700), torch.randperm(700, generator=g)[:150].sort().values):
        q = torch.randn(q_pos.shape[0], 6, 16, generator=g)
        got = positioned_attention(q, k, v, q_pos, block=block)
        kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kr) / 4.0
        scores = scores.masked_fill(torch.arange(700)[None, None, :] > q_pos[None, :, None], float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr)
        assert (got - want).abs().max().item() <= 1e-5
    q = torch.randn(400, 6, 16, generator=g)
    assert (causal_attention(q, k, v, 300) - positioned_attention(q, k, v, torch.arange(300, 700))).abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_positioned_attention_with_kept_masks_is_bit_for_bit_the_same(dtype):
    """Masks built at the first call and kept for the next ones (other queries and keys, the same positions)."""
    g = torch.Generator().manual_seed(9)
    q_pos = torch.randperm(700, generator=g)[:150].sort().values
    masks: dict = {}
    for _ in range(2):
        q = torch.randn(150, 6, 16, generator=g).to(dtype)
        k, v = (torch.randn(700, 2, 16, generator=g).to(dtype) for _ in range(2))
        got = positioned_attention(q, k, v, q_pos, block=64, masks=masks)
        assert torch.equal(got, positioned_attention(q, k, v, q_pos, block=64))
    assert len(masks) == 3


@pytest.mark.parametrize("hq,hkv", [(8, 8), (9, 3)])
@pytest.mark.parametrize("n,total", [(5, 5), (7, 40), (64, 300)])
def test_chunk_attention_is_causal_attention_of_the_last_queries(hq, hkv, n, total):
    """The lower-right causal bias (the GPU path of a chunk's attention) gives what the positioned blocks give."""
    g = torch.Generator().manual_seed(n * total)
    q, k, v = (torch.randn(rows, h, 16, generator=g) for rows, h in ((n, hq), (total, hkv), (total, hkv)))
    want = positioned_attention(q, k, v, torch.arange(total - n, total), block=16)
    torch.testing.assert_close(chunk_attention(q, k, v), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefix,total", [(0, 1100), (0, 1400), (0, 700), (192, 1500), (640, 2200)])
def test_part_attention_rounds_as_the_whole_extend(dtype, prefix, total):
    """Chunks of an extend [prefix, total), each computed with only the keys up to its end (rows past them NaN),
    give bit for bit what one call over the whole extend gives those queries (a server's prefill) -- on a CPU whose
    flash attention rounds a query alone (tests/rounding.py: not Intel's AMX in bf16 or fp32); elsewhere within the
    dtype's rounding."""
    g = torch.Generator().manual_seed(total + prefix)
    q, k, v = (torch.randn(rows, h, 64, generator=g).to(dtype) for rows, h in
               ((total - prefix, 9), (total, 3), (total, 3)))
    whole = causal_attention(q, k, v, prefix)
    exact = attention_rows_alone(dtype)
    for size in (64, 256, 192):
        start = prefix
        while start < total:
            end = min(total, start + size)
            kk, vv = k.clone(), v.clone()
            kk[end:], vv[end:] = float("nan"), float("nan")  # not computed yet: never read
            got = part_attention(q[start - prefix : end - prefix], kk, vv, start, prefix=prefix, total=total)
            want = whole[start - prefix : end - prefix]
            if exact:
                assert torch.equal(got, want), (size, start)
            else:  # this CPU's kernels round a query by what else is in its call: close, not equal
                torch.testing.assert_close(got, want, msg=lambda m, at=(size, start): f"{at}: {m}")
            start = end


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefix,start,end,total", [(0, 256, 512, 1100), (192, 448, 1216, 1500), (640, 640, 900, 2200)])
def test_part_attention_with_kept_masks_is_bit_for_bit_the_same(dtype, prefix, start, end, total):
    """A chunk's layers share its masks (`masks`): built once, as the additive masks SDPA makes of the boolean ones,
    so every layer's result is bit for bit what it is with the boolean masks, on any CPU."""
    g = torch.Generator().manual_seed(total + start)
    masks: dict = {}
    for layer in range(3):
        q, k, v = (torch.randn(rows, h, 64, generator=g).to(dtype) for rows, h in ((end - start, 9), (end, 3),
                                                                                    (end, 3)))
        want = part_attention(q, k, v, start, prefix=prefix, total=total)
        got = part_attention(q, k, v, start, prefix=prefix, total=total, masks=masks)
        assert torch.equal(got, want), layer
        built = len(masks)
        assert built >= 1 and all(m.dtype == dtype for m in masks.values())
    assert len(masks) == built  # (no new mask after the first layer)


def test_part_attention_refuses_queries_outside_the_extend():
    q, kv = torch.zeros(4, 2, 8), torch.zeros(20, 2, 8)
    with pytest.raises(ValueError, match="outside the extend"):
        part_attention(q, kv, kv, 2, prefix=4, total=20)
    with pytest.raises(ValueError, match="outside the extend"):
        part_attention(q, kv, kv, 18, prefix=0, total=20)
