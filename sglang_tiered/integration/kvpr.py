"""Partial-recompute loading in the server (KVPR, `--tiered-kvpr`, exact, CPU servers).

* Gate -- at startup, from config.json: activations pay only where the attention input (hidden) is smaller than
  the KV it replaces (2 x kv_heads x head_dim). Closed (GQA models such as SmolLM2): `auto` stores no activations
  and never splits; the reason is logged once.
* Activations -- seam `models.llama.LlamaAttention.forward` (AROUND, read-only): for every extend batch, the
  attention input of each layer (post-RMSNorm, so the recompute needs no norm) is copied for the complete prompt
  pages the forward computes, and after the last layer written to the SSD tier beside their KV pages
  (storage/activations.py) by one background thread (a full queue drops the batch's activations, counted).
* Admission -- seam `Scheduler._prefetch_kvcache` (AROUND): for a request whose prompt continues, after its device
  + host match, with at least `--tiered-kvpr-min-tokens` of plain pages on SSD, the split l is chosen
  (`policy.kvpr.choose_split` over the measured `Profile`); `auto` takes it -- l = 0 included: our loader overlaps
  the reads with the compute layer by layer, SGLang's reads everything first -- if it predicts at least
  `policy.kvpr.AUTO_MIN_GAIN` off SGLang's own load (`takes_over`); then (or when the request/server forces it) SGLang's
  L3 prefetch is skipped: the stored tokens become extend tokens, loaded by the forward below. The request prefills
  alone (`model_forward.prefill_alone`) and its KV is exact, so it enters the radix tree as usual.
* Profile -- the SSD read bandwidth (in the background, from the first request on: at startup the weights
  are still being read from the same disk; until it is known SGLang loads as usual), K/V recompute and layer times
  (`engine/kvpr_profile.py`, persisted); after each load the read bandwidth becomes min(measured, moving average
  of the loads' own read rates) and the recompute and per-stored-token costs are refitted to the loads' compute
  times (`policy.kvpr.Calibration`).
* Forward -- `KVPRHandler` on the Llama forward hook: `engine.kvpr.kvpr_prefill` over `engine.page_span.PageSpan`
  (the I/O threads read layer l + 1 -- activations of the first l tokens, KV of the rest -- while this thread
  recomputes layer l's K, V and runs the new tokens' layer). The new tokens' complete pages get their activations
  stored too. Anything unexpected (a batch of several, a chunked piece, a KV page gone or corrupt) leaves the batch
  to SGLang's forward, which then computes the stored tokens (exact, slower; logged and counted).

Counters: `sglang_tiered:kvpr_loads_total`, `..._kvpr_tokens_recomputed_total` (tokens of stored spans recomputed,
per layer averaged), `..._kvpr_bytes_saved_total` (KV bytes not read minus activation bytes read),
`..._kvpr_activation_misses_total` (pages whose activations were missing or corrupt: loaded as KV),
`..._kvpr_activation_pages_written_total`, `..._kvpr_activation_bytes_written_total`,
`..._kvpr_activation_drops_total`, `..._kvpr_fallbacks_total`; one log line per load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from sglang_tiered.engine.group_span import SpanMiss
from sglang_tiered.engine.kvpr import kvpr_prefill
from sglang_tiered.engine.kvpr_profile import (
    describe,
    measure_compute,
    measure_read,
    profile_key,
    save_profile,
    stored_profile,
)
from sglang_tiered.engine.page_span import PageSpan
from sglang_tiered.integration import importance, metrics, model_forward, settings, sparse_load
from sglang_tiered.integration.requests import KVPR_MODES, KVPR_PARAM, request_params
from sglang_tiered.integration.requests import PARAM as REQUEST_CHUNKS
from sglang_tiered.policy.kvpr import (
    Calibration,
    Profile,
    Shape,
    Split,
    choose_split,
    gate,
    sglang_load_time,
    takes_over,
)
from sglang_tiered.storage import activations
from sglang_tiered.storage.ssd_tier import SSDTier

logger = logging.getLogger("sglang_tiered")

_WRITE_QUEUE = 8  # batches of activations waiting to be written


@dataclass(frozen=True)
class Plan:
    """A load decided at admission: the stored pages from token `start`, the first `pages` recomputed."""

    start: int
    keys: tuple[str, ...]
    pages: int
    split: Split
    mode: str


class _State:
    def __init__(self) -> None:
        self.tier: Optional[SSDTier] = None
        self.shape: Optional[Shape] = None  # from config.json (itemsize of the served dtype once known)
        self.gate_reason: Optional[str] = None
        self.read_bps: Optional[float] = None  # measured once, from the first request on
        self.observed: Optional[float] = None  # moving average of the loads' read rates
        self.loads = 0
        self.measuring = False
        self.calibration = Calibration()
        self.profile: Optional[Profile] = None
        self.key = ""
        self.writer: Optional[_Writer] = None
        self.lock = threading.Lock()


_state = _State()


# ---------------------------------------------------------------------------------------------- activations
class _Writer:
    """One background thread writing activation pages (keys, [layers, pages * page_size, hidden] tensor)."""

    def __init__(self, tier: SSDTier) -> None:
        self.tier = tier
        self.jobs: queue.Queue = queue.Queue(_WRITE_QUEUE)
        threading.Thread(target=self._run, name="tiered-kvpr-write", daemon=True).start()

    def submit(self, keys: list[str], x: torch.Tensor) -> None:
        try:
            self.jobs.put_nowait((keys, x))
        except queue.Full:
            metrics.count("kvpr_activation_drops", len(keys))

    def _run(self) -> None:
        while True:
            keys, x = self.jobs.get()
            try:
                ps = x.shape[1] // len(keys)
                pages = []
                for i, key in enumerate(keys):
                    rows = x[:, i * ps : (i + 1) * ps].contiguous()
                    pages.append((activations.activation_key(key),
                                  [memoryview(rows[layer].view(torch.uint8).numpy()) for layer in range(x.shape[0])]))
                ok = self.tier.write_pages(pages)
                written = sum(ok)
                metrics.count("kvpr_activation_pages_written", written)
                metrics.count("kvpr_activation_bytes_written", written * x[:, :ps].numel() * x.element_size())
            except Exception:
                metrics.count("hook_errors")
                logger.exception("tiered kvpr: writing activations failed")


def _pages_of(req: Any, start: int, end: int, page_size: int) -> range:
    """Indices of the prompt's complete pages inside tokens [start, end)."""
    prompt = len(req.origin_input_ids)
    first = -(-start // page_size)
    last = min(end, prompt) // page_size
    return range(first, max(first, last))


class _Capture:
    """Attention inputs of the complete prompt pages an extend batch computes (see the module docstring)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, range, torch.Tensor]] = []  # (req, pages, rows of the batch)
        self.buf: Optional[torch.Tensor] = None
        self.last = -1

    def layer(self, layer_id: int, hidden: torch.Tensor, fb) -> None:
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        pool = get_token_to_kv_pool()
        first = getattr(pool, "start_layer", 0)
        if layer_id == first:
            self._start(fb, pool.page_size, pool.layer_num, hidden)
            self.last = first + pool.layer_num - 1
        if self.buf is None:
            return
        self.buf[layer_id - first] = hidden[self.rows]
        if layer_id == self.last:
            buf, jobs, self.buf = self.buf, self.jobs, None
            ps, at = pool.page_size, 0
            for req, pages, _ in jobs:
                keys = importance.page_keys(req, pages.stop * ps, ps)[pages.start :]
                n = len(pages) * ps
                _state.writer.submit(keys, buf[:, at : at + n])
                at += n

    def _start(self, fb, page_size: int, layers: int, hidden: torch.Tensor) -> None:
        self.jobs, self.buf = [], None
        by_rid = {r.rid: r for r in model_forward.batch_requests(fb)}
        offset = 0
        for i, rid in enumerate(fb.rids or []):
            prefix, ext = int(fb.extend_prefix_lens_cpu[i]), int(fb.extend_seq_lens_cpu[i])
            req = by_rid.get(rid)
            if req is not None and not getattr(req, "skip_radix_cache_insert", False):
                pages = _pages_of(req, prefix, prefix + ext, page_size)
                if len(pages):
                    rows = torch.arange(pages.start * page_size, pages.stop * page_size) - prefix + offset
                    self.jobs.append((req, pages, rows))
            offset += ext
        if self.jobs:
            self.rows = torch.cat([rows for _, _, rows in self.jobs])
            self.buf = torch.empty(layers, self.rows.shape[0], hidden.shape[-1], dtype=hidden.dtype)


_capture: Optional[_Capture] = None
_capture_errors = 0


def _around_attention(original, self, positions, hidden_states, forward_batch, *args, **kwargs):
    global _capture_errors
    mode = forward_batch.forward_mode
    if _capture is not None and _state.writer is not None and mode.is_extend() and not mode.is_target_verify():
        try:
            _capture.layer(self.attn.layer_id, hidden_states, forward_batch)
        except Exception:
            _capture_errors += 1
            _capture.buf = None
            metrics.count("hook_errors")
            if _capture_errors == 1:
                logger.exception("tiered kvpr: capturing activations failed; this batch stores none")
    return original(self, positions, hidden_states, forward_batch, *args, **kwargs)


# ---------------------------------------------------------------------------------------------- profile
def attach_tier(tier: SSDTier, itemsize: int, layout: str) -> None:
    """Called by the storage class once the tier is open: start storing activations (gate open or `force`) and
    measure the tier's read bandwidth in the background."""
    current = settings.current()
    if current is None or current.config.kvpr == "off" or _state.shape is None:
        return
    if _state.gate_reason is not None and current.config.kvpr == "auto":  # logged here: logging is set up by now
        logger.info("tiered kvpr: l = 0 for this model, no activations stored: %s", _state.gate_reason)
        return
    if layout != "layer_first":
        logger.warning("tiered kvpr: off: needs the layer_first host layout (per-layer reads), got %s", layout)
        return
    s = _state.shape
    _state.shape = Shape(s.layers, s.x_bytes * itemsize, s.kv_bytes * itemsize)
    _state.tier = tier
    _state.key = profile_key(current.model, tier.namespace.dtype)
    if _state.gate_reason is None or current.config.kvpr == "force":
        _state.writer = _Writer(tier)  # (the read bandwidth is measured at the first candidate load: at startup the
        #                                weights are still being read from the same disk)
        logger.info("tiered kvpr: %s: activations stored beside SSD pages (%.2fx the KV bytes)",
                    current.config.kvpr, s.x_bytes / s.kv_bytes)


def _measure_read(tier: SSDTier) -> None:
    try:
        _state.read_bps = measure_read(tier.root)
        logger.info("tiered kvpr: SSD read bandwidth %.0f MB/s (page cache bypassed)", _state.read_bps / 1e6)
    except OSError as exc:
        stored = stored_profile(tier.root, _state.key)
        logger.warning("tiered kvpr: cannot measure the SSD read bandwidth (%s); %s", exc,
                       "using the stored profile's" if stored else "KVPR stays off")
        if stored is not None:
            _state.read_bps = stored.read_bytes_per_s


def _start_measuring() -> None:
    """Measure the read bandwidth in the background, once (from the first request's admission on)."""
    if not _state.measuring:
        _state.measuring = True
        threading.Thread(target=_measure_read, args=(_state.tier,), name="tiered-kvpr-profile", daemon=True).start()


def _profile(scheduler) -> Optional[Profile]:
    """The measured profile, or None while the read bandwidth is being measured (until then SGLang loads as
    usual). The compute part is timed on the served model at the first call after that."""
    with _state.lock:
        if _state.profile is not None:
            return _state.profile
        if _state.read_bps is None:
            _start_measuring()
            return None
        engine = model_forward.engine_from_sglang(scheduler.tp_worker.model_runner.model.model)
        stored = stored_profile(_state.tier.root, _state.key)
        recompute_s, layer_s, stored_s = measure_compute(engine)
        if stored is not None and stored.stored_s > stored_s:  # calibrated by earlier loads of this model
            stored_s = stored.stored_s
        _state.profile = Profile(_state.read_bps, recompute_s, layer_s, stored_s)
        path = save_profile(_state.tier.root, _state.key, _state.profile, shape=_state.shape.__dict__)
        example = choose_split(4096 // _state.tier.namespace.page_size, _state.tier.namespace.page_size, 32,
                               _state.shape, _state.profile)
        logger.info("tiered kvpr: profile %s (saved to %s); a 4096-token prefix + 32 new tokens would split at "
                    "l = %d (%s)", describe(_state.profile), path, example.tokens, example.reason)
        return _state.profile


# ---------------------------------------------------------------------------------------------- admission
def request_mode(req) -> Any:
    mode = request_params(req).get(KVPR_PARAM)
    if mode in KVPR_MODES or (isinstance(mode, int) and not isinstance(mode, bool)):
        return mode
    current = settings.current()
    return current.config.kvpr if current is not None else "off"


def plan_load(scheduler, req, start: int, mode: Any) -> Optional[Plan]:
    """The load of `req`'s stored pages from token `start`, or None (SGLang loads them as usual)."""
    tier = _state.tier
    ps = tier.namespace.page_size
    if start % ps or model_forward.too_long_for_one_extend(scheduler, req, start) is not None:
        return None
    keys = importance.page_keys(req, len(req.origin_input_ids) - 1, ps)[start // ps :]
    n = 0
    while n < len(keys) and tier.contains(keys[n]) and tier.group_of(keys[n]) is None:
        n += 1
    if n * ps < settings.current().config.kvpr_min_tokens:
        return None
    acts = 0
    while acts < n and tier.contains(activations.activation_key(keys[acts])):
        acts += 1
    profile = _profile(scheduler)
    if profile is None:
        return None
    new = len(req.origin_input_ids) - start - n * ps
    split = choose_split(n, ps, new, _state.shape, profile, max_pages=acts)
    if mode == "auto":
        if _state.gate_reason is not None:
            return None
        baseline = sglang_load_time(n * ps, new, _state.shape, profile, _state.read_bps or profile.read_bytes_per_s)
        if not takes_over(split, baseline):
            return None  # SGLang's own load is as good
        pages = split.pages
        split = replace(split, reason=split.reason + f"; SGLang's load predicted {baseline:.3f}s")
    elif mode == "force":
        if acts == 0 or n < 2:
            return None
        pages = max(1, min(split.pages, acts, n - 1))
    else:  # a number of tokens
        pages = min(int(mode) // ps, acts, n)
    return Plan(start, tuple(keys[:n]), pages, split, str(mode))


def _around_prefetch(original, self, req, *args, **kwargs):
    if getattr(req, "tiered_kvpr", None) is not None:
        req.tiered_kvpr = None  # re-admitted (e.g. retracted): decided afresh
    if _state.tier is None:
        return original(self, req, *args, **kwargs)
    _start_measuring()
    mode = request_mode(req)
    if mode == "off" or REQUEST_CHUNKS in request_params(req) or sparse_load.request_mode(req) != "off":
        return original(self, req, *args, **kwargs)
    try:
        req.init_next_round_input(self.tree_cache, cow_mamba=False)
        plan = plan_load(self, req, req.prefix_len + req.host_hit_length, mode)
        if plan is not None:
            req.tiered_kvpr = plan
            return None  # no L3 prefetch: the stored pages are loaded by the forward
    except Exception:
        metrics.count("hook_errors")
        logger.exception("tiered kvpr: admission of rid %s failed; SGLang prefetches as usual", req.rid)
    return original(self, req, *args, **kwargs)


def is_planned(req) -> bool:
    return getattr(req, "tiered_kvpr", None) is not None


# ---------------------------------------------------------------------------------------------- forward
class KVPRHandler(model_forward.ForwardHandler):
    name = "kvpr"

    def build_runtime(self, module):
        return model_forward.engine_from_sglang(module)

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        reqs = [r for r in model_forward.batch_requests(fb) if is_planned(r)]
        if not reqs:
            return None
        req = reqs[0]
        plan: Plan = req.tiered_kvpr
        prefix = int(fb.extend_prefix_lens_cpu[0])
        why = model_forward.why_not_whole_prompt(fb, req)
        if why is None and prefix != plan.start:
            why = f"its cached prefix changed since admission ({plan.start} -> {prefix} tokens)"
        engine = self.runtime(module) if why is None else None
        if why is None and engine is None:
            why = f"disabled in this process: {self.disabled}"
        if why is None:
            try:
                return _load_forward(engine, req, fb, plan, sglang_rope(module))
            except SpanMiss as exc:
                why = f"stored span unreadable: {exc}"
        for r in reqs:
            r.tiered_kvpr = None
        self.fallback([r.rid for r in reqs], why + "; SGLang computes the span")
        return None


def sglang_rope(module):
    """The served model's own rotary kernels as an engine `Rope`: recomputed keys come out bit-identical to the
    keys SGLang stored (the engine's rotation differs from SGLang's CPU kernel by a bf16 ulp in ~40 % of the
    elements, enough to flip a near-tie greedy token)."""
    layers = module.layers

    def rope(layer: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        flat = k.reshape(k.shape[0], -1)
        _, rotated = layers[layer].self_attn.rotary_emb(positions, flat.clone(), flat.clone())
        return rotated.view_as(k)

    return rope


@torch.inference_mode()
def _load_forward(engine, req: Any, fb, plan: Plan, rope) -> torch.Tensor:
    t0 = time.perf_counter()
    c = engine.cfg
    tier = _state.tier
    ps = tier.namespace.page_size
    prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
    span = PageSpan(tier, plan.keys, layers=c.layers, page_size=ps, kv_heads=c.kv_heads, head_dim=c.head_dim,
                    hidden=c.hidden, dtype=engine.dtype, recompute_pages=plan.pages)
    try:
        s = span.tokens
        ids = torch.tensor(req.origin_input_ids[prefix + s : prefix + ext], dtype=torch.int64)
        res = kvpr_prefill(engine, ids, prefix_len=prefix, span=span, inputs=True, rope=rope,
                           prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None)
    finally:
        span.close()
    hidden = model_forward.write_extend(fb, engine, res.kv, res.hidden)
    new_pages = _pages_of(req, prefix + s, prefix + ext, ps)
    if len(new_pages) and _state.writer is not None:
        keys = importance.page_keys(req, new_pages.stop * ps, ps)[new_pages.start :]
        rows = slice(new_pages.start * ps - prefix - s, new_pages.stop * ps - prefix - s)
        _state.writer.submit(keys, res.inputs[:, rows].clone())
    observed = _observe_read(span.bytes_x + span.bytes_kv, res.load_s)
    observed += "; " + _observe_compute(time.perf_counter() - t0 - res.wait_s, res.recomputed, c.layers * (ext - s),
                                        c.layers * s)
    recomputed = res.recomputed // c.layers
    item = engine.dtype.itemsize
    saved = res.recomputed * (2 * c.kv_heads * c.head_dim - c.hidden) * item
    misses = span.act_missing + span.act_corrupt
    metrics.count("kvpr_loads")
    metrics.count("kvpr_tokens_recomputed", recomputed)
    metrics.count("kvpr_bytes_saved", max(0, saved))
    metrics.count("kvpr_activation_misses", misses)
    logger.info("tiered kvpr: rid %s loaded %d stored tokens (prefix=%d computed=%d mode=%s): recomputed l=%d "
                "(%d pages planned, %d activation pages missing/corrupt; model: %.3fs vs %.3fs full, %s), read "
                "%.1f MiB activations + %.1f MiB KV, waited %.3fs for reads (read path %s), total=%.3fs",
                req.rid, s, prefix, ext - s, plan.mode, recomputed, plan.pages, misses, plan.split.predicted_s,
                plan.split.full_s, plan.split.reason, span.bytes_x / 2**20, span.bytes_kv / 2**20, res.wait_s,
                observed, time.perf_counter() - t0)
    return hidden


_MIN_OBSERVED_BYTES = 8 << 20  # loads smaller than this say little about the bandwidth


def _observe_read(nbytes: int, seconds: float) -> str:
    """Fold a load's read rate (bytes over the loader thread's time: the read path as it really runs, readahead,
    checksums and copies included) into the profile: v = min(startup measurement, moving average of loads). The
    min keeps a burst or a page-cache-warm load from making the scheduler think the disk is faster than measured."""
    if nbytes < _MIN_OBSERVED_BYTES or seconds <= 0 or _state.profile is None:
        return "not updated"
    with _state.lock:
        rate = nbytes / seconds
        _state.observed = rate if _state.observed is None else 0.3 * rate + 0.7 * _state.observed
        v = min(_state.read_bps or _state.observed, _state.observed)
        _state.profile = replace(_state.profile, read_bytes_per_s=v)
    return f"{rate / 1e6:.0f} MB/s, v now {v / 1e6:.0f} MB/s"


def _observe_compute(busy_s: float, recomputed: int, new: int, stored: int) -> str:
    """Refit the compute stream's per-token costs (recompute, stored token) to this load's compute time
    (everything but waiting for reads; `policy.kvpr.Calibration`). Counts are token-layers."""
    if _state.profile is None or stored <= 0:
        return ""
    with _state.lock:
        _state.profile = _state.calibration.observe(_state.profile, busy_s, recomputed, new, stored)
        _state.loads += 1
        if _state.loads % 8 == 0:  # keep the calibration across restarts
            save_profile(_state.tier.root, _state.key, _state.profile, shape=_state.shape.__dict__)
        p = _state.profile
        return f"recompute now {p.recompute_s * 1e6:.2f} us, stored token-layer {p.stored_s * 1e6:.2f} us"


# ---------------------------------------------------------------------------------------------- registration
def register_hooks() -> bool:
    """In scheduler processes of a CPU server with `--tiered-kvpr auto|force`."""
    global _capture
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = settings.current()
    if current is None or current.config.kvpr == "off" or not current.cpu_only:
        return False
    try:
        from sglang_tiered.engine.llama import LlamaConfig

        cfg = LlamaConfig.from_hf(current.model_path)
    except (OSError, KeyError, ValueError, NotImplementedError) as exc:
        logger.info("tiered kvpr: off (%s)", exc)
        return False
    _state.shape = Shape(cfg.layers, cfg.hidden, 2 * cfg.kv_heads * cfg.head_dim)  # elements; bytes at attach
    _state.gate_reason = gate(_state.shape)
    if _state.gate_reason is not None and current.config.kvpr == "auto":
        return False  # attach_tier says why
    _capture = _Capture()
    HookRegistry.register("sglang.srt.models.llama.LlamaAttention.forward", _around_attention, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", _around_prefetch,
                          HookType.AROUND)
    model_forward.track_batches()
    model_forward.prefill_alone(is_planned)
    model_forward.add_handler(KVPRHandler())
    return True
