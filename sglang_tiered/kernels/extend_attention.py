"""Prefix-aware paged attention for CPU: only the new tokens' queries, against prefix + new keys.

Shapes (T = new tokens of all requests, concatenated in request order):
  q        [T, Hq, D]            queries of the new tokens (post-RoPE)
  k_cache  [slots, Hkv, D]       paged key pool; v_cache likewise (head dim Dv may differ)
  req_to_token[row, pos]         pool slot of token `pos` of the request in `row`
  seq_lens[i] = prefix_lens[i] + extend_lens[i]
Query j of request i sits at absolute position prefix_lens[i] + j and attends keys 0 .. prefix_lens[i] + j.
GQA: query head h reads KV head h // (Hq // Hkv). Decode is the case extend_lens == 1.

SGLang's `torch_native` backend instead builds a query tensor as long as the whole sequence and runs causal
attention over seq_len x seq_len, so a cache hit still pays for the whole prompt's attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

KV_BLOCK = 512  # torch's CPU flash attention reads keys in blocks of this many (kvSplitSize, torch 2.x)
QUERY_BLOCK = 256  # `positioned_attention`'s default block of queries


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Dense causal attention with an offset: q [n, Hq, D] at absolute positions q_start .. q_start + n - 1,
    k/v [S, Hkv, D] at positions 0 .. S - 1 (S >= q_start + n); query i attends keys 0 .. q_start + i.
    Returns [n, Hq, Dv]. Strided k/v views are fine (no copy is made)."""
    n, total = q.shape[0], k.shape[0]
    if total < q_start + n:
        raise ValueError(f"{total} keys cannot cover queries up to position {q_start + n - 1}")
    if q_start > 0 and n > 1:
        if q.is_cuda:  # one fused kernel, no mask to build (on a CPU torch would materialise the mask)
            return chunk_attention(q, k[: q_start + n], v[: q_start + n], scale)
        return positioned_attention(q, k, v, torch.arange(q_start, q_start + n, device=q.device), scale,
                                    host_positions=range(q_start, q_start + n))
    # square (the fast causal kernel) or one query at the last position (sees every key): no mask
    return _sdpa(q, k[: q_start + n], v[: q_start + n], None, q_start == 0, scale)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of queries q [n, Hq, D] that are the last n of the keys k/v [S, Hkv, D] (a chunked prefill's
    chunk): SDPA with torch's lower-right causal bias, which a GPU runs as flash or memory-efficient attention."""
    return _sdpa(q, k, v, causal_lower_right(q.shape[0], k.shape[0]), False, scale)


def positioned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         scale: Optional[float] = None, block: int = QUERY_BLOCK,
                         host_positions: Optional[Sequence[int]] = None, masks: Optional[dict] = None) -> torch.Tensor:
    """Queries [n, Hq, D] at ascending absolute positions `q_pos` (any gaps), each attending keys 0 .. its position.
    Runs in blocks of `block` queries, each against only the keys up to its last query's position, so the masked
    work is about half of n x S for a contiguous run (a single masked call would pay all of it). `host_positions`:
    `q_pos` as Python ints, where the caller has them (else they are read back: on a GPU, a wait for the device).
    `masks`: a dict the caller keeps over calls with the same `q_pos`, `block` and dtype (a prompt's layers while
    its computed tokens stay the same), so that each block's mask is built once, as the additive mask SDPA would
    make of the boolean one (the same values: bit for bit the same result; 368 queries in 11 runs over 1,400 keys,
    bf16, two CPU threads: 1.8 ms per layer with kept masks, 2.1 ms without)."""
    n = q.shape[0]
    out = q.new_empty((n, q.shape[1], v.shape[-1]))
    pos = None
    for i in range(0, n, block):
        j = min(n, i + block)
        mask = None if masks is None else masks.get((i, q.dtype))
        if mask is None:
            if pos is None:
                pos = q_pos.tolist() if host_positions is None else host_positions
            mask = torch.arange(pos[j - 1] + 1, device=q.device)[None, :] <= q_pos[i:j, None].to(q.device)
            if masks is not None:
                mask = masks[(i, q.dtype)] = _additive(mask, q.dtype)
        keys = mask.shape[1]
        out[i:j] = _sdpa(q[i:j], k[:keys], v[:keys], mask, False, scale)
    return out


