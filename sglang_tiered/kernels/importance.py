"""Importance of prompt tokens from sampled attention heads (IMPRESS), in torch. No SGLang.

A token's importance at one layer is the attention it receives from the prompt's observation window -- the last
`window` query tokens, where the question and the start of the answer sit -- summed over the sampled query heads
(each softmax row sums to 1, so a layer hands out `window x heads` units of attention). Summed over layers this
is the score that placement and sparse loading rank tokens by.

Shapes: queries [w, Hq, D] (post-RoPE, the window's rows), keys [S, Hkv, D] (post-RoPE, every key the window can
see: the cached prefix and the new tokens), `q_pos` [w] the window's absolute positions (query i sees keys
0 .. q_pos[i]). GQA: query head h reads KV head h // (Hq // Hkv).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sampled_heads(q_heads: int, kv_heads: int, n: int) -> list[int]:
    """`n` query heads spread over the KV-head groups: the first head of each group first, then the second of each,
    ... (on SmolLM2, 9 query / 3 KV heads, n=3 gives [0, 3, 6], one per KV head; the first 3 heads would all read
    KV head 0, and their top-k sets would agree through the shared keys)."""
    if not 1 <= n <= q_heads:
        raise ValueError(f"sample between 1 and {q_heads} query heads, got {n}")
    group = q_heads // kv_heads
    order = [g * group + j for j in range(group) for g in range(kv_heads)]
    return sorted(order[:n])


def probed_kv_heads(q_heads: int, kv_heads: int, n: int) -> list[int]:
    """The KV heads that the `n` sampled query heads (`sampled_heads`) read, ascending: the heads a group's probe
    stores and a sparse load scores with."""
    group = q_heads // kv_heads
    return sorted({h // group for h in sampled_heads(q_heads, kv_heads, n)})


def window_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, heads: Sequence[int],
                  scale: float | None = None) -> torch.Tensor:
    """Attention received by each key [S] (fp32) from the window queries `q` [w, Hq, D] of the sampled `heads`,
    summed over queries and heads; keys after a query's position get none from it."""
    return head_scores(q, k, q_pos, heads, scale).sum(0)


def head_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, heads: Sequence[int],
                scale: float | None = None, kv_cols: Sequence[int] | None = None) -> torch.Tensor:
    """Per sampled head [len(heads), S] (fp32): the attention each key receives from the window queries, summed over
    queries. `k` holds every KV head ([S, Hkv, D]); or, with `kv_cols` given, some of them: heads[j] reads the
    column k[:, kv_cols[j]]. Heads reading the same column share one matrix product (GQA group mates)."""
    hq = q.shape[1]
    heads = list(heads)
    if kv_cols is None:
        hkv = k.shape[1]
        if hq % hkv:
            raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        kv_cols = [h // (hq // hkv) for h in heads]
    kv_cols = list(kv_cols)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    w = q.shape[0]
    scores = torch.empty(len(heads), w, k.shape[0], device=q.device)
    for col in sorted(set(kv_cols)):
        rows = [j for j, c in enumerate(kv_cols) if c == col]
        qs = q[:, [heads[j] for j in rows]].float().transpose(0, 1).reshape(-1, q.shape[-1])  # [n * w, D]
        scores[rows] = (qs @ k[:, col].float().T).view(len(rows), w, -1) * scale
    visible = torch.arange(k.shape[0], device=k.device)[None, :] <= q_pos.to(k.device)[:, None]  # [w, S]
    probs = scores.masked_fill_(~visible[None], float("-inf")).softmax(-1)
    return probs.sum(1)


def topk_sets(scores: torch.Tensor, k: int) -> list[set[int]]:
    """Per row of `scores` [h, S], the indices of its `k` largest entries."""
    k = max(0, min(k, scores.shape[-1]))
    return [set(row.tolist()) for row in torch.topk(scores, k, dim=-1).indices]
