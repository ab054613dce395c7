"""Compute-or-load of stored spans in the server (`--tiered-kvpr`, exact, CPU servers): a stored span's front is
computed from its token ids while its back is loaded -- as KV, or, on models where that is smaller, as stored
activations from which K and V are recomputed (KVPR). One scheduler for all of it: `engine/meet.py`.

* Admission -- a loader at the door (`door.py`, after gated sparse loading): for a request whose prompt continues,
  after its device + host match, with at least `--tiered-kvpr-min-tokens` of plain pages on SSD, `plan` decides
  (`decide`), from the measured `Profile` (`policy/kvpr.py`; compute priced as the server's loads measured it beside
  their loader, `observe_chunks`), whether the loader reads pages as activations
  (`activations_pay`; wherever stored when the request or server forces a load), and in `auto` whether to take the
  span at all: only where reading it takes longer than computing 2 of its pages (`meet_pays`), else SGLang's own load
  is as fast. Compute joins a load only while a page reads in at least `MEET_MIN_READ_SHARE` of a page's compute
  (an activation load on two threads: only where compute beside one thread would be faster -- by 25 % until compute's
  slowdown beside such loads is measured, by `MEET_PRICED_MARGIN` once it is -- `Decision.join_share`). A
  number of tokens (`custom_params.tiered_kvpr`) forces the meet point. Where SGLang's load would be as fast at idle,
  a request admitted right after another request's prefill forward still goes to our loader (`behind_prefills` in
  policy/load_choice.py: SGLang's load would wait for the next such forward), unless our loader was measured slower
  on such spans by more than that forward took; with `--tiered-kvpr-choice measured` (the default), the load
  measured faster takes the rest -- at idle, or among other requests' decodes on samples taken among decodes
  (`rule`: SGLang's); such spans, where compute would not gain, are read by the loader alone (the meet point forced
  to 0). Where compute would gain (`Decision.take`), `auto` takes the way measured fastest of three
  (`policy/compute_choice.py`: each way's forwards timed against the profile's estimates, `observe_forward`): the
  two meeting, the loader alone (the meet point forced to 0), or SGLang's own forward computing the whole span (mode
  `compute` asks for that). A taken span's L3 prefetch is skipped: its tokens become extend
  tokens, filled by the forward below. The request prefills alone and its KV is exact, so it enters the radix tree as
  usual. From admission on, while the request waits for its forward, one background thread reads the pages the loader
  would read, last first (`engine/early_reads.py`, at most --tiered-kvpr-early-memory for all queued loads): as KV
  where the request waits for another forward first -- the next piece of another request's chunked prefill, or the
  batch of requests admitted before it (`wait_ahead_s`) -- where that leaves the forward less to do than reading
  activations would (`policy/kvpr.early_as_kv`: placing KV is a copy, activations a recompute; what the wait does
  not read in is the forward's), else as the plan reads them. The forward takes them (the page in flight too) and
  reads the rest; a plan not followed (a fallback, a re-admission) drops them, and ones not taken EARLY_HOLD_S after
  admission are dropped at the next start (counted). Earlier still, a request sent during a prefill forward may
  have had its span's files read into the page cache by the launcher (integration/arrival.py,
  marked `custom_params.tiered_arrival_reads`): its plan reads a page whose KV is in the page cache as KV, and its
  load is no sample of the read rate, of compute's slowdown beside the loader or of its way's time. So is a span
  whose last pages the plan finds in the page cache (`_warm`: probed from the back, nothing read; every mode); under
  `auto` its cached KV is read as KV and, where the cold pages left would read faster than computing MEET_MIN_PAGES
  pages, the loader takes it alone (policy/kvpr.warm_alone: compute's first chunk would outlast the read).
* Forward -- `KVPRHandler` on the Llama forward hook: `engine.meet.meet_prefill` over `engine.page_span.TierPages`
  (compute prefills pages from the front while one thread reads whole pages from the back; they meet where the
  disk's and the CPU's speeds at that moment put the point), with the server's own RoPE kernel. Anything unexpected
  (a batch of several, a chunked piece, a KV page gone or corrupt, a request our engine cannot compute) leaves the
  batch to SGLang's forward, which then computes the stored tokens (exact, slower; logged and counted). A missing
  or corrupt activation page is read as that page's KV (counted).
* Gate -- at startup, from config.json: activations pay only where the attention input (hidden) is smaller than
  the KV it replaces (2 x kv_heads x head_dim). Closed (GQA models such as SmolLM2): `auto` stores none (the reason
  is logged once); spans still load two-sided.
* Activations -- seam `models.llama.LlamaAttention.forward` (AROUND, read-only): for every extend batch, the
  attention input of each layer (post-RMSNorm, so the recompute needs no norm) is copied for the complete prompt
  pages the forward computes (and our loader hands over the new tokens' own), and written to the SSD tier beside
  their KV pages (storage/activations.py; kind "activation" in the tier's one budget, leaving with their KV page)
  by one background thread (a full queue drops the batch's activations, counted).
* Profile -- measured once per process: the SSD read bandwidth on a background thread from the first admission
  on (SGLang's warm-up request: the weights are in memory by then, no longer being read from the same disk; the
  probe file counts against the SSD capacity, smaller where it leaves less room), then K/V recompute, layer and
  computed-chunk times (one page, then 4, as one chunk each: about 1 s) on the served model at the scheduler's first
  fully idle moment after that (seam `Scheduler.on_idle`,
  BEFORE: on the thread that runs the forwards; `engine/kvpr_profile.py`, persisted; taken again PROFILE_RETRY_S
  later where its layer time disagrees with its whole-load time, `Unsettled`). Until it is known SGLang
  loads as usual (a forced load waits for it). The probe only seeds the read rate: every load's reads -- ours and
  SGLang's own -- fold into it, both ways (`policy/read_rate.py`). The meet itself follows the speeds of the
  moment; the profile only decides whether to start it.

Counters: `sglang_tiered:kvpr_loads_total`, `..._kvpr_tokens_computed_total` (span tokens computed from token ids),
`..._kvpr_tokens_loaded_total` (read, as KV or activations), `..._kvpr_tokens_recomputed_total` (of those, from
activations), `..._kvpr_bytes_saved_total` (KV bytes not read minus activation bytes read),
`..._kvpr_activation_misses_total` (activation pages missing or corrupt: read as KV),
`..._kvpr_activation_pages_written_total`, `..._kvpr_activation_bytes_written_total`,
`..._kvpr_activation_drops_total`, `..._kvpr_fallbacks_total`, `..._kvpr_read_samples_total`,
`..._kvpr_choice_behind_prefills_total` (spans taken behind other prefills), `..._kvpr_choice_sglang_gives_up_total`
(spans taken because SGLang's prefetch would give up on them), `..._kvpr_computed_spans_total` (spans left whole
to SGLang's forward), `..._kvpr_alone_spans_total` (spans given the loader alone by the three-way choice),
`..._kvpr_forward_samples_total`, `..._kvpr_early_pages_total` (pages read before the forward),
`..._kvpr_early_expired_total` (early reads no forward took within EARLY_HOLD_S); one log line per load with the
meet point (or naming SGLang's forward), one when the read rate moves by more than a quarter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang_tiered.config import parse_size
from sglang_tiered.engine.early_reads import EarlyJob, EarlyReader
from sglang_tiered.engine.kvpr_profile import (
    PROBE_BYTES,
    PROFILE_FILE,
    ProfileTries,
    Unsettled,
    describe,
    measure_chunks,
    measure_compute,
    measure_read,
    profile_key,
    save_profile,
    stored_profile,
)
from sglang_tiered.engine.llama import LlamaConfig
from sglang_tiered.engine.meet import meet_prefill
from sglang_tiered.engine.page_span import TierPages
from sglang_tiered.engine.scratch import KVScratch
from sglang_tiered.integration import faults, model_forward
from sglang_tiered.integration.door import SpanHandler, matched, planned
from sglang_tiered.integration.keys import page_keys
from sglang_tiered.integration.load_timing import LoadTiming
from sglang_tiered.integration.requests import ARRIVAL_PARAM, KVPR_MODES, KVPR_PARAM, request_params
from sglang_tiered.policy.compute_choice import ALONE, COMPUTE, LOADS, MEET, Estimates
from sglang_tiered.policy.kvpr import (
    MEET_CHUNK_PAGES,
    MEET_LOADERS,
    MEET_MIN_READ_SHARE,
    Decision,
    Profile,
    Shape,
    Slowdown,
    alone_page_s,
    auto_example,
    beside,
    chunk_page_s,
    chunk_slowdown,
    decide,
    early_as_kv,
    forward_s,
    gate,
    meet_s,
    reads_as_auto,
    route,
    warm_alone,
)
from sglang_tiered.policy.load_choice import OURS, LoadChoice, behind_prefills, prefetch_gives_up
from sglang_tiered.policy.read_rate import ReadRate, moving_average
from sglang_tiered.storage import activations
from sglang_tiered.storage.ssd_tier import SSDTier

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")

_WRITE_QUEUE = 8  # batches of activations waiting to be written
_MIN_PROBE_BYTES = 1 << 20  # a read-bandwidth probe smaller than this says nothing (then the stored profile is used)
PROFILE_WAIT_S = 60.0  # the longest a forced load waits for the read bandwidth being measured (64 MiB at 1 MB/s)
PROFILE_TRIES = 3  # compute profiles taken at most where they disagree with themselves (kvpr_profile.Unsettled)
PROFILE_RETRY_S = 5.0  # ... each this long after the one before (what slowed it has likely ended)
EARLY_HOLD_S = 60.0  # pages read early and not taken by a forward this long after admission are dropped


@dataclass(frozen=True)
class Plan:
    """A load decided at admission: the stored pages `keys` from token `start`. `pages`: the forced meet point (the
    pages computed from token ids; None lets compute and the loader meet); `page_s`, `chunk_s` and `read_s`: the
    profile's estimates of what a page adds to a computed chunk, what a chunk takes whatever its length, and one
    page's read; `activations`: the loader reads pages as activations where stored (else as KV)."""

    start: int
    keys: tuple[str, ...]
    mode: str
    pages: Optional[int]
    page_s: float
    read_s: float
    activations: bool
    chunk_s: float = 0.0
    loaders: int = 1  # threads reading pages at once (policy/kvpr.loaders)
    as_auto: bool = True  # it reads pages as `auto` would (activations or KV): a whole read is a sample of our loader
    join_share: float = MEET_MIN_READ_SHARE  # compute joins while a page comes in every this share of a page's
    #                                          compute or slower (policy/kvpr.Decision.join_share)
    slowdown: float = 1.0  # compute's estimates are the profile's times this (compute beside a loader, measured)
    way: Optional[str] = None  # the way of policy/compute_choice.py it takes (COMPUTE: SGLang's own forward computes
    #                            the span; MEET, ALONE: its forward is a sample of that way); None: not one of them
    estimate_s: float = 0.0  # the profile's seconds for this load's forward, the way's sample once run (0: none)
    kept_out: Optional[int] = None  # the slowdown kept compute out of a load it would join at the profile's times:
    #                                 how many more such loads before it is let in again (policy/kvpr.Slowdown)
    retry: bool = False  # compute let in at the profile's times to measure its slowdown again (then 1.0 here)
    kind: bool = False  # the slowdown's key: whether the profile's own times read the pages as activations
    arrival: bool = False  # its files were read into the page cache from its arrival (arrival.py)
    warm: int = 0  # pages at the span's back whose files were in the page cache at its plan (every mode)
    cached_kv: bool = False  # a page whose KV file is in the page cache is read as KV, even where its activations
    #                          are stored (a copy, not a read and a recompute): where the launcher read the span's
    #                          files, or `auto` found pages there at its plan (a forced mode reads as asked)
    wait_s: float = 0.0  # seconds of other forwards it was expected to wait for at admission (wait_ahead_s)
    early: Optional[EarlyJob] = field(default=None, compare=False, repr=False)  # its pages being read since
    #                                                                             admission (engine/early_reads.py)

    @property
    def cached(self) -> bool:
        """Its pages were read, partly or wholly, from the page cache: no sample of the disk's read rate, of compute
        beside a loader or of its way's time (policy/compute_choice.py). Still a sample of our loader against
        SGLang's load (load_timing.py): what ours costs in that situation."""
        return self.arrival or self.warm > 0