def part_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, *, prefix: int, total: int,
                   scale: Optional[float] = None, masks: Optional[dict] = None) -> torch.Tensor:
    """Causal attention of some of an extend's queries, q [n, Hq, D] at positions q_start .. q_start + n - 1, over
    k/v [>= q_start + n, Hkv, D] (rows past q_start + n are never read), rounded bit for bit as `causal_attention`
    rounds them when it runs the whole extend [prefix, total) in one call (what a CPU server does for its prefill).

    Why it is not simply `causal_attention` of the part: torch's CPU flash attention reads keys in blocks of
    KV_BLOCK from position 0, and a query's result depends on the length of the block that holds its last key,
    which the number of keys in the call decides (the whole extend's call: all `total` keys where prefix == 0;
    else those up to the end of the query's block of QUERY_BLOCK, counted from `prefix`). So each query runs against
    its own keys, then masked zeros up to that block length. Keys past the query are masked in either call, which
    changes no bit. CPU only (a CUDA caller keeps `causal_attention`). `masks`: a dict the caller keeps over calls
    with the same query positions and dtype (a chunk's layers), so that each mask is built once; it holds the
    additive masks SDPA would make of the boolean ones, so the kernel sees the same values."""
    n = q.shape[0]
    if q_start < prefix or q_start + n > total or k.shape[0] < q_start + n:
        raise ValueError(f"queries {q_start}..{q_start + n - 1} outside the extend [{prefix}, {total}) or its keys")
    out = q.new_empty((n, q.shape[1], v.shape[-1]))
    i = 0
    while i < n:
        whole = total if prefix == 0 else prefix + min(total - prefix, (q_start + i - prefix) // QUERY_BLOCK
                                                        * QUERY_BLOCK + QUERY_BLOCK)  # keys the whole call passes
        j = min(n, i + QUERY_BLOCK, whole - q_start)
        need = q_start + j  # keys these queries see
        keys = min(whole, -(-need // KV_BLOCK) * KV_BLOCK)
        kk, vv = k[:need], v[:need]
        if keys > need:
            kk = torch.cat([kk, kk.new_zeros((keys - need, *kk.shape[1:]))])
            vv = torch.cat([vv, vv.new_zeros((keys - need, *vv.shape[1:]))])
        if q_start + i == 0:  # from key 0: torch's causal mask (upper left) is this one, and skips masked blocks
            out[i:j] = _sdpa(q[i:j], kk, vv, None, True, scale)
        else:
            out[i:j] = _sdpa(q[i:j], kk, vv, _part_mask(q, q_start + i, need, keys, masks), False, scale)
        i = j
    return out


def _part_mask(q: torch.Tensor, first: int, need: int, keys: int, masks: Optional[dict]) -> torch.Tensor:
    """Queries at positions first .. need - 1 over `keys` keys, each seeing keys up to its own position: the boolean
    mask, or (with a cache `masks`) the additive one SDPA converts it to (0 / -inf in q's dtype), built once."""
    mask = None if masks is None else masks.get((first, need, keys, q.dtype))
    if mask is None:
        mask = torch.arange(keys, device=q.device)[None, :] <= torch.arange(first, need, device=q.device)[:, None]
        if masks is not None:
            mask = masks[(first, need, keys, q.dtype)] = _additive(mask, q.dtype)
    return mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask SDPA makes of the boolean `mask` (0 where True, -inf where False) in `dtype`: built once
    and kept, it gives bit for bit what the boolean one gives."""
    return torch.where(mask, 0.0, torch.tensor(float("-inf"), dtype=dtype, device=mask.device))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
          scale: Optional[float]) -> torch.Tensor:
    """[n, H, D] in and out around torch's [1, H, n, D] SDPA."""
    o = scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                     v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale,
                                     enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor | Sequence[int],
    prefix_lens: torch.Tensor | Sequence[int],
    extend_lens: torch.Tensor | Sequence[int],
    *,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and itself. Returns [T, Hq, Dv]."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if out is None:
        out = q.new_empty((q.shape[0], hq, v_cache.shape[-1]))
    rows, prefixes, extends = _as_list(req_pool_indices), _as_list(prefix_lens), _as_list(extend_lens)
    if not len(rows) == len(prefixes) == len(extends):
        raise ValueError("req_pool_indices, prefix_lens and extend_lens differ in length")
    if sum(extends) != q.shape[0]:
        raise ValueError(f"extend_lens sum to {sum(extends)} but q has {q.shape[0]} tokens")
    start = 0
    for row, prefix, n in zip(rows, prefixes, extends):
        if n == 0:
            continue
        slots = req_to_token[row, : prefix + n]
        k, v = k_cache[slots].to(q.dtype), v_cache[slots].to(q.dtype)
        out[start : start + n] = causal_attention(q[start : start + n], k, v, prefix, scale)
        start += n
    return out


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Naive fp32 reference: full-sequence queries (prefix rows zero-filled) with an explicit causal softmax, then
    the new rows kept — the computation `torch_native` performs, written out."""
    hq, hkv, d = q.shape[1], k_cache.shape[1], q.shape[2]
    group = hq // hkv
    scale = scale if scale is not None else d**-0.5
    outs, start = [], 0
    for row, prefix, n in zip(_as_list(req_pool_indices), _as_list(prefix_lens), _as_list(extend_lens)):
        total = prefix + n
        slots = req_to_token[row, :total]
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        full_q = torch.zeros(total, hq, d)
        full_q[prefix:] = q[start : start + n].float()
        scores = torch.einsum("qhd,khd->hqk", full_q, k) * scale
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v)[prefix:])
        start += n
    return torch.cat(outs) if outs else q.new_zeros((0, hq, v_cache.shape[-1])).float()
