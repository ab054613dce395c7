"""Prefill of one prompt split over the ranks of a `torch.distributed` process group (gloo on CPU, NCCL on GPU).
Every rank holds the full weights; rank r owns the token slice [bounds[r], bounds[r + 1]).

`chain_prefill` (KV-Runahead): per layer, rank r receives the accumulated KV of all earlier slices from rank r - 1
(posted before its QKV projection, so the transfer overlaps it), writes its own K, V behind them in the same
contiguous buffer, sends the buffer on to rank r + 1 (asynchronously, overlapping its attention) and attends its
queries to the accumulated keys with causal offset bounds[r]. No rank waits for a whole earlier slice: the last
rank starts layer l as soon as layer l's KV arrives. The last rank returns the first-token logits and the full KV.

`tsp_prefill` (the sequence-parallel baseline): even split, all-gather of every layer's K, V, and each rank runs
its queries against the full gathered sequence with the causal mask (the masked upper half is wasted work).

Both are exact: the logits and KV equal single-process `LlamaModel.prefill` up to floating-point reordering.
Bytes sent are counted per rank in `ParallelResult.bytes_sent`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.kernels.extend_attention import causal_attention


@dataclass
class ParallelResult:
    logits: Optional[torch.Tensor]  # [vocab] on the rank that owns the last token, else None
    kv: Optional[torch.Tensor]  # [layers, tokens, 2, kv_heads, head_dim]: full on the last rank (chain) / all (tsp)
    bytes_sent: int  # by this rank


def even_bounds(tokens: int, ranks: int) -> list[int]:
    """[0, b1, ..., tokens] splitting `tokens` as evenly as possible (earlier ranks get the remainder)."""
    base, extra = divmod(tokens, ranks)
    out = [0]
    for r in range(ranks):
        out.append(out[-1] + base + (1 if r < extra else 0))
    return out


def bounds_from_fractions(tokens: int, fractions: Sequence[float]) -> list[int]:
    """Slice boundaries from per-rank fractions (normalised); every rank gets at least one token."""
    total = float(sum(fractions))
    if len(fractions) > tokens or total <= 0 or min(fractions) < 0:
        raise ValueError(f"cannot split {tokens} tokens as {list(fractions)}")
    out, acc = [0], 0.0
    for i, f in enumerate(fractions[:-1]):
        acc += f / total
        lo, hi = out[-1] + 1, tokens - (len(fractions) - 1 - i)
        out.append(min(max(round(acc * tokens), lo), hi))
    out.append(tokens)
    return out


def _check(bounds: Sequence[int], tokens: int, world: int) -> None:
    if len(bounds) != world + 1 or bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"bounds {list(bounds)} do not split {tokens} tokens over {world} ranks")
    if any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"every rank needs at least one token: {list(bounds)}")


@torch.inference_mode()
def chain_prefill(model: LlamaModel, ids: torch.Tensor, bounds: Sequence[int],
                  group: Optional[dist.ProcessGroup] = None) -> ParallelResult:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check(bounds, ids.shape[0], world)
    start, end = bounds[rank], bounds[rank + 1]
    prev = dist.get_global_rank(group, rank - 1) if group is not None and rank > 0 else rank - 1
    nxt = dist.get_global_rank(group, rank + 1) if group is not None and rank < world - 1 else rank + 1
    kv = model.empty_kv(end)  # contiguous: [layers, end, 2, H, D]; rows [0, start) arrive from rank - 1
    recvs = [dist.irecv(kv[layer, :start], src=prev, group=group, tag=layer) if rank > 0 else None
             for layer in range(model.cfg.layers)]
    sends, sent = [], 0
    positions = torch.arange(start, end)
    x = model.embed(ids[start:end])
    for layer in range(model.cfg.layers):
        q, k, v = model.qkv(layer, x, positions)  # overlaps the receive of this layer's earlier KV
        kv[layer, start:, 0], kv[layer, start:, 1] = k, v
        if recvs[layer] is not None:
            recvs[layer].wait()
        if rank < world - 1:
            sends.append(dist.isend(kv[layer], dst=nxt, group=group, tag=layer))  # overlaps the attention below
            sent += kv[layer].numel() * kv.element_size()
        attn = causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], start)
        x = model.finish_layer(layer, x, attn)
    for s in sends:
        s.wait()
    last = rank == world - 1
    return ParallelResult(model.logits(x[-1:])[0] if last else None, kv if last else None, sent)


@torch.inference_mode()
def tsp_prefill(model: LlamaModel, ids: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                bounds: Optional[Sequence[int]] = None) -> ParallelResult:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = ids.shape[0]
    bounds = list(bounds) if bounds is not None else even_bounds(n, world)
    _check(bounds, n, world)
    sizes = [e - b for b, e in zip(bounds, bounds[1:])]
    pad = max(sizes)  # all_gather needs equal shapes: pad every slice to the longest
    c = model.cfg
    start, end = bounds[rank], bounds[rank + 1]
    kv = model.empty_kv(n)
    positions = torch.arange(start, end)
    x = model.embed(ids[start:end])
    sent = 0
    mask = torch.arange(n)[None, :] <= positions[:, None]
    for layer in range(c.layers):
        q, k, v = model.qkv(layer, x, positions)
        mine = torch.zeros(pad, 2, c.kv_heads, c.head_dim, dtype=model.dtype)
        mine[: end - start, 0], mine[: end - start, 1] = k, v
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        sent += mine.numel() * mine.element_size() * (world - 1)
        for r in range(world):
            kv[layer, bounds[r] : bounds[r + 1]] = gathered[r][: sizes[r]]
        keys, values = kv[layer, :, 0].transpose(0, 1), kv[layer, :, 1].transpose(0, 1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                              enable_gqa=c.heads != c.kv_heads)[0].transpose(0, 1)
        x = model.finish_layer(layer, x, attn)
    last = rank == world - 1
    return ParallelResult(model.logits(x[-1:])[0] if last else None, kv, sent)
