"""Compute-or-load of stored spans in the server (`--tiered-kvpr`, exact; CPU servers, CUDA ones as a preview): a stored
span's front is computed from its token ids while its back is loaded -- as KV or, on models where that is smaller, as
stored activations from which K and V are recomputed (KVPR). The meet itself: `engine/meet.py`; the decision whether
to start it: `policy/kvpr.decide`.

* Admission -- a loader at the door (`door.py`, after gated sparse loading): a request whose prompt continues, after
  its device + host match, with at least `--tiered-kvpr-min-tokens` of plain pages on SSD. Under `auto` the decision
  (from the read rate and the compute profile) is `LOAD` (SGLang's own load: nothing changes), `COMPUTE` (SGLang's
  forward computes the span: its L3 prefetch is skipped) or `MEET`; `force` always meets; a number of tokens
  (`custom_params.tiered_kvpr`) forces the meet point. A taken request prefills alone; its KV is exact, so it enters
  the radix tree as usual.
* Forward -- `KVPRHandler` on the Llama forward hook runs `meet_prefill` over `engine.page_span.TierPages` with the
  server's own RoPE kernel. Anything unexpected (a batch of several, a chunked piece, a KV page gone or corrupt)
  leaves the batch to SGLang's forward, which computes the stored tokens (exact; logged and counted). A missing or
  corrupt activation page is read as that page's KV (counted).
* Activations -- where the attention input is smaller than the KV it replaces (MHA models; `policy/kvpr.gate`), seam
  `models.llama.LlamaAttention.forward` (AROUND, read-only) copies each layer's attention input for the complete
  prompt pages an extend computes; one background thread writes them beside their KV pages (kind "activation" in
  the tier's one budget; a full queue drops a batch's, counted).
* Rates -- the read rate is seeded by a probe at the first admission (64 MiB with O_DIRECT, counted against the SSD
  capacity) and follows every load's reads, ours and SGLang's (`policy/read_rate.py`); the compute profile is
  measured at that admission on the scheduler's thread (it is SGLang's warmup request, before the server reports
  ready) and saved (`sglang-tiered kvpr-profile`), once per machine, model, dtype and page size: a
  restart uses the saved one. Until both are known SGLang loads as usual (a forced load waits for the rate).

Counters `sglang_tiered:kvpr_*_total`: loads, tokens_computed, tokens_loaded, tokens_recomputed, bytes_saved,
activation_misses, activation_pages_written, activation_bytes_written, activation_drops, fallbacks, computed_spans,
read_samples. One log line per load with the meet point, one when the read rate moves by more than a quarter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang_tiered.config import CUDA_PREVIEW_ENV
from sglang_tiered.engine.kvpr_profile import (
    PROBE_BYTES,
    PROFILE_FILE,
    StoredProfile,
    describe,
    measure_profile,
    measure_read,
    profile_key,
    save_profile,
    stored_entry,
)
from sglang_tiered.engine.llama import LlamaConfig
from sglang_tiered.engine.meet import meet_prefill
from sglang_tiered.engine.page_span import TierPages
from sglang_tiered.engine.scratch import KVScratch
from sglang_tiered.integration import faults, model_forward
from sglang_tiered.integration.door import SpanHandler, planned
from sglang_tiered.integration.keys import page_keys
from sglang_tiered.integration.requests import options
from sglang_tiered.policy.kvpr import COMPUTE, LOAD, MEET, MEET_CHUNK_PAGES, Profile, Shape, decide, gate, page_read_s
from sglang_tiered.policy.read_rate import ReadRate
from sglang_tiered.storage import activations
from sglang_tiered.storage.ssd_tier import SSDTier

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime, Store

logger = logging.getLogger("sglang_tiered")

_WRITE_QUEUE = 8  # batches of activations waiting to be written
_MIN_PROBE_BYTES = 1 << 20  # a read-bandwidth probe smaller than this says nothing (then the stored profile is used)
PROFILE_WAIT_S = 60.0  # the longest a forced load waits for the read bandwidth being measured (64 MiB at 1 MB/s)


@dataclass(frozen=True)
class Plan:
    """A load decided at admission: the stored pages `keys` from token `start`, the way they come in (`MEET`, or
    `COMPUTE`: SGLang's forward), the forced meet point in pages (`split`; None: found at run time), whether the
    loader reads activations, and the estimates the meet starts from (seconds per computed / read page)."""

    start: int
    keys: tuple[str, ...]
    mode: str  # the request's mode and, under auto, the way decided ("auto: meet")
    way: str = MEET
    split: Optional[int] = None
    activations: bool = False
    page_s: float = 0.0
    read_s: float = 0.0


class KVPR:
    """This process's compute-or-load: the door's loader, the activation capture and writer, the read rate and the
    compute profile."""

    name = "kvpr"

    def __init__(self, rt: Runtime, cfg: LlamaConfig, shape: Shape, gate_reason: Optional[str]) -> None:
        self.rt, self.cfg = rt, cfg
        self.handler = KVPRHandler(rt, self)
        self.capture = _Capture(self)
        self.shape = shape  # elements until `attach`, then bytes
        self.gate_reason = gate_reason
        self.tier: Optional[SSDTier] = None
        self.writer: Optional[_Writer] = None
        self.rate: Optional[ReadRate] = None
        self.profile: Optional[Profile] = None
        self.stored: Optional[StoredProfile] = None  # what an earlier start on this machine measured (`attach`)
        self.read_measured = threading.Event()  # set once the read bandwidth is measured (or could not be)
        self.measuring = self.compute_failed = self.saved = False
        self.measured_s: Optional[float] = None  # how long this process's measurement of the profile took
        self.key = ""
        self.lock = threading.Lock()
        self.scratch = KVScratch()  # the loads' KV, one buffer kept
        self._logged_bps = 0.0
        self._capture_errors = 0

    def attach(self, store: Store, itemsize: int, layout: str) -> None:
        """The store is open (`Runtime.on_store`): start storing activations (gate open or `force`)."""
        mode = self.rt.settings.config.kvpr
        if layout != "layer_first":
            logger.warning("tiered kvpr: off: needs the layer_first host layout (per-layer reads), got %s", layout)
            return
        s = self.shape
        self.shape = Shape(s.layers, s.x_bytes * itemsize, s.kv_bytes * itemsize)
        self.tier = tier = store.tier
        device = torch.device("cpu") if self.rt.settings.cpu_only else torch.device("cuda", torch.cuda.current_device())
        self.key = profile_key(self.rt.settings.model, tier.namespace.dtype, tier.namespace.page_size, device)
        self.stored = stored = stored_entry(tier.root, self.key)
        if stored is not None:  # a restart on this machine: the scheduler is not blocked to measure it again
            self.profile = stored.profile
            logger.info("tiered kvpr: compute profile measured %s on this machine for this model, dtype and page "
                        "size, not measured again: %s (from %s: deleted while the server is stopped, the next start "
                        "measures again)", stored.measured_at, describe(self.profile), tier.root / PROFILE_FILE)
        if self.gate_reason is not None and mode == "auto":
            logger.info("tiered kvpr: no activations stored for this model: %s; a stored span behind slow storage "
                        "has its front computed from token ids while its back loads", self.gate_reason)
            return
        self.writer = _Writer(self)
        logger.info("tiered kvpr: %s: activations stored beside SSD pages (%.2fx the KV bytes)", mode,
                    s.x_bytes / s.kv_bytes)

    # ------------------------------------------------------------------------------------- loader (door.py)
    def admit(self, scheduler, req) -> None:
        """The first admission -- SGLang's warmup request, before the server reports ready -- starts the read probe
        on a thread of its own and measures the compute profile (unless a stored one applies) on the scheduler's
        thread, which runs the forwards: no client request waits for it (with `--skip-server-warmup` the first
        one does)."""
        if self.tier is None or self.measuring:
            return
        self.measuring = True
        threading.Thread(target=self._measure_read, name="tiered-kvpr-probe", daemon=True).start()
        self._measure_compute(scheduler)

    def wants(self, req) -> bool:
        return self.tier is not None and self.mode(req) != "off"

    def mode(self, req) -> Any:
        mode = options(req).kvpr
        return self.rt.settings.config.kvpr if mode is None else mode

    def plan(self, scheduler, req, start: int) -> Optional[Plan]:
        """The load of `req`'s stored pages from token `start`, or None (SGLang loads them as usual)."""
        tier, mode = self.tier, self.mode(req)
        ps = tier.namespace.page_size
        if start % ps or model_forward.too_long_for_one_extend(scheduler, req, start) is not None:
            return None
        keys = page_keys(req, len(req.origin_input_ids) - 1, ps)[start // ps :]
        n = 0
        while n < len(keys) and tier.contains(keys[n]) and tier.group_of(keys[n]) is None:
            n += 1
        if n == 0 or n * ps < self.rt.settings.config.kvpr_min_tokens:
            return None
        if mode != "auto" and self.rate is None:  # asked for by name: wait for the read rate
            self.read_measured.wait(PROFILE_WAIT_S)
        if self.profile is None or self.rate is None:
            if mode != "auto":
                self.handler.fallback([req.rid], "no measured profile (see the `tiered kvpr:` lines); SGLang loads "
                                      "the stored prefix")
            return None
        stored_x = self.writer is not None
        d = decide(n, ps, self.shape, self.rate.bps, self.profile, stored_activations=stored_x)
        keys_n = tuple(keys[:n])
        if mode == "auto":
            if d.way == LOAD:
                return None
            return Plan(start, keys_n, f"auto: {d.way}", d.way, None, d.activations, d.page_s, d.read_s)
        x = stored_x  # (a forced load reads activations wherever stored)
        read_s = page_read_s(self.shape, ps, self.rate.bps, self.profile.recompute_s, x)
        split = None if mode == "force" else min(n, int(mode) // ps)
        return Plan(start, keys_n, str(mode), MEET, split, x, self.profile.page_s, read_s)

    def span_pages(self, plan: Plan, dtype: torch.dtype) -> TierPages:
        """The plan's stored pages as the loader reads them, in `dtype`."""
        c = self.cfg
        return TierPages(self.tier, plan.keys, layers=c.layers, page_size=self.tier.namespace.page_size,
                         kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=dtype, hidden=c.hidden,
                         activations=plan.activations)

    # ------------------------------------------------------------------------------------- rates
    def _measure_read(self) -> None:
        tier = self.tier
        room = min(PROBE_BYTES, tier.capacity_bytes // 8)
        try:
            faults.check("kvpr_probe")
            if room < _MIN_PROBE_BYTES:
                raise OSError(f"a capacity of {tier.capacity_bytes} bytes leaves no room for a probe file")
            with tier.meta.scratch(".kvpr-read-probe", room) as path:
                if path is None:
                    raise OSError("no room under the SSD capacity for a probe file")
                bps = measure_read(path, room)
            if bps <= 0:
                raise OSError("the probe file read back empty")
            logger.info("tiered kvpr: SSD read bandwidth %.0f MB/s (page cache bypassed)", bps / 1e6)
        except (OSError, faults.InjectedFault) as exc:
            stored = self.stored
            logger.warning("tiered kvpr: cannot measure the SSD read bandwidth (%s); %s", exc,
                           "using the stored profile's" if stored else "compute-or-load stays off")
            bps = stored.read_bytes_per_s if stored else 0.0
        with self.lock:
            if bps > 0:
                self.rate, self._logged_bps = ReadRate(bps), bps
        self.read_measured.set()
        self._save()

    def _measure_compute(self, scheduler) -> None:
        """Time the served model's compute (once: a failure leaves SGLang loading every span)."""
        if self.profile is not None or self.compute_failed:
            return
        t0 = time.perf_counter()
        try:
            faults.check("kvpr_chunks")
            engine = self.rt.forward.engine(scheduler.tp_worker.model_runner.model.model)
            profile = measure_profile(engine, self.tier.namespace.page_size)
        except Exception:  # noqa: BLE001 -- no profile: SGLang keeps loading every stored span
            self.compute_failed = True
            self.rt.events.count("hook_errors")
            logger.exception("tiered kvpr: measuring the compute profile failed; SGLang loads every stored span")
            return
        with self.lock:
            self.profile, self.measured_s = profile, time.perf_counter() - t0
        logger.info("tiered kvpr: profile measured in %.1f s: %s (kept in %s for restarts)", self.measured_s,
                    describe(profile), self.tier.root / PROFILE_FILE)
        self._save()

    def _save(self) -> None:
        """Save the profile this process measured with the read rate, once both are known (whichever comes last)."""
        with self.lock:
            if self.saved or self.measured_s is None or not self.read_measured.is_set():
                return
            self.saved, profile, bps = True, self.profile, self.rate.bps if self.rate is not None else 0.0
        kept = save_profile(self.tier.root, self.key, profile, read_bytes_per_s=bps, shape=self.shape.__dict__,
                            page_size=self.tier.namespace.page_size,
                            write=lambda data: self.tier.meta.write(PROFILE_FILE, data))
        if not kept:
            logger.warning("tiered kvpr: the profile could not be kept in %s (no room under the SSD capacity, or "
                           "the write failed); the next start measures it again", self.tier.root / PROFILE_FILE)

    def observe_read(self, nbytes: int, seconds: float) -> str:
        """Fold a load's reads into the read rate -- our loader's and SGLang's own (`TieredSSDStorage.batch_get_v1`,
        its prefetch thread); what the log line says of it."""
        with self.lock:
            if self.rate is None or not self.rate.observe(nbytes, seconds):
                return "not updated"
            bps, samples = self.rate.bps, self.rate.samples
            moved = abs(bps - self._logged_bps) > 0.25 * self._logged_bps
            if moved:
                self._logged_bps = bps
        self.rt.events.count("kvpr_read_samples")
        if moved:
            logger.info("tiered kvpr: read rate now %.0f MB/s (%d loads since the probe)", bps / 1e6, samples)
        return f"{nbytes / seconds / 1e6:.0f} MB/s, the rate now {bps / 1e6:.0f} MB/s"

    # ------------------------------------------------------------------------------------- activation capture
    def around_attention(self, original, attn_module, positions, hidden_states, forward_batch, *args, **kwargs):
        mode = forward_batch.forward_mode
        if self.writer is not None and mode.is_extend() and not mode.is_target_verify():
            try:
                self.capture.layer(attn_module.attn.layer_id, hidden_states, forward_batch)
            except Exception:
                self._capture_errors += 1
                self.capture.buf = None
                self.rt.events.count("hook_errors")
                if self._capture_errors == 1:
                    logger.exception("tiered kvpr: capturing activations failed; this batch stores none")
        return original(attn_module, positions, hidden_states, forward_batch, *args, **kwargs)


# ---------------------------------------------------------------------------------------------- activations
class _Writer:
    """One background thread writing activation pages (keys, [layers, pages * page_size, hidden] host tensor)."""

    def __init__(self, kvpr: KVPR) -> None:
        self.tier, self.events = kvpr.tier, kvpr.rt.events
        self.jobs: queue.Queue = queue.Queue(_WRITE_QUEUE)
        threading.Thread(target=self._run, name="tiered-kvpr-write", daemon=True).start()

    def submit(self, keys: list[str], x: torch.Tensor) -> None:
        try:
            self.jobs.put_nowait((keys, x))
        except queue.Full:
            self.events.count("kvpr_activation_drops", len(keys))

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
                written = sum(self.tier.write_pages(pages, kind="activation"))
                self.events.count("kvpr_activation_pages_written", written)
                self.events.count("kvpr_activation_bytes_written", written * x[:, :ps].numel() * x.element_size())
            except Exception:
                self.events.count("hook_errors")
                logger.exception("tiered kvpr: writing activations failed")


def _pages_of(req: Any, start: int, end: int, page_size: int) -> range:
    """Indices of the prompt's complete pages inside tokens [start, end)."""
    prompt = len(req.origin_input_ids)
    first = -(-start // page_size)
    last = min(end, prompt) // page_size
    return range(first, max(first, last))


class _Capture:
    """Attention inputs of the complete prompt pages an extend batch computes (see the module docstring)."""

    def __init__(self, kvpr: KVPR) -> None:
        self.kvpr = kvpr
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
                keys = page_keys(req, pages.stop * ps, ps)[pages.start :]
                n = len(pages) * ps
                self.kvpr.writer.submit(keys, buf[:, at : at + n])
                at += n

    def _start(self, fb, page_size: int, layers: int, hidden: torch.Tensor) -> None:
        self.jobs, self.buf = [], None
        for x in self.kvpr.rt.forward.extends(fb):
            if x.req is not None and not getattr(x.req, "skip_radix_cache_insert", False):
                pages = _pages_of(x.req, x.prefix, x.prefix + x.length, page_size)
                if len(pages):
                    rows = torch.arange(pages.start * page_size, pages.stop * page_size) - x.prefix + x.row
                    self.jobs.append((x.req, pages, rows))
        if self.jobs:
            self.rows = torch.cat([rows for _, _, rows in self.jobs])
            self.buf = torch.empty(layers, self.rows.shape[0], hidden.shape[-1], dtype=hidden.dtype)


# ---------------------------------------------------------------------------------------------- forward
class KVPRHandler(SpanHandler):
    name = "kvpr"

    def __init__(self, rt: Runtime, kvpr: KVPR) -> None:
        super().__init__(rt)
        self.kvpr = kvpr

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        """A span planned for SGLang's forward (`COMPUTE`) is left to it, counted and logged; the rest loads."""
        for req in self.rt.forward.batch_requests(fb):
            plan = planned(req, self.name)
            if plan is not None and plan.way == COMPUTE:
                self.rt.events.count("kvpr_computed_spans")
                logger.info("tiered kvpr: rid %s: SGLang's forward computes the %d stored tokens (prefix=%d "
                            "mode=%s)", req.rid, len(plan.keys) * self.kvpr.tier.namespace.page_size, plan.start,
                            plan.mode)
                return None
        return super().forward(module, input_ids, positions, fb)

    def check(self, fb, req, plan: Plan) -> tuple[Optional[str], Plan]:
        prefix = int(fb.extend_prefix_lens_cpu[0])
        if prefix != plan.start:
            return f"its cached prefix changed since admission ({plan.start} -> {prefix} tokens)", plan
        return None, plan

    @torch.inference_mode()
    def load(self, engine, module, req, fb, plan: Plan) -> torch.Tensor:
        """The span's front prefilled from its token ids while its back is read (engine/meet.py)."""
        t0 = time.perf_counter()
        kvpr, events = self.kvpr, self.rt.events
        ps = kvpr.tier.namespace.page_size
        prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
        source = kvpr.span_pages(plan, engine.dtype)
        s = source.pages * ps
        ids = torch.tensor(req.origin_input_ids[prefix : prefix + ext], dtype=torch.int64)
        out = kvpr.scratch.take(engine, prefix + ext)  # (the cached prefix's KV too: attention reads it in place)
        res = meet_prefill(engine, ids[:s], ids[s:], prefix_len=prefix, source=source, split=plan.split,
                           chunk=MEET_CHUNK_PAGES, page_compute_s=plan.page_s or None, page_read_s=plan.read_s,
                           rope=sglang_rope(module), inputs=kvpr.writer is not None,
                           prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None, out=out)
        t_write = time.perf_counter()
        hidden = model_forward.write_extend(fb, engine, res.kv, res.hidden)
        write_s = time.perf_counter() - t_write
        if res.loaded_pages and not req.retracted_stain:  # read, not computed: reported as SGLang reports its own
            req.cached_tokens += res.loaded_pages * ps      # L3 hits (meta_info.cached_tokens_details, /metrics)
            req.cached_tokens_storage += res.loaded_pages * ps
        new_pages = _pages_of(req, prefix + s, prefix + ext, ps)
        if len(new_pages) and res.inputs is not None:  # the new tokens' activations, as SGLang's forward would store
            keys = page_keys(req, new_pages.stop * ps, ps)[new_pages.start :]
            rows = slice(new_pages.start * ps - prefix - s, new_pages.stop * ps - prefix - s)
            kvpr.writer.submit(keys, res.inputs[:, rows].to("cpu", copy=True))  # (the writer needs host memory)
        read = kvpr.observe_read(source.bytes_read, source.read_s) if res.loaded_pages else "nothing read"
        computed, loaded, recomputed = res.computed_pages * ps, res.loaded_pages * ps, res.recomputed_pages * ps
        events.count("kvpr_loads")
        events.count("kvpr_tokens_computed", computed)
        events.count("kvpr_tokens_loaded", loaded)
        events.count("kvpr_tokens_recomputed", recomputed)
        events.count("kvpr_bytes_saved", max(0, recomputed * kvpr.shape.layers * (kvpr.shape.kv_bytes -
                                                                                  kvpr.shape.x_bytes)))
        events.count("kvpr_activation_misses", source.act_misses)
        logger.info("tiered kvpr: rid %s loaded %d stored tokens (prefix=%d computed=%d mode=%s): met at page %d of "
                    "%d: front %d tokens computed from token ids in %.3fs (chunks %s), back %d tokens read in %.3fs "
                    "(%d from activations, %.1f MiB; %d KV, %.1f MiB; %d activation pages missing/corrupt; reads "
                    "%s), waited %.3fs at the meet, the new tokens' layers %.3fs, the write into SGLang's pool "
                    "%.3fs, total=%.3fs",
                    req.rid, s, prefix, ext - s, plan.mode, res.computed_pages, source.pages, computed, res.compute_s,
                    ", ".join(f"{k} at {at:.3f}s in {took:.3f}s" for at, k, took in res.chunks) or "none", loaded,
                    res.load_s, recomputed, source.bytes_x / 2**20, loaded - recomputed, source.bytes_kv / 2**20,
                    source.act_misses, read, res.wait_s, res.new_s, write_s, time.perf_counter() - t0)
        return hidden


def sglang_rope(module):
    """The served model's own rotary kernels as an engine `Rope`: recomputed keys come out bit-identical to the
    keys SGLang stored (the engine's rotation differs from SGLang's CPU kernel by a bf16 ulp in ~40 % of the
    elements, enough to flip a near-tie greedy token). A layer's queries and keys in one call, as SGLang's forward
    rotates them (two calls, one per tensor, cost 22 against 11 ms per 192 tokens over SmolLM2's 30 layers); the
    kernel may rotate in place, so it gets copies (of the keys twice where there are no queries)."""
    layers = module.layers

    def rope(layer: int, q: Optional[torch.Tensor], k: torch.Tensor, positions: torch.Tensor):
        keys = k.reshape(k.shape[0], -1).clone()
        queries = q.reshape(q.shape[0], -1).clone() if q is not None else keys.clone()
        queries, keys = layers[layer].self_attn.rotary_emb(positions, queries, keys)
        return (queries.view_as(q) if q is not None else None), keys.view_as(k)

    return rope


# ---------------------------------------------------------------------------------------------- registration
def register_hooks(rt: Runtime) -> bool:
    """In scheduler processes of a server with `--tiered-kvpr auto|force` (on CUDA only with config.CUDA_PREVIEW_ENV
    set): the door's loader (after gated sparse loading), the activation capture and a forward handler."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = rt.settings
    if current is None or current.config.kvpr == "off":
        return False
    if not (current.cpu_only or current.cuda_preview):
        logger.info("tiered kvpr: off on this CUDA server (slower than recomputing on an H200; %s=1 runs it)",
                    CUDA_PREVIEW_ENV)
        return False
    try:
        cfg = LlamaConfig.from_hf(current.model_path)
    except (OSError, KeyError, ValueError, NotImplementedError) as exc:
        logger.info("tiered kvpr: off (%s)", exc)
        return False
    shape = Shape(cfg.layers, cfg.hidden, 2 * cfg.kv_heads * cfg.head_dim)  # elements; bytes at attach
    kvpr = KVPR(rt, cfg, shape, gate(shape))
    if kvpr.gate_reason is None or current.config.kvpr == "force":  # activations stored
        HookRegistry.register("sglang.srt.models.llama.LlamaAttention.forward", kvpr.around_attention,
                              HookType.AROUND)
    rt.door.add(kvpr)
    rt.forward.add_handler(kvpr.handler)
    rt.on_store.append(kvpr.attach)
    rt.on_read.append(kvpr.observe_read)
    return True