def wait_ahead_s(scheduler, req, last_extend_s: float, estimate: Callable[[int], float],
                 goes_ahead: Callable[[Any, Any], bool]) -> float:
    """About how many seconds `req`, admitted now with a taken span (it prefills alone, model_forward.prefill_alone),
    waits for another forward before its own: the next piece of another request's chunked prefill (`last_extend_s`,
    its last piece's) unless `req`, next in line, goes before it (`goes_ahead(scheduler, req)`: ahead.py), or the
    prefill of the requests admitted before it (the next prefill batch is theirs: `estimate(tokens)` of the tokens
    their prompts leave to compute past the prefix matched on device and host, `door.matched`, up to the chunk
    budget); 0: its forward is next."""
    others = [r for r in scheduler.waiting_queue if r is not req]
    chunked = scheduler.chunked_req
    if chunked is not None and chunked is not req:
        return 0.0 if not others and goes_ahead(scheduler, req) else last_extend_s
    tokens = sum(max(0, len(r.origin_input_ids) - matched(r)) for r in others)
    budget = scheduler.chunked_prefill_size
    return estimate(min(tokens, budget) if budget and budget > 0 else tokens) if tokens else 0.0


class KVPR:
    """This process's partial-recompute loading: the door's loader, the activation capture and writer, and the
    measured profile."""

    name = "kvpr"

    def __init__(self, rt: Runtime, cfg: LlamaConfig, shape: Shape, gate_reason: Optional[str]) -> None:
        self.rt, self.cfg = rt, cfg
        self.handler = KVPRHandler(rt, self)
        self.capture = _Capture(self)
        self.shape = shape  # elements until `attach`, then bytes
        self.gate_reason = gate_reason
        self.tier: Optional[SSDTier] = None
        self.writer: Optional[_Writer] = None
        self.rate: Optional[ReadRate] = None  # the read rate: the probe's, then the loads' own (policy/read_rate.py)
        self._logged_bps = 0.0  # the read rate last logged
        self.measuring = False
        self.read_measured = threading.Event()  # set once the read bandwidth is measured (or could not be)
        self.compute_failed = False
        self.tries = ProfileTries(PROFILE_TRIES, PROFILE_RETRY_S)  # compute profiles that disagree with themselves
        self.profile: Optional[Profile] = None
        self.key = ""
        self.lock = threading.Lock()
        self._capture_errors = 0
        self.choice = LoadChoice()  # our loader or SGLang's, where compute would not join (policy/load_choice.py)
        self.scratch = KVScratch()  # the loads' KV, one buffer kept (engine/scratch.py)
        self.timing = LoadTiming(rt, self.choice, self.name)
        self.slowdown = Slowdown()  # compute's time beside a loader over the profile's (`observe_chunks`)
        self.estimates = Estimates()  # SGLang's forward or the two-sided load, as measured (policy/compute_choice.py)
        self._l3_reads, self._l3_read_end = 0, 0.0  # SGLang's own L3 reads in flight; when the last ended
        budget = parse_size(rt.settings.config.kvpr_early_memory)
        self.early = EarlyReader(budget, EARLY_HOLD_S,  # taken spans' reads, from admission on
                                 on_expired=lambda n: rt.events.count("kvpr_early_expired", n))

    def attach(self, tier: SSDTier, itemsize: int, layout: str) -> None:
        """The store is open: start storing activations (gate open or `force`); the read bandwidth is measured in
        the background from the first request on."""
        mode = self.rt.settings.config.kvpr
        if layout != "layer_first":
            logger.warning("tiered kvpr: off: needs the layer_first host layout (per-layer reads), got %s", layout)
            return
        s = self.shape
        self.shape = Shape(s.layers, s.x_bytes * itemsize, s.kv_bytes * itemsize)
        self.tier = tier
        self.timing.page_size = tier.namespace.page_size
        self.key = profile_key(self.rt.settings.model, tier.namespace.dtype)
        if self.gate_reason is not None and mode == "auto":  # logged here: logging is set up by now
            logger.info("tiered kvpr: no activations stored for this model: %s; a stored span behind slow storage "
                        "has its front computed from token ids while its back loads", self.gate_reason)
            return
        self.writer = _Writer(self)
        logger.info("tiered kvpr: %s: activations stored beside SSD pages (%.2fx the KV bytes)", mode,
                    s.x_bytes / s.kv_bytes)

    # ------------------------------------------------------------------------------------- loader (door.py)
    def admit(self, scheduler, req) -> None:
        if self.tier is not None:
            self._start_measuring()
            self.timing.admitted(scheduler, req)

    def wants(self, req) -> bool:
        return self.tier is not None and self.mode(req) != "off"

    def mode(self, req) -> Any:
        mode = request_params(req).get(KVPR_PARAM)
        if mode in KVPR_MODES or (isinstance(mode, int) and not isinstance(mode, bool)):
            return mode
        return self.rt.settings.config.kvpr

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
        if mode == "compute":  # asked for by name: SGLang's forward computes the span, nothing is read
            return Plan(start, tuple(keys[:n]), "compute", None, 0.0, 0.0, False, way=COMPUTE) if n else None
        if n * ps < self.rt.settings.config.kvpr_min_tokens:
            return None
        profile = alone = self._profile(scheduler, forced=mode != "auto")
        if profile is None:
            if mode != "auto":  # asked for by name: say why it did not happen
                self.handler.fallback([req.rid], "no measured profile (see the `tiered kvpr: cannot measure` or "
                                      "`measuring the compute profile failed` line); SGLang loads the stored prefix")
            return None
        stored_x = self.writer is not None

        def decided(p: Profile) -> Decision:
            return decide(self.shape, p, n, ps, stored_activations=stored_x, forced=mode != "auto")

        # compute's estimates as measured beside this kind of load: its contention priced (policy/kvpr.Slowdown;
        # a number as the mode fixes the meet point: the factor decides nothing there; a span read at arrival or
        # found in the page cache is no sample of it: no retry is spent on it, no kept-out load counted)
        arrival = bool(request_params(req).get(ARRIVAL_PARAM))
        warm = self._warm(keys[:n])
        priced = self.slowdown.price(decided(alone), lambda f: decided(beside(alone, f)),
                                     book=not isinstance(mode, int) and not arrival and not warm)
        d, slowdown = priced.decision, priced.factor
        if slowdown != 1.0:
            profile = beside(alone, slowdown)
        as_auto = mode == "auto" or reads_as_auto(self.shape, profile, ps, stored_activations=stored_x)
        # each way's forward as the profile estimates it (seconds): the two meeting, the loader alone, SGLang's
        layers, new, after = self.shape.layers, len(req.origin_input_ids) - start - n * ps, start + n * ps
        alone_read_s = alone_page_s(self.shape, alone, ps, d.activations)
        meet = meet_s(n, d.read_s, chunk_page_s(profile, layers, ps)) + forward_s(profile, layers, new, after)
        solo = n * alone_read_s + forward_s(alone, layers, new, after)
        how, chosen = str(mode), None
        if mode == "auto" and not d.take:  # compute would gain little: our loader only where it is the faster load
            how = self._ours_anyway(scheduler, req, n)
        elif mode == "auto" and warm_alone(n, warm, d):  # in the page cache: a chunk would outlast the read
            how, chosen = f"auto: our loader alone ({warm} of {n} pages in the page cache)", ALONE
        elif mode == "auto":  # the three ways, as measured (policy/compute_choice.py)
            c = self.estimates.choose(n, d.activations, meet, forward_s(alone, layers, n * ps + new, start), solo)
            how, chosen = "auto: " + c.describe(), c.how
        r = route(mode, d, n, ps, anyway=how is not None, chosen=chosen)
        if r is None:
            return None
        if r.way == COMPUTE:
            return Plan(start, tuple(keys[:n]), how, None, 0.0, 0.0, False, way=COMPUTE)
        if r.way == ALONE:
            self.rt.events.count("kvpr_alone_spans")
        plan = Plan(start, tuple(keys[:n]), how, r.pages, d.page_s, alone_read_s if r.way == ALONE else d.read_s,
                    d.activations, d.chunk_s, r.threads, as_auto, d.join_share, slowdown, way=r.way,
                    estimate_s={MEET: meet, ALONE: solo}.get(r.way, 0.0),
                    kept_out=priced.kept_out, retry=priced.retry, kind=priced.kind, arrival=arrival, warm=warm,
                    cached_kv=arrival or (warm > 0 and mode == "auto"))
        wait_s = wait_ahead_s(scheduler, req, self.rt.forward.last_extend_s,
                              lambda tokens: forward_s(alone, layers, tokens), self.rt.forward.ahead.would_go)
        return replace(plan, wait_s=wait_s, early=self._read_early(plan, wait_s, profile.recompute_s))

    def _read_early(self, plan: Plan, wait_s: float, recompute_s: float) -> Optional[EarlyJob]:
        """Begin reading, now, the pages of `plan` its loader would read (from the forced meet point up, or all where
        the two meet), last first, while the request waits for its forward (engine/early_reads.py), about `wait_s`
        seconds: as KV where that leaves the forward less to do than activations (policy/kvpr.early_as_kv; K and V
        recomputed at `recompute_s` per token-layer), else as the plan reads them. None where the store's dtype is
        not a torch one."""
        dtype = getattr(torch, self.tier.namespace.dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            return None
        source = self.span_pages(plan, dtype)
        token_layers = source.page_size * self.shape.layers
        rest_page_s = plan.read_s  # a page the forward still brings in: read as planned, or met by compute
        if plan.pages is None and min(plan.read_s, plan.page_s) > 0:
            rest_page_s = meet_s(1, plan.read_s, plan.page_s)
        as_kv = not source.activations or early_as_kv(
            pages=max(0, source.pages - (plan.pages or 0)), kv_page=token_layers * self.shape.kv_bytes,
            x_page=token_layers * self.shape.x_bytes, recompute_page_s=token_layers * recompute_s,
            rest_page_s=rest_page_s, queued_bytes=self.early.unread_bytes(), wait_s=wait_s,
            bps=None if self.rate is None else self.rate.bps)
        per_token = max(self.shape.kv_bytes, 0 if as_kv else self.shape.x_bytes)  # (a missing activation page
        return self.early.start(source, plan.pages or 0, token_layers * per_token,  # reads as KV)
                                lambda page: source.read(page, kv=as_kv))

    def span_pages(self, plan: Plan, dtype: torch.dtype) -> TierPages:
        """The plan's stored pages as the loader reads them, in `dtype`."""
        c = self.cfg
        return TierPages(self.tier, plan.keys, layers=c.layers, page_size=self.tier.namespace.page_size,
                         kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=dtype, hidden=c.hidden,
                         activations=plan.activations, cached_kv=plan.cached_kv)

    def _warm(self, keys: tuple[str, ...] | list[str]) -> int:
        """How many of `keys`' pages, from the last, have their files in the OS page cache now (probed from the back,
        up to the first that has not: SSDTier.in_page_cache; nothing read)."""
        warm = 0
        for key in reversed(keys):
            if not self.tier.in_page_cache(key):
                break
            warm += 1
        return warm

    def _ours_anyway(self, scheduler, req, pages: int) -> Optional[str]:
        """Why our loader (alone) takes a span of `pages` stored pages that compute would not gain on (`auto`):
        behind other prefills, or the measured choice (`--tiered-kvpr-choice measured`); None: SGLang's own load
        brings it in."""
        behind = self._behind_prefills(scheduler, pages * self.tier.namespace.page_size)
        if behind is not None:
            return "auto: " + behind
        if self.rt.settings.config.kvpr_choice != "measured":
            return None
        gives_up = self._sglang_gives_up(scheduler, pages)
        choice = self.choice.choose(pages, self.timing.condition(req), sglang_gives_up=gives_up is not None)
        self.rt.events.count("kvpr_choice_" + choice.load)
        if choice.exploring:
            self.rt.events.count("kvpr_choice_explorations")
        if choice.load != OURS:
            self.timing.left_to_sglang(req, pages * self.tier.namespace.page_size)
            return None
        if choice.predicted:
            self.rt.events.count("kvpr_choice_sglang_gives_up")
            return "auto: measured choice, our loader: " + gives_up
        return "auto: measured choice, " + ("trying our loader" if choice.exploring else "our loader is faster")

    def _sglang_gives_up(self, scheduler, pages: int) -> Optional[str]:
        """Why SGLang's load of `pages` stored pages would give up (`prefetch_gives_up`: its `timeout` prefetch
        policy's deadline against the pages' KV read at the read rate), or None."""
        cache = scheduler.tree_cache
        if getattr(cache, "prefetch_stop_policy", None) != "timeout" or self.rate is None:
            return None
        deadline_s = cache.prefetch_timeout_base + pages * cache.prefetch_timeout_per_page
        nbytes = pages * self.tier.namespace.page_size * self.shape.layers * self.shape.kv_bytes
        if not prefetch_gives_up(nbytes, self.rate.bps, deadline_s):
            return None
        return (f"SGLang's prefetch would give up ({nbytes / 2**20:.0f} MiB of KV take {nbytes / self.rate.bps:.2f} s "
                f"at {self.rate.bps / 1e6:.0f} MB/s, its deadline is {deadline_s:.2f} s)")

    def _behind_prefills(self, scheduler, tokens: int) -> Optional[str]:
        """Why our loader takes a span of `tokens` stored tokens admitted right after another request's prefill
        forward (`behind_prefills`: SGLang's load would wait for the next one), or None."""
        last = scheduler.last_batch
        if last is None or not last.forward_mode.is_extend():
            return None
        prefill_s = self.rt.forward.last_extend_s
        slower_s = self.choice.slower_s(tokens, self.tier.namespace.page_size)
        if not behind_prefills(prefill_s, slower_s):
            return None
        self.rt.events.count("kvpr_choice_behind_prefills")
        return (f"behind prefills ({prefill_s:.2f} s the last), our loader" +
                ("" if slower_s is None else f" ({slower_s:+.2f} s against SGLang's load as measured)"))

    # ------------------------------------------------------------------------------------- profile
    def _measure_read(self) -> None:
        try:
            self._probe_read()
        finally:
            self.read_measured.set()

    def _probe_read(self) -> None:
        tier = self.tier
        room = min(PROBE_BYTES, tier.capacity_bytes // 8)
        try:
            faults.check("kvpr_probe")
            if room < _MIN_PROBE_BYTES:
                raise OSError(f"a capacity of {tier.capacity_bytes} bytes leaves no room for a probe file")
            with tier.scratch(".kvpr-read-probe", room) as path:
                if path is None:
                    raise OSError("no room under the SSD capacity for a probe file")
                bps = measure_read(path, room)
            if bps <= 0:
                raise OSError("the probe file read back empty")
            with self.lock:
                self.rate, self._logged_bps = ReadRate(bps), bps
            logger.info("tiered kvpr: SSD read bandwidth %.0f MB/s (page cache bypassed)", bps / 1e6)
        except (OSError, faults.InjectedFault) as exc:
            stored = stored_profile(tier.root, self.key)
            logger.warning("tiered kvpr: cannot measure the SSD read bandwidth (%s); %s", exc,
                           "using the stored profile's" if stored else "KVPR stays off")
            if stored is not None:
                with self.lock:
                    self.rate, self._logged_bps = ReadRate(stored.read_bytes_per_s), stored.read_bytes_per_s

    def _start_measuring(self) -> None:
        """Measure the read bandwidth in the background, once, from the first admission on (SGLang's own warm-up
        request, once the weights are in memory and no longer read from the same disk)."""
        if not self.measuring:
            self.measuring = True
            threading.Thread(target=self._measure_read, name="tiered-kvpr-profile", daemon=True).start()

    def on_idle(self, scheduler) -> None:
        """`Scheduler.on_idle` (BEFORE): the compute part of the profile, at the scheduler's first fully idle moment
        once the read bandwidth is known -- on the thread that runs the forwards (see `measure_compute`), off every
        request's path (about 1-1.5 s on a CPU, once; again PROFILE_RETRY_S later where it disagreed with itself)."""
        try:
            if self.profile is None and self.read_measured.is_set() and scheduler.is_fully_idle() and \
                    self.tries.due(time.monotonic()):
                self._measure_compute(scheduler)
        except Exception:  # noqa: BLE001 -- never the scheduler's problem
            self.compute_failed = True
            self.rt.events.count("hook_errors")
            logger.exception("tiered kvpr: the idle-time profile failed")

    def _measure_compute(self, scheduler, final: bool = False) -> None:
        """Time the served model's compute and complete the profile (on the scheduler's thread; once: a failure
        leaves the profile unmeasured and SGLang loading every stored span). A measurement that disagrees with
        itself (`Unsettled`: something else slowed it) is dropped and taken again at an idle moment PROFILE_RETRY_S
        later, PROFILE_TRIES times at most; the last one, or one `final` (a forced load waiting for it), is kept."""
        if self.profile is not None or self.rate is None or self.compute_failed:
            return
        engine = self.rt.forward.engine(scheduler.tp_worker.model_runner.model.model)
        try:
            compute = measure_compute(engine)
        except Unsettled as exc:
            if self.tries.drop(time.monotonic(), final):
                self.rt.events.count("kvpr_profile_retries")
                logger.info("tiered kvpr: the compute profile disagrees with itself (%s); measured again at an idle "
                            "moment in %.0f s", exc, PROFILE_RETRY_S)
                return
            logger.warning("tiered kvpr: the compute profile disagrees with itself (%s), %d times; kept", exc,
                           self.tries.dropped + 1)
            compute = exc.values
        except Exception:  # noqa: BLE001 -- no profile: SGLang keeps loading every stored span
            self.compute_failed = True
            self.rt.events.count("hook_errors")
            logger.exception("tiered kvpr: measuring the compute profile failed; SGLang loads every stored span")
            return
        try:
            faults.check("kvpr_chunks")
            chunk_s, span_s = measure_chunks(engine, self.tier.namespace.page_size)
        except Exception:  # noqa: BLE001 -- without it a chunk costs its pages' layer time, as before
            self.rt.events.count("hook_errors")
            logger.exception("tiered kvpr: timing a computed chunk failed; a page's layer time stands for it")
            chunk_s = span_s = 0.0
        with self.lock:
            self.profile = Profile(self.rate.bps, *compute, chunk_s=chunk_s, span_s=span_s)
        path = self._save()
        logger.info("tiered kvpr: profile %s (saved to %s); %s", describe(self.profile), path,
                    auto_example(self.shape, self.profile, self.tier.namespace.page_size))

    def _save(self) -> Any:
        return save_profile(self.tier.root, self.key, self.profile, shape=self.shape.__dict__,
                            write=lambda data: self.tier.write_meta(PROFILE_FILE, data))

    def _profile(self, scheduler, forced: bool) -> Optional[Profile]:
        """The measured profile, or None while it is being measured: then SGLang loads as usual, except for a
        forced load, which waits for the read bandwidth (at most PROFILE_WAIT_S) and measures the compute part
        now if the scheduler has not been idle since."""
        if self.profile is None and forced:
            self.read_measured.wait(PROFILE_WAIT_S)
            self._measure_compute(scheduler, final=True)
        return self.profile

    def observe_read(self, nbytes: int, seconds: float, *, spread: bool = False) -> str:
        """Fold a load's reads (bytes over the wall seconds they took: the read path as it really runs, readahead and
        checksums included; the loader's recomputes and copies not) into the read rate -- our loader's and SGLang's
        own (`TieredSSDStorage.batch_get_v1`) alike; called from the scheduler and from SGLang's prefetch thread.
        `spread`: the loader recomputed activations between its reads, so a throttle may have let them through
        faster than it sustains; such a rate only pulls the estimate down. The profile follows the rate
        (policy/read_rate.py)."""
        with self.lock:
            if self.rate is None or not self.rate.observe(nbytes, seconds, spread=spread):
                return "not updated"
            bps, samples = self.rate.bps, self.rate.samples
            if self.profile is not None:
                self.profile = replace(self.profile, read_bytes_per_s=bps)
            moved = abs(bps - self._logged_bps) > 0.25 * self._logged_bps
            if moved:
                self._logged_bps = bps
        self.rt.events.count("kvpr_read_samples")
        if moved:
            logger.info("tiered kvpr: read rate now %.0f MB/s (%d loads since the probe)", bps / 1e6, samples)
        return f"{nbytes / seconds / 1e6:.0f} MB/s, v now {bps / 1e6:.0f} MB/s"

    def observe_chunks(self, plan: Plan, chunks, load_s: float) -> str:
        """Fold a load's chunks computed beside its loader (`policy/kvpr.chunk_slowdown`, against the plan's
        estimates, themselves the profile's times `plan.slowdown`) into compute's slowdown beside this kind of
        load; what the log line says of it."""
        sample = chunk_slowdown(chunks, load_s, plan.chunk_s, plan.page_s)
        if sample is not None and plan.cached:
            return "compute's chunks no sample (the loader read the page cache)"
        if sample is None and plan.kept_out is not None:
            return (f"no chunk beside the loader, kept out by compute's measured slowdown "
                    f"({self.slowdown.factor(plan.kind):.2f}x; let in again after {plan.kept_out} more such "
                    f"loads)")
        if sample is None:
            return "no chunk beside the loader" + (" (let in again to be measured)" if plan.retry else "")
        sample *= plan.slowdown
        new = self.slowdown.observe(plan.kind, sample, retry=plan.retry)
        again = ", let in again to be measured" if plan.retry else ""
        return f"compute {sample:.2f}x the profile beside the loader{again}, now {new:.2f}x"

    @contextmanager
    def l3_read(self) -> Iterator[None]:
        """Around one of SGLang's own L3 reads (`TieredSSDStorage.batch_get_v1`, its prefetch threads): a forward
        with one beside it is not a sample of SGLang's forward alone (`observe_forward`)."""
        with self.lock:
            self._l3_reads += 1
        try:
            yield
        finally:
            with self.lock:
                self._l3_reads -= 1
                self._l3_read_end = time.perf_counter()

    def _l3_quiet_since(self, t: float) -> bool:
        with self.lock:
            return self._l3_reads == 0 and self._l3_read_end < t

    def observe_forward(self, fb, by: Optional[str]) -> None:
        """After an extend forward (`ForwardHook.after_extend`): fold its wall seconds into the factor of the way it
        ran (policy/compute_choice.py) -- a two-sided load as planned (MEET), or SGLang's forward computing a
        request's whole remaining prompt of a page or more from its token ids (COMPUTE: a miss, a span left to it,
        a fallback) with none of SGLang's L3 reads beside it (a prefetch that gave up may still be reading beside the
        forward that computes its span). Only a request prefilled alone and whole, once the profile is known."""
        req = self.rt.forward.whole_alone(fb)
        if req is None or self.profile is None or self.tier is None:
            return
        ps = self.tier.namespace.page_size
        prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
        if ext < ps:
            return
        plan, seconds = planned(req, self.name), self.rt.forward.last_extend_s
        # pages read before the forward (at admission, or into the page cache at arrival): not the way's time
        ahead = getattr(req, "tiered_early_pages", 0) or (plan is not None and plan.cached)
        if by == self.name and plan is not None and plan.way in LOADS and plan.estimate_s > 0 and not ahead:
            key, estimate = Estimates.key(plan.way, len(plan.keys), plan.activations), plan.estimate_s
        elif by is None and (plan is None or plan.way == COMPUTE) and \
                self._l3_quiet_since(time.perf_counter() - seconds):
            key, estimate = Estimates.key(COMPUTE, ext // ps), forward_s(self.profile, self.shape.layers, ext, prefix)
        else:
            return
        if seconds > 0:
            self.estimates.observe(key, seconds, estimate)
            self.rt.events.count("kvpr_forward_samples")

    def observe_activation_load(self, seconds: float, token_layers: int) -> None:
        """Fold a load that read only activations on MEET_LOADERS threads, compute taking no page (`seconds` of the
        loader's wall time for `token_layers`), into the profile's `x_load_s`: the first replaces the model's
        stand-in, later ones a moving average (`read_rate.moving_average`)."""
        per = seconds / token_layers
        with self.lock:
            if self.profile is None:
                return
            old = self.profile.x_load_s
            new = per if old == 0 else moving_average(old, per)
            self.profile = replace(self.profile, x_load_s=new)
        if old == 0 or abs(new - old) > 0.25 * old:
            logger.info("tiered kvpr: activation loads now %.2f us per token-layer on %d threads", new * 1e6,
                        MEET_LOADERS)

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
    """One background thread writing activation pages (keys, [layers, pages * page_size, hidden] tensor)."""

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
        by_rid = {r.rid: r for r in self.kvpr.rt.forward.batch_requests(fb)}
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


# ---------------------------------------------------------------------------------------------- forward
class KVPRHandler(SpanHandler):
    name = "kvpr"

    def __init__(self, rt: Runtime, kvpr: KVPR) -> None:
        super().__init__(rt)
        self.kvpr = kvpr

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        """A span planned for SGLang's forward (way COMPUTE) is left to it, counted and logged; the rest loads."""
        for req in self.rt.forward.batch_requests(fb):
            plan = planned(req, self.name)
            if plan is not None and plan.way == COMPUTE:
                self.rt.events.count("kvpr_computed_spans")
                logger.info("tiered kvpr: rid %s: SGLang's forward computes the %d stored tokens (prefix=%d "
                            "mode=%s)", req.rid, len(plan.keys) * self.kvpr.tier.namespace.page_size, plan.start,
                            plan.mode)
                return None
        return super().forward(module, input_ids, positions, fb)

    def release(self, plan: Plan) -> None:
        if plan.early is not None:
            self.kvpr.early.drop(plan.early)

    def check(self, fb, req, plan: Plan) -> tuple[Optional[str], Plan]:
        prefix = int(fb.extend_prefix_lens_cpu[0])
        if prefix != plan.start:
            return f"its cached prefix changed since admission ({plan.start} -> {prefix} tokens)", plan
        return None, plan

    @torch.inference_mode()
    def load(self, engine, module, req, fb, plan: Plan) -> torch.Tensor:
        """The span's front prefilled from its token ids while its back is read (engine/meet.py)."""
        t0 = time.perf_counter()
        kvpr, c, events = self.kvpr, engine.cfg, self.rt.events
        tier = kvpr.tier
        ps = tier.namespace.page_size
        prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
        early = kvpr.early.take(plan.early) if plan.early is not None else {}  # pages read since admission
        source = plan.early.source if plan.early is not None else None
        if source is None or source.dtype != engine.dtype:
            early, source = {}, kvpr.span_pages(plan, engine.dtype)
        s = source.pages * ps
        first = source.pages - 1 - len(early)  # the loader's first read (early pages run down from the last)
        first_cached = source.first_read_cached(first) if first >= 0 else None  # (a probe: nothing read)
        from_disk = plan.pages is None and first_cached is False
        ids = torch.tensor(req.origin_input_ids[prefix : prefix + ext], dtype=torch.int64)
        kept = kvpr.scratch.nbytes
        out = kvpr.scratch.take(engine, prefix + ext)  # (the cached prefix's KV too: attention reads it in place)
        if kvpr.scratch.nbytes > kept:
            logger.info("tiered kvpr: the loads' KV buffer now holds %.1f MiB (%d tokens' KV), kept for the next "
                        "loads", kvpr.scratch.nbytes / 2**20, prefix + ext)
        res = meet_prefill(engine, ids[:s], ids[s:], prefix_len=prefix, source=source, split=plan.pages,
                           chunk=MEET_CHUNK_PAGES, min_read_share=plan.join_share,
                           page_compute_s=plan.page_s, chunk_fixed_s=plan.chunk_s, page_read_s=plan.read_s,
                           from_disk=from_disk,
                           rope=sglang_rope(module),
                           inputs=kvpr.writer is not None, loaders=plan.loaders,
                           prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None,
                           out=out, early=early)
        t_write = time.perf_counter()
        hidden = model_forward.write_extend(fb, engine, res.kv, res.hidden)
        write_s = time.perf_counter() - t_write
        req.tiered_pure_load = res.computed_pages == 0 and plan.as_auto  # (a sample of our loader: load_timing)
        req.tiered_early_pages = res.early_pages  # (then not a sample of its way's time: observe_forward)
        if res.loaded_pages and not req.retracted_stain:  # read, not computed: reported as SGLang reports its own
            req.cached_tokens += res.loaded_pages * ps      # L3 hits (meta_info.cached_tokens_details, /metrics)
            req.cached_tokens_storage += res.loaded_pages * ps
        new_pages = _pages_of(req, prefix + s, prefix + ext, ps)
        if len(new_pages) and res.inputs is not None:  # the new tokens' activations, as SGLang's forward would store
            keys = page_keys(req, new_pages.stop * ps, ps)[new_pages.start :]
            rows = slice(new_pages.start * ps - prefix - s, new_pages.stop * ps - prefix - s)
            kvpr.writer.submit(keys, res.inputs[:, rows].clone())
        if not res.loaded_pages:
            read = "nothing read"
        elif plan.arrival:
            read = "read into the page cache from its arrival: no sample"
        elif plan.warm:
            read = f"{plan.warm} of its pages in the page cache at its plan: no sample"
        elif first_cached:  # (cold at its plan, in the page cache at its load)
            read = "its first read in the page cache: no sample"
        else:
            read = kvpr.observe_read(source.bytes_read, source.read_s, spread=res.recomputed_pages > 0)
        if plan.loaders == MEET_LOADERS and res.recomputed_pages == source.pages > 0 and not res.early_pages and \
                not plan.cached:
            kvpr.observe_activation_load(res.load_s, source.pages * ps * c.layers)
        beside_note = kvpr.observe_chunks(plan, res.chunks, res.load_s)
        computed, loaded, recomputed = res.computed_pages * ps, res.loaded_pages * ps, res.recomputed_pages * ps
        events.count("kvpr_loads")
        events.count("kvpr_tokens_computed", computed)
        events.count("kvpr_tokens_loaded", loaded)
        events.count("kvpr_tokens_recomputed", recomputed)
        events.count("kvpr_bytes_saved", max(0, recomputed * kvpr.shape.layers * (kvpr.shape.kv_bytes -
                                                                                  kvpr.shape.x_bytes)))
        events.count("kvpr_activation_misses", source.act_misses)
        events.count("kvpr_early_pages", res.early_pages)
        logger.info("tiered kvpr: rid %s loaded %d stored tokens (prefix=%d computed=%d mode=%s): met at page %d of "
                    "%d: front %d tokens computed from token ids in %.3fs, back %d tokens read in %.3fs by %d "
                    "thread(s) (%d from activations, %.1f MiB; %d KV, %.1f MiB; %d activation pages missing/corrupt; "
                    "%d pages read before the forward, %.2fs of other forwards expected ahead; read path %s), waited "
                    "%.3fs at the meet, then the new tokens' layers %.3fs and the write into SGLang's pool %.3fs, "
                    "total=%.3fs; compute's chunks %s%s (%s)",
                    req.rid, s, prefix, ext - s, plan.mode, res.computed_pages, source.pages, computed, res.compute_s,
                    loaded, res.load_s, plan.loaders, recomputed, source.bytes_x / 2**20, loaded - recomputed,
                    source.bytes_kv / 2**20, source.act_misses, res.early_pages, plan.wait_s, read, res.wait_s,
                    res.new_s, write_s, time.perf_counter() - t0,
                    _chunks(res.chunks), " (the span out of the page cache: compute claimed at once)" if from_disk
                    else "", beside_note)
        return hidden


def _chunks(chunks) -> str:
    """Compute's claims for the load's log line: pages at seconds into the load, in seconds."""
    return ", ".join(f"{pages} at {at:.3f}s in {took:.3f}s" for at, pages, took in chunks) or "none"


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
    """In scheduler processes of a CPU server with `--tiered-kvpr auto|force`: the door's loader (after gated
    sparse loading), the activation capture, a forward handler and the idle-time profile."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = rt.settings
    if current is None or current.config.kvpr == "off" or not current.cpu_only:
        return False
    try:
        cfg = LlamaConfig.from_hf(current.model_path)
    except (OSError, KeyError, ValueError, NotImplementedError) as exc:
        logger.info("tiered kvpr: off (%s)", exc)
        return False
    shape = Shape(cfg.layers, cfg.hidden, 2 * cfg.kv_heads * cfg.head_dim)  # elements; bytes at attach
    rt.kvpr = KVPR(rt, cfg, shape, gate(shape))
    if rt.kvpr.gate_reason is None or current.config.kvpr == "force":  # activations stored
        HookRegistry.register("sglang.srt.models.llama.LlamaAttention.forward", rt.kvpr.around_attention,
                              HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle", rt.kvpr.on_idle, HookType.BEFORE)
    rt.door.add(rt.kvpr)
    rt.forward.add_handler(rt.kvpr.handler)
    rt.forward.after_extend(rt.kvpr.timing.ended)
    rt.forward.after_extend(rt.kvpr.observe_forward)
    return True
