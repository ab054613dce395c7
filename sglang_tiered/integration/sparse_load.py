"""Gated sparse loading in the server (IMPRESS, `--tiered-importance-load gated`, approximate, CPU servers).

A request whose prefix beyond device and host memory is on SSD, in one repacked group (storage/repacker.py), is
served by `engine.sparse.sparse_prefill` instead of SGLang's load of every page:

* Admission -- seam `Scheduler._prefetch_kvcache` (AROUND): for a gated request (the server's mode, or
  `custom_params.tiered_importance` = "gated" / "full"; "off" opts out) whose stored run after its device + host
  match holds at least `--tiered-importance-min-tokens` tokens, SGLang's L3 prefetch is skipped: those tokens
  become extend tokens. The request is kept out of the radix tree (`skip_radix_cache_insert`: its KV is
  approximate) and prefills alone (`model_forward.prefill_alone`).
* Forward -- `ImportanceHandler` on the Llama forward hook: the device/host prefix is read from the pool (exact),
  the stored span S is loaded sparsely from the group (the gate decides per layer: `--tiered-importance-gate`, or
  the request's `custom_params.tiered_importance_gate`; each gate keeps its own probe-skipping history), the rest C
  is computed. C's KV
  and, per layer, the loaded tokens of S go into the request's slots; the others are holes. Anything unexpected
  (a batch of several requests, a piece of a chunked prefill, the group gone or corrupt) leaves the batch to
  SGLang's forward, which then computes S exactly (correct, slower; logged and counted).
* Decode -- the positions stay the prompt's (the row is full length, holes included, so SGLang's position = slot
  count is right and the stored keys already carry their RoPE). `holes(rid)` tells the prefix-aware CPU attention
  (cpu_attention.py) which prefix positions to skip on each layer, in decode and in any later extend.

Counters: `sglang_tiered:importance_sparse_requests_total`, `..._importance_gate_passes_total`,
`..._importance_gate_fails_total` (layers), `..._importance_attention_dropped_total` (the attention share the
picks left out, summed over passed layers), `..._importance_probes_skipped_total` (layers loaded whole without a
probe: their gate kept failing, `--tiered-importance-probe-skip`), `..._importance_tokens_skipped_total`
(token-layers of S not loaded), `..._importance_bytes_skipped_total` (their K and V),
`..._importance_bytes_read_total` (probe + chunks), `..._importance_bytes_needed_total` (K and V of the tokens
used: read amplification = read / needed), `..._importance_fallbacks_total`; one log line per sparse request.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang_tiered.engine.group_span import GroupSpan, SpanMiss
from sglang_tiered.engine.sparse import sparse_prefill
from sglang_tiered.integration import importance, metrics, model_forward, settings
from sglang_tiered.integration.requests import GATE_PARAM, IMPORTANCE_MODES, IMPORTANCE_PARAM, request_params
from sglang_tiered.integration.requests import PARAM as REQUEST_CHUNKS
from sglang_tiered.policy.importance import GATES, GateHistory
from sglang_tiered.storage.group_file import GroupMeta

logger = logging.getLogger("sglang_tiered")

PARAM, MODES = IMPORTANCE_PARAM, IMPORTANCE_MODES  # per-request mode; "full": this path loading everything (exact)
_MAX_HOLES = 4096  # requests whose holes are remembered (oldest forgotten first)


@dataclass(frozen=True)
class Holes:
    """Prefix positions [start, end) were stored; on layer l only `kept[l]` (absolute positions) were loaded."""

    start: int
    end: int
    kept: tuple[torch.Tensor, ...]

    def positions(self, layer: int, seq_len: int) -> torch.Tensor:
        """The positions a query at the end of a `seq_len`-token sequence may attend on `layer`."""
        return torch.cat([torch.arange(self.start), self.kept[layer], torch.arange(self.end, seq_len)])


_holes: OrderedDict[str, Holes] = OrderedDict()


def holes(rid: str) -> Optional[Holes]:
    return _holes.get(rid)


def request_mode(req) -> str:
    mode = request_params(req).get(PARAM)
    if mode in MODES:
        return mode
    current = settings.current()
    return "gated" if current is not None and current.config.importance_load == "gated" else "off"


def request_gate(req) -> str:
    """The request's gate: custom_params.tiered_importance_gate, else `--tiered-importance-gate`."""
    gate = request_params(req).get(GATE_PARAM)
    return gate if gate in GATES else settings.current().config.importance_gate


