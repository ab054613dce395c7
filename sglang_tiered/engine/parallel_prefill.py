"""Prefill of one prompt split over the ranks of a `torch.distributed` process group (gloo on CPU, NCCL on GPU).
Every rank holds the full weights; rank r owns the token slice [bounds[r], bounds[r + 1]).

`runahead_prefill` (KV-Runahead): per layer, rank r receives the accumulated KV of all earlier slices from rank r - 1
(posted before its QKV projection, so the transfer overlaps it), writes its own K, V behind them in the same
contiguous buffer, sends the buffer on to rank r + 1 (asynchronously, overlapping its attention) and attends its
queries to the accumulated keys with causal offset bounds[r]. No rank waits for a whole earlier slice: the last
rank starts layer l as soon as layer l's KV arrives. The last rank returns the first-token logits and the full KV.
A chain can also extend a cached prefix (bounds[0] > 0, the prefix KV held by the last rank), and every wait can
time out, so a dead or stalled peer raises RunaheadError instead of hanging (see engine/runahead_ranks.py).

`tsp_prefill` (the sequence-parallel baseline): even split, all-gather of every layer's K, V, and each rank runs
its queries against the full gathered sequence with the causal mask (the masked upper half is wasted work).

Both are exact: the logits and KV equal single-process `LlamaModel.prefill` up to floating-point reordering.
Bytes sent are counted per rank in `ParallelResult.bytes_sent`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
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
    last_hidden: Optional[torch.Tensor] = None  # [hidden]: the last token's residual stream before the final norm


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


def _check(bounds: Sequence[int], tokens: int, world: int, first: int = 0) -> None:
    if len(bounds) != world + 1 or bounds[0] != first or bounds[-1] != tokens:
        raise ValueError(f"bounds {list(bounds)} do not split {tokens} tokens over {world} ranks")
    if any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"every rank needs at least one token: {list(bounds)}")


class RunaheadError(RuntimeError):
    """A chained prefill could not finish: a peer died, stalled past the timeout, or the group broke. The process
    group is unusable afterwards (gloo closes the pair on a timeout)."""


def _wait(work, timeout_s: Optional[float], what: str) -> None:
    try:
        done = work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RunaheadError(f"{what}: {exc}") from exc
    if done is False:
        raise RunaheadError(f"{what}: not complete after {timeout_s} s")


@torch.inference_mode()
def runahead_prefill(model: LlamaModel, ids: torch.Tensor, bounds: Sequence[int],
                  group: Optional[dist.ProcessGroup] = None, *,
                  prefix_kv: Optional[Callable[[int], torch.Tensor]] = None,
                  timeout_s: Optional[float] = None) -> ParallelResult:
    """Chained prefill of the tokens at positions [bounds[0], bounds[-1]); `ids` holds exactly those tokens.

    `bounds[0] > 0` extends a cached prefix: the last rank (which holds it) passes `prefix_kv(layer)` ->
    [bounds[0], 2, kv_heads, head_dim] and sends it to rank 0 at the start, so the chain's accumulated KV includes
    it. Every wait gives up after `timeout_s` seconds (None: the group's own timeout) with RunaheadError.
    `group` may be any ProcessGroup object, also one built directly (`ProcessGroupGloo(store, rank, size)`) and not
    registered with `torch.distributed`; None is the default group. Ranks are the group's own.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    rank, world = pg.rank(), pg.size()
    prefix, layers = bounds[0], model.cfg.layers
    _check(bounds, prefix + ids.shape[0], world, prefix)
    if prefix and rank == world - 1 and prefix_kv is None:
        raise ValueError("the last rank needs prefix_kv to extend a cached prefix")
    start, end = bounds[rank], bounds[rank + 1]
    kv = model.empty_kv(end)  # contiguous: [layers, end, 2, H, D]; rows [0, start) arrive from rank - 1
    sends, sent = [], 0
    recvs: list = [None] * layers
    if rank > 0:
        recvs = [pg.recv([kv[layer, :start]], rank - 1, layer) for layer in range(layers)]
    elif prefix and world > 1:  # rank 0 gets the cached prefix from the last rank (tags after the chain's)
        recvs = [pg.recv([kv[layer, :prefix]], world - 1, layers + layer) for layer in range(layers)]
    if prefix and rank == world - 1:
        prefix_rows = [prefix_kv(layer).contiguous() for layer in range(layers)]
        if world == 1:
            for layer, rows in enumerate(prefix_rows):
                kv[layer, :prefix] = rows
        else:  # (they come back to this rank inside the accumulated KV of rank world - 2)
            sends = [pg.send([rows], 0, layers + layer) for layer, rows in enumerate(prefix_rows)]
            sent += sum(rows.numel() * rows.element_size() for rows in prefix_rows)
    positions = torch.arange(start, end)
    x = model.embed(ids[start - prefix : end - prefix])
    for layer in range(layers):
        q, k, v = model.qkv(layer, x, positions)  # overlaps the receive of this layer's earlier KV
        kv[layer, start:, 0], kv[layer, start:, 1] = k, v
        if recvs[layer] is not None:
            _wait(recvs[layer], timeout_s, f"rank {rank} waiting for layer {layer}")
        if rank < world - 1:
            sends.append(pg.send([kv[layer]], rank + 1, layer))  # overlaps the attention below
            sent += kv[layer].numel() * kv.element_size()
        attn = causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], start)
        x = model.finish_layer(layer, x, attn)
    for s in sends:
        _wait(s, timeout_s, f"rank {rank} sending")
    last = rank == world - 1
    return ParallelResult(model.logits(x[-1:])[0] if last else None, kv if last else None, sent,
                          x[-1] if last else None)


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
