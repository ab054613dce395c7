"""Importance capture in the server (IMPRESS): every prefill that goes through SGLang's own forward scores its prompt
tokens by the attention they receive from the prompt's last tokens, in a few sampled heads, and the store learns
from it per KV page (`storage/importance_table.py`).

Seam (listed in plugin.py): `layers.radix_attention.RadixAttention.forward` (AROUND, scheduler processes of a server
with `TieredConfig.capture_heads` >= 1: by default where `--tiered-importance-load gated` reads the
scores). After SGLang's own attention has run (and written this layer's K into the pool), for each
request of an extend batch whose forward reaches the end of its prompt (the last piece of a chunked prefill), the window
-- the prompt's last `--tiered-importance-window` tokens (32 by default: the question and the turn header, which is what
the answer will attend from; SnapKV observes with the same window) -- is scored against every key of the request (cached
prefix and new tokens) in the sampled query heads (`kernels.importance.sampled_heads`: spread over the KV-head groups).
Scores are summed over layers; after the last layer the top `--tiered-importance-ratio` of the prompt's tokens count as
important, and every complete page of the prompt gets that verdict folded into its tokens' moving averages, keyed by the
page's storage key (SGLang's hash chain, the key the SSD tier files the page under). The prompt's pages that came from a
cache (`req.cached_tokens`) are counted as reused.

Read-only: nothing the forward computes changes (greedy output with capture on equals capture off, tested); a
failure is logged, counted in `sglang_tiered:hook_errors_total` and drops that batch's capture only. Prefills that
bypass SGLang's attention (blended requests, chained prefills) are not scored. Cost: per layer, the window's
queries in the sampled heads against the request's keys -- `window x heads x tokens` dot products.

The table is part of the scheduler's store (`runtime.Store.importance`, its log counted in the SSD tier); with
gated loading every scored prompt's pages are offered to the store's repacker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang_tiered.integration.keys import page_keys
from sglang_tiered.kernels.importance import sampled_heads, window_scores
from sglang_tiered.policy.importance import important_mask

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")


@dataclass
class _Job:
    """One request whose prompt ends in this forward."""

    req: Any
    row: int  # req_to_token row
    seq_len: int
    q_rows: torch.Tensor  # rows of this forward's queries that are the window
    q_pos: torch.Tensor  # their positions
    scores: Optional[torch.Tensor] = field(default=None)


class Capture:
    """This process's importance capture: the hook on SGLang's attention (`around_attention`) and its jobs."""

    def __init__(self, rt: Runtime, heads: int, window: int, ratio: float) -> None:
        self.rt = rt
        self.heads_wanted, self.window, self.ratio = heads, window, ratio
        self._jobs: list[_Job] = []
        self._heads: Optional[list[int]] = None
        self._last_layer = -1
        self._errors = 0

    def around_attention(self, original, attn, q, k, v, forward_batch, *args, **kwargs):
        out = original(attn, q, k, v, forward_batch, *args, **kwargs)
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_target_verify():
            try:
                self.layer(attn, q, forward_batch)
            except Exception:
                self._errors += 1
                self._jobs = []
                self.rt.events.count("hook_errors")
                if self._errors == 1:
                    logger.exception("tiered importance: capture failed; this batch's importance is not recorded")
        return out

    def layer(self, attn, q: torch.Tensor, fb) -> None:
        """Called after RadixAttention `attn` ran layer `attn.layer_id` of extend batch `fb`."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        pool = get_token_to_kv_pool()
        layer_id = attn.layer_id
        if layer_id == getattr(pool, "start_layer", 0):
            self._start(fb, attn, pool)
        if not self._jobs:
            return
        hq, d = attn.tp_q_head_num, attn.qk_head_dim
        qs = q.reshape(-1, hq, d)
        keys = pool.get_key_buffer(layer_id)
        req_to_token = get_req_to_token_pool().req_to_token
        for job in self._jobs:
            slots = req_to_token[job.row, : job.seq_len].to(torch.int64)
            s = window_scores(qs[job.q_rows], keys.index_select(0, slots), job.q_pos, self._heads, attn.scaling)
            job.scores = s if job.scores is None else job.scores + s
        if layer_id == self._last_layer:
            jobs, self._jobs = self._jobs, []
            self._finish(jobs, pool.page_size)

    def _start(self, fb, attn, pool) -> None:
        self._jobs = []
        if self._heads is None:
            self._heads = sampled_heads(attn.tp_q_head_num, attn.tp_k_head_num,
                                        min(self.heads_wanted, attn.tp_q_head_num))
        self._last_layer = getattr(pool, "start_layer", 0) + pool.layer_num - 1  # (pool.end_layer is not reliable)
        if self.rt.store is None or self.rt.store.importance is None:
            return
        by_rid = {r.rid: r for r in self.rt.forward.batch_requests(fb)}
        start = 0
        for i, rid in enumerate(fb.rids or []):
            prefix, ext = int(fb.extend_prefix_lens_cpu[i]), int(fb.extend_seq_lens_cpu[i])
            req = by_rid.get(rid)
            if req is not None and ext > 0 and prefix + ext >= len(req.origin_input_ids):
                w = min(self.window, ext)
                rows = torch.arange(start + ext - w, start + ext)
                self._jobs.append(_Job(req, int(fb.req_pool_indices[i]), prefix + ext, rows,
                                       torch.arange(prefix + ext - w, prefix + ext)))
            start += ext

    def _finish(self, jobs: list[_Job], page_size: int) -> None:
        store = self.rt.store
        for job in jobs:
            prompt = min(job.seq_len, len(job.req.origin_input_ids))
            keys = page_keys(job.req, prompt, page_size)
            if keys:
                scores = job.scores[: len(keys) * page_size].tolist()
                store.importance.observe(keys, important_mask(scores, self.ratio))
            reused = min(int(getattr(job.req, "cached_tokens", 0) or 0), len(keys) * page_size) // page_size
            if reused:
                store.importance.reuse(keys[:reused])
            if store.repacker is not None and keys:
                store.repacker.offer(keys)
            self.rt.events.count("importance_prompts")
            self.rt.events.count("importance_pages", len(keys))


def register_hooks(rt: Runtime) -> bool:
    """Capture in the scheduler processes of a server with `TieredConfig.capture_heads` >= 1 (by default where
    gated loading reads the scores)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = rt.settings
    if current is None or current.config.capture_heads < 1:
        return False
    cfg = current.config
    capture = Capture(rt, cfg.capture_heads, cfg.importance_window, cfg.importance_ratio)
    HookRegistry.register("sglang.srt.layers.radix_attention.RadixAttention.forward", capture.around_attention,
                          HookType.AROUND)
    rt.forward.track_batches()
    return True