def stored_run(req, start: int) -> Optional[tuple[GroupMeta, int, int]]:
    """(group, first member, pages): the pages of `req`'s prompt from token `start` (page-aligned) on that lie, in
    order, in one repacked group -- leaving at least the prompt's last token to compute; None if there are none."""
    tier = importance.tier()
    if tier is None:
        return None
    ps = tier.namespace.page_size
    if start % ps:
        return None
    keys = importance.page_keys(req, len(req.origin_input_ids) - 1, ps)[start // ps :]
    meta = tier.group_of(keys[0]) if keys else None
    if meta is None:
        return None
    first = meta.keys.index(keys[0])
    n = 0
    while n < len(keys) and first + n < len(meta.keys) and meta.keys[first + n] == keys[n]:
        n += 1
    return meta, first, n


def _around_prefetch(original, self, req, *args, **kwargs):
    _holes.pop(req.rid, None)
    if getattr(req, "tiered_sparse", False):
        req.tiered_sparse = False  # re-admitted (e.g. retracted): decided afresh
    mode = request_mode(req)
    blended = REQUEST_CHUNKS in request_params(req)  # blended requests: not here
    if mode == "off" or importance.tier() is None or blended:
        return original(self, req, *args, **kwargs)
    try:
        req.init_next_round_input(self.tree_cache, cow_mamba=False)
        start = req.prefix_len + req.host_hit_length
        run = stored_run(req, start)
        current = settings.current()
        if run is not None and run[2] * run[0].page_size >= current.config.importance_min_tokens:
            limit = model_forward.too_long_for_one_extend(self, req, start)
            if limit is not None:
                metrics.count("importance_too_long")
                logger.info("tiered importance: rid %s not loaded sparsely: %d tokens to prefill exceed "
                            "--chunked-prefill-size %d; SGLang loads the stored prefix", req.rid,
                            len(req.origin_input_ids) - start, limit)
                return original(self, req, *args, **kwargs)
            req.tiered_sparse = True
            req.skip_radix_cache_insert = True
            return None  # no L3 prefetch: the stored span is loaded sparsely in the forward
    except Exception:
        metrics.count("hook_errors")
        logger.exception("tiered importance: admission of rid %s failed; SGLang prefetches as usual", req.rid)
    return original(self, req, *args, **kwargs)


def is_sparse(req) -> bool:
    return bool(getattr(req, "tiered_sparse", False))


class ImportanceHandler(model_forward.ForwardHandler):
    name = "importance"

    def build_runtime(self, module):
        return model_forward.engine_from_sglang(module)

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        reqs = [r for r in model_forward.batch_requests(fb) if is_sparse(r)]
        if not reqs:
            return None
        req = reqs[0]
        prefix = int(fb.extend_prefix_lens_cpu[0])
        run = None
        why = model_forward.why_not_whole_prompt(fb, req)
        if why is None:
            run = stored_run(req, prefix)
            if run is None or run[2] * run[0].page_size < settings.current().config.importance_min_tokens:
                why = "the stored span is gone"
        engine = self.runtime(module) if why is None else None
        if why is None and engine is None:
            why = f"disabled in this process: {self.disabled}"
        if why is None:
            try:
                return _sparse_forward(engine, req, fb, *run)
            except SpanMiss as exc:
                why = f"stored span unreadable: {exc}"
        for r in reqs:
            r.tiered_sparse = False
        self.fallback([r.rid for r in reqs], why + "; SGLang computes the span")
        return None


@torch.inference_mode()
def _sparse_forward(engine, req: Any, fb, meta: GroupMeta, first: int, pages: int) -> torch.Tensor:
    t0 = time.perf_counter()
    cfg = settings.current().config
    prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
    span = GroupSpan(importance.tier(), meta, first, pages)
    s = span.tokens
    ids = torch.tensor(req.origin_input_ids[prefix + s : prefix + ext], dtype=torch.int64)
    mode, gate = request_mode(req), request_gate(req)
    skip = _histories[gate].skip() if mode != "full" else frozenset()
    res = sparse_prefill(engine, ids, prefix_len=prefix, span=span,
                         prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None,
                         heads=cfg.importance_heads, window=cfg.importance_window, ratio=cfg.importance_ratio,
                         alpha=cfg.importance_alpha, gate=gate, max_drop=cfg.importance_max_drop,
                         force="fail" if mode == "full" else None, skip=skip)
    if mode != "full":
        _histories[gate].record({g.layer: g.passed for g in res.gates if g.layer not in skip})
    new_kv = engine.empty_kv(ext).zero_()
    new_kv[:, s:] = res.kv
    for layer, (idx, kv) in enumerate(zip(res.kept, res.kept_kv)):
        new_kv[layer, idx] = kv
    hidden = model_forward.write_extend(fb, engine, new_kv, res.hidden)
    if res.loaded_fraction < 1.0:
        _holes[req.rid] = Holes(prefix, prefix + s, tuple(prefix + idx for idx in res.kept))
        while len(_holes) > _MAX_HOLES:
            _holes.popitem(last=False)
    passes = sum(g.passed for g in res.gates)
    skipped = sum(s - g.loaded for g in res.gates)
    token_layer_bytes = engine.cfg.geometry(engine.dtype.itemsize).token_layer_bytes
    needed = sum(g.loaded for g in res.gates) * token_layer_bytes
    metrics.count("importance_sparse_requests")
    metrics.count("importance_gate_passes", passes)
    metrics.count("importance_gate_fails", len(res.gates) - passes)
    metrics.count("importance_attention_dropped", sum(g.drop for g in res.gates if g.passed))
    metrics.count("importance_probes_skipped", len(skip))
    metrics.count("importance_tokens_skipped", skipped)
    metrics.count("importance_bytes_skipped", skipped * token_layer_bytes)
    metrics.count("importance_bytes_read", span.bytes_read)
    metrics.count("importance_bytes_needed", needed)
    importance.tier().stats.add(sparse_bytes_read=span.bytes_read, sparse_bytes_needed=needed)
    logger.info(LOG_LINE, req.rid, prefix, s, ext - s, mode, gate, passes, len(res.gates), len(skip),
                res.loaded_fraction, span.bytes_read / 2**20, span.bytes_read / max(1, needed),
                time.perf_counter() - t0)
    return hidden


LOG_LINE = ("tiered importance: rid %s sparse load: prefix=%d stored=%d computed=%d mode=%s %s gate passed %d/%d "
            "layers (%d unprobed), loaded %.3f of the stored token-layers, %.1f MiB read (read amplification %.2f), "
            "total=%.3fs")
# what `LOG_LINE` says, for readers of the server log (benchmarks): rid, stored tokens, MiB read, read amplification
LOG_PATTERN = re.compile(r"rid (\S+) sparse load: prefix=\d+ stored=(\d+) .* ([0-9.]+) MiB read \(read amplification "
                         r"([0-9.]+)")


# this scheduler's gate outcomes per layer, per gate (a layer one gate fails may pass the other); one model per
# process; set up by `register_hooks`
_histories = {gate: GateHistory(streak=0) for gate in GATES}


def register_hooks() -> bool:
    """In scheduler processes of a CPU server with importance capture on (gated loading is per request too)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _histories
    current = settings.current()
    if current is None or current.config.importance_load != "gated":
        return False
    _histories = {gate: GateHistory(current.config.importance_probe_skip) for gate in GATES}
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", _around_prefetch,
                          HookType.AROUND)
    model_forward.prefill_alone(is_sparse)
    model_forward.add_handler(ImportanceHandler())
    return True
