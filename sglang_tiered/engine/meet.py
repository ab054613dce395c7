"""Compute the front of a stored span while loading its back (Cake: "Compute Or Load KV Cache? Why Not Both?",
arXiv 2410.03065), exact, on the layer-by-layer engine, for any Llama-family model.

A prompt = an exact prefix P (its KV already in memory), a stored span S of whole pages (on a slow tier) and new
tokens C. Two workers share S's pages:

* compute (the caller's thread) prefills pages from the front, a chunk of up to `chunk` pages at a time through
  every layer, each chunk attending to P and to the pages computed before it (a chunked prefill);
* load (a background thread, or several: `loaders`) reads whole pages (`PageSource.read`) from the back, the last
  page first (each thread one page at a time, the next unclaimed one): every
  layer's K and V, or -- where a page's activations are stored and cheaper to read (MHA models, KVPR) -- every
  layer's attention input X, from which the loader recomputes K = X W_K (with RoPE at the page's positions) and
  V = X W_V. Either way a page arrives exact; the loader's rate (reads plus recomputes) is what compute decides by.

Every page is claimed by exactly one of them: compute claims its next chunk only below the lowest page the loader
has claimed, the loader stops at a page compute claimed. They meet where they meet -- wherever the storage's and
the CPU's speeds at that moment put the point -- with no plan, no solver and nothing extra stored; `split` forces the
meet point instead (tests, or a caller that knows better). Then C's layers run over [P, S, C], as a full prefill
would. Exact by construction: every token's KV is either computed from the true prefix or the stored copy of it.

On a CPU a chunk cannot be abandoned halfway, and one page's prefill (tens of milliseconds) can outlast reading the
whole span from a fast disk; so with `page_compute_s` (an estimate of one page's compute) compute first waits for the
loader's first page, at most `min_read_share` of a page's compute (a read quicker than that keeps compute out anyway;
one page's compute without a share; not where the caller knows the span's reads reach the disk: `from_disk`).
Then it claims the chunk (at most `chunk` pages) that ends the span soonest: k
pages such that max(chunk_fixed_s + k x page_compute_s, (unclaimed pages - k) x seconds per read) is smallest -- a
large chunk prefills faster per page (wider matrix products; on a CPU every chunk also reads the model's weights from
memory once, `chunk_fixed_s`), so the first claim is the biggest. Seconds per read: the mean of the loader's
last reads, with the read in flight counted as one of them once it has taken longer (timed from its own start: the
loader's start-up -- a thread waking, a CUDA stream's first copy -- is no read; a kernel throttle passes reads in bursts
and stalls about one in ten, measured at 200 MB/s: 2-3 ms reads and 40-70 ms stalls, and that one stall is not the
disk's rate), and before the first read the caller's `page_read_s` estimate (the profile's). The reads, not the
estimate, decide once one is in: a span still in the page cache reads fast behind a slow disk, and a chunk claimed on
the estimate then holds the load up (a chunk cannot be abandoned); the price is that a throttle idle before the load
lets its first reads through at once (measured at 25 MB/s: 3-9 ms, then 110 ms), and compute looks two to four times
before it joins. When reads are fast next to compute (below `min_read_share` of a page's compute: computing would gain
little and, on a CPU, slow the loader's own work) or no page is worth taking, compute looks again after `min_read_share`
of a page's compute (at once if the loader is done): a kernel I/O throttle lets a first burst through fast, then reads
slow down, and their new rate may be slow enough to join. Not at every read: on a GPU a read takes a fraction of a
millisecond, and compute's thread waking at each one takes the GIL from the loader's. Both rates are this load's own
(the estimates are replaced by each computed chunk's time and each read's), so the rule follows a disk or a CPU that
slows down under load. Without an estimate the two simply race (Cake's scheme).

A page the loader cannot read (`SpanMiss`) abandons the whole load: raised to the caller, who falls back.

Pages read before the call (`early`: a server reads a taken span's back from admission on, while the request waits
for its forward, engine/early_reads.py) are the loader's from the start: it places them first, without a read, and
compute's rule decides by the reads still to come.

On a CUDA model (component level: the server runs this on CPUs) the same scheduler runs with the loader's copies of
pages (from pinned host memory: `PageSource.read` returns host tensors) on a CUDA stream of its own, each page's copy
waited for on the loader's thread (its read time is the transfer's), and compute's kernels on the caller's current
stream, each chunk waited for before the next claim (a claim must follow real progress, not queued kernels); the
new tokens' layers run after the current stream has waited for the loader's. There the first read in flight does
not count: the estimate stands until it is in (a CUDA loader's first copy takes 2-4x its next ones, measured, and no
throttle lets a burst through that compute would need to catch early).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from sglang_tiered.engine.llama import LlamaModel, Rope
from sglang_tiered.engine.one_thread import one_thread_pool
from sglang_tiered.engine.span_miss import SpanMiss
from sglang_tiered.kernels.extend_attention import causal_attention, part_attention


@dataclass(frozen=True)
class StoredPage:
    """One page as read: its KV [layers, page_size, 2, kv_heads, head_dim], or (exactly one of the two) its
    attention inputs x [layers, page_size, hidden], post-RMSNorm (any float dtype)."""

    kv: Optional[torch.Tensor] = None
    x: Optional[torch.Tensor] = None


class PageSource(Protocol):
    pages: int
    page_size: int

    def read(self, page: int) -> StoredPage:
        """Page `page` of the span. Runs on a loader thread (several at once where `meet_prefill` has `loaders` >
        1). Raises SpanMiss (engine.span_miss) when the page cannot be served."""
        ...


@dataclass(frozen=True)
class MeetResult:
    kv: torch.Tensor  # [layers, |S| + |C|, 2, kv_heads, head_dim]: the span's KV, then the new tokens'
    hidden: torch.Tensor  # [hidden]: the last token's residual stream after the last layer
    computed_pages: int  # the meet point m: pages [0, m) computed from their token ids
    loaded_pages: int  # pages [m, pages) read from storage
    recomputed_pages: int  # of those, the pages read as activations (K and V recomputed)
    compute_s: float  # seconds computing the span's front
    load_s: float  # wall seconds from the loader's first read to its last page placed (reads, recomputes, copies)
    wait_s: float  # seconds compute waited, at the meet, for loads in flight
    inputs: Optional[torch.Tensor] = None  # [layers, |C|, hidden]: the new tokens' attention inputs (if asked)
    reads: tuple[float, ...] = ()  # seconds of each page the loader placed (read to placed), in its order
    chunks: tuple[tuple[float, int, float], ...] = ()  # compute's claims: (seconds into the load, pages, seconds)
    new_s: float = 0.0  # seconds of the new tokens' layers, after the meet
    early_pages: int = 0  # of the loaded pages, those read before this call (`early`)


def best_claim(free: int, compute_s: float, read_s: float, floor_s: float = 0.0, fixed_s: float = 0.0) -> int:
    """Pages compute should take of `free` unclaimed ones, a chunk of j pages taking `fixed_s` + j x `compute_s`
    while the loader reads one page in `read_s`: the k that ends the span soonest, max(chunk(k), (free - k) x
    read_s) (the smaller k on a tie), and none unless it ends before the loader alone would (free x read_s). A chunk
    that takes at least `floor_s` however few its pages (a GPU host launching its kernels) takes as many pages as the
    floor pays for once it binds (the loader's part only shrinks)."""
    def chunk(j: int) -> float:
        return fixed_s + j * compute_s if j else 0.0

    k = max(0, int((free * read_s - fixed_s) / (read_s + compute_s)))  # where the two lines cross, rounded down
    if k < free:
        k = min((k, k + 1), key=lambda j: (max(chunk(j), (free - j) * read_s), j))
    else:
        k = free
    if floor_s and 0 < k < free and max(chunk(k), (free - k) * read_s) < floor_s:  # the floor binds
        k = min(free, max(k, int((floor_s - fixed_s) / compute_s)))
    return k if k and max(floor_s, chunk(k), (free - k) * read_s) < free * read_s else 0


class _Claims:
    """Which pages compute and the loader hold: [0, front) compute's, [low, pages) the loader's (shared, locked),
    and the rates compute decides by (see the module docstring). The loader may be `workers` threads, each reading
    one page at a time: a page then comes in every (seconds per read) / workers."""

    def __init__(self, pages: int, split: Optional[int], page_compute_s: Optional[float],
                 min_read_share: float = 0.0, page_read_s: float = 0.0, first_in_flight: bool = True,
                 workers: int = 1, chunk_floor_s: float = 0.0, chunk_fixed_s: float = 0.0) -> None:
        self.front, self.low = 0, pages
        self.split = split  # compute stops here and the loader never goes below it (None: they meet)
        self.page_compute_s = page_compute_s  # compute's seconds per page (None: claim whenever a page is free)
        self.min_read_share = min_read_share  # compute joins only while a read takes this share of a page's compute
        self.page_read_s = page_read_s  # the estimate of a read (per page the loader brings in) until one is in
        self.first_in_flight = first_in_flight  # whether the first read's time in flight counts before it is in
        self.workers = workers
        self.chunk_floor_s = chunk_floor_s  # the least seconds a chunk takes (a GPU host's kernel launches)
        self.chunk_fixed_s = chunk_fixed_s  # seconds a chunk takes beyond its pages' (a CPU reading the weights)
        self.reads: list[float] = []  # the loader's seconds per page so far (each on its own thread)
        self.started: deque[float] = deque()  # when the reads in flight began, oldest first
        self.recomputed = 0  # pages the loader recomputed from activations
        self.early: dict[int, Future] = {}  # pages read before the load, the loader's to place first (no reads)
        self.placed_early = 0
        self.began = self.ended = 0.0  # the loader's first read and its last page placed (time.perf_counter())
        self.lock = threading.Lock()
        self.read_done = threading.Condition(self.lock)

    def next_chunk(self, chunk: int) -> Optional[range]:
        """Compute's next pages (at most `chunk`); an empty range: not now (the loader would be there first at its
        current rate: wait for its next page and ask again); None: done (it reached the loader or the forced
        split)."""
        with self.lock:
            limit = self.low if self.split is None else min(self.low, self.split)
            free = limit - self.front
            if free <= 0:
                return None
            take = min(chunk, free)
            if self.split is None and self.page_compute_s is not None:
                # the loader's rate now: its last reads (a throttle's first burst is not its rate), and the read in
                # flight as one of them once it has taken longer (a single stall between fast reads is not the rate
                # either: a throttle that lets reads through in bursts stalls one read in ten or so)
                recent = self.reads[-4:]
                per_read = sum(recent) / len(recent) / self.workers if recent else self.page_read_s
                if self.started and (self.reads or self.first_in_flight):
                    in_flight = time.perf_counter() - self.started[0]
                    per_read = max(per_read, (sum(recent) + in_flight) / (len(recent) + 1) / self.workers)
                if per_read < self.min_read_share * self.full_page_s(chunk):
                    return range(0)  # reads are fast next to compute: computing would gain little and slow them
                take = min(take, best_claim(free, self.page_compute_s, per_read, self.chunk_floor_s,
                                            self.chunk_fixed_s))
                if take < 1:
                    return range(0)
            pages = range(self.front, self.front + take)
            self.front = pages.stop
            return pages

    def wait_read(self, timeout: float) -> None:
        """Until the loader's next page is in (or `timeout` seconds)."""
        with self.lock:
            seen = len(self.reads)
            self.read_done.wait_for(lambda: len(self.reads) > seen or self.low <= self.front, timeout)

    def wait_done(self, timeout: float) -> None:
        """Until the loader has reached compute (or `timeout` seconds)."""
        with self.lock:
            self.read_done.wait_for(lambda: self.low <= self.front, timeout)

    def hand_over(self, early: Mapping[int, Future]) -> None:
        """Pages read before the load (`meet_prefill`'s `early`): those in one run up to the span's last page and not
        below the forced split become the loader's at once (compute never claims them)."""
        with self.lock:
            while self.low - 1 in early and (self.split is None or self.low - 1 >= self.split):
                self.low -= 1
                self.early[self.low] = early[self.low]

    def next_early(self) -> Optional[tuple[int, Future]]:
        """A page read before the load, to place (highest first), or None."""
        with self.lock:
            if not self.early:
                return None
            page = max(self.early)
            self.began = self.began or time.perf_counter()
            return page, self.early.pop(page)

    def early_placed(self, recomputed: bool) -> None:
        """A page read before the load is placed: no read of this load (compute's rule decides by those)."""
        with self.lock:
            self.placed_early += 1
            self.recomputed += recomputed
            self.ended = time.perf_counter()
            self.read_done.notify_all()

    def next_load(self) -> Optional[int]:
        """The loader's next page (from the back), or None once it reached compute (or the forced split)."""
        with self.lock:
            page = self.low - 1
            if page < self.front or (self.split is not None and page < self.split):
                return None
            self.low = page
            self.started.append(time.perf_counter())
            self.began = self.began or self.started[-1]
            return page

    def loaded(self, seconds: float, recomputed: bool = False) -> None:
        """A page is placed, `seconds` after its read began (the oldest read in flight is taken as its)."""
        with self.lock:
            self.reads.append(seconds)
            self.started.popleft()
            self.recomputed += recomputed
            self.ended = time.perf_counter()
            self.read_done.notify_all()

    def full_page_s(self, chunk: int) -> float:
        """Seconds per page of a chunk of `chunk` pages at compute's current rate."""
        return self.page_compute_s + self.chunk_fixed_s / chunk

    def computed(self, pages: int, seconds: float) -> None:
        """A chunk of `pages` took `seconds`: compute's rate from now on -- its per-page and fixed parts scaled
        alike by what the chunk took against what they predicted (a CPU slowed by other work slows both) --
        unless the chunk took no longer than the floor (its time was the floor's, not its pages')."""
        with self.lock:
            if self.page_compute_s is not None and seconds > self.chunk_floor_s:
                if self.chunk_fixed_s:
                    scale = seconds / (self.chunk_fixed_s + pages * self.page_compute_s)
                    self.page_compute_s *= scale
                    self.chunk_fixed_s *= scale
                else:
                    self.page_compute_s = seconds / pages


@torch.inference_mode()
def meet_prefill(model: LlamaModel, span_ids: torch.Tensor, new_ids: torch.Tensor, *, prefix_len: int,
                 source: PageSource, prefix_loader: Optional[Callable[[int], torch.Tensor]] = None, chunk: int = 1,
                 split: Optional[int] = None, page_compute_s: Optional[float] = None, min_read_share: float = 0.0,
                 page_read_s: float = 0.0, chunk_floor_s: float = 0.0, chunk_fixed_s: float = 0.0,
                 from_disk: bool = False,
                 rope: Optional[Rope] = None, inputs: bool = False, loaders: int = 1,
                 out: Optional[torch.Tensor] = None, early: Optional[Mapping[int, Future]] = None) -> MeetResult:
    """Prefill `new_ids` after the prefix (`prefix_loader(layer)` -> [prefix_len, 2, kv_heads, head_dim], called
    once per layer) and the stored span whose token ids are `span_ids` (see the module docstring). `chunk`: the most
    pages compute takes at once (a forced split or a plain race takes this many).
    `split`: compute exactly the first `split` pages and load the rest. `page_compute_s`: an estimate of one page's
    compute, for the claim rule (None: a plain race); with it, `min_read_share`: compute claims pages only while the
    loader's reads take at least this share of a page's compute (else the loader takes the span alone), and
    `page_read_s`: an estimate of one page's read, used until the loader's first read is in; `chunk_floor_s`: the
    least seconds a chunk takes however few its pages (on a GPU, the host's time to launch a chunk's kernels: a claim
    of a few pages then costs what many would; 0 on a CPU); `chunk_fixed_s`: seconds every chunk takes beyond its
    pages' `page_compute_s` each (on a CPU, the model's weights read from memory once per chunk: there a chunk of k
    pages takes chunk_fixed_s + k x page_compute_s, measured affine, policy/kvpr.py); `from_disk`: the
    span's files are known to be out of the OS page cache, so its reads reach the storage: compute claims its first
    chunk at once on the estimates instead of first waiting for the loader's first read (which looks for a span
    still in the page cache; behind a throttle the first reads come in a fast burst and kept compute out for 0.06-0.17
    s of 0.4-0.7 s loads). `rope`: the
    rotation (`LlamaModel.qkv`; a server passes its own kernel, so that computed keys match the ones it stored).
    `inputs`: also return the new tokens' attention inputs (to store them as activations in turn). `loaders`: threads
    reading pages at once (`source.read` is then called from several threads; a CPU model only, a CUDA model's loader
    is one thread): a disk that serves several reads at once brings a span in faster, and the pages' copies spread
    over the cores (while compute runs they compete with it for them). `out`: where the prefix's KV is gathered (once
    per layer: attention then reads it in place) and the result's goes, [layers, prefix_len + |S| + |C|, 2, kv_heads,
    head_dim] on the model's device (a server's reused buffer, `KVScratch`); default a new one. `early`: pages read
    before this call (engine/early_reads.py), page -> a future of its `StoredPage`: those in one run up to the span's
    last page (and not below `split`) are the loader's from the start, placed first without a read (their times are
    no reads: compute's rule decides by the reads still to come); the rest are ignored."""
    ps, pages = source.page_size, source.pages
    s, n, p = pages * ps, new_ids.shape[0], prefix_len
    if span_ids.shape[0] != s or n < 1 or pages < 1:
        raise ValueError(f"{span_ids.shape[0]} span ids for {pages} pages of {ps}, {n} new tokens")
    if p and prefix_loader is None:
        raise ValueError("prefix_len > 0 needs a prefix_loader")
    if split is not None and not 0 <= split <= pages:
        raise ValueError(f"split {split} outside 0..{pages}")
    dev = model.device
    model.reserve_positions(p + s + n)
    span_ids, new_ids = span_ids.to(dev), new_ids.to(dev)
    full = model.empty_kv(p + s + n) if out is None else out  # the prefix's rows, the span's, the new tokens'
    if full.shape != (model.cfg.layers, p + s + n, 2, model.cfg.kv_heads, model.cfg.head_dim):
        raise ValueError(f"out is {tuple(full.shape)}, the prefix, the span and the new tokens need {p + s + n} tokens")
    out = full[:, p:]  # the span's rows, then the new tokens' (what the loader fills and the result holds)
    copies = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # the loader's stream on a CUDA model
    workers = 1 if copies is not None else max(1, loaders)
    claims = _Claims(pages, split, page_compute_s, min_read_share, page_read_s, first_in_flight=copies is None,
                     workers=workers, chunk_floor_s=chunk_floor_s, chunk_fixed_s=chunk_fixed_s)
    claims.hand_over(early or {})
    errors: list[BaseException] = []
    # (on a CUDA model a page arrives whole in one buffer, then is spread over the layers: no allocation per page)
    stage = torch.empty_like(out[:, :ps]) if copies is not None else None

    @torch.inference_mode()  # (thread-local: the loader writes into the result, an inference tensor)
    def load() -> None:
        with _on_stream(copies):
            while not errors:
                got = claims.next_early()
                page = got[0] if got is not None else claims.next_load()
                if page is None:
                    return
                t0 = time.perf_counter()
                try:
                    stored = got[1].result() if got is not None else source.read(page)
                    recomputed = _place(model, stored, out[:, page * ps : (page + 1) * ps],
                                        torch.arange(p + page * ps, p + (page + 1) * ps, device=dev), rope, stage)
                    if copies is not None:
                        copies.synchronize()  # the page is on the device: its read time is the transfer's
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller's thread
                    errors.append(exc)
                    return
                if got is not None:
                    claims.early_placed(recomputed == 1)
                else:
                    claims.loaded(time.perf_counter() - t0, recomputed == 1)

    if copies is not None:  # (`out` may reuse memory that kernels queued before this call still touch)
        copies.wait_stream(torch.cuda.current_stream(dev))
    pool = one_thread_pool("meet-load", workers)  # torch on one thread each: spinning workers would slow compute's
    loading = [pool.submit(load) for _ in range(workers)]
    t0 = time.perf_counter()
    computed = 0
    chunks: list[tuple[float, int, float]] = []
    try:
        if p:  # (while the loader reads its first pages)
            for layer in range(model.cfg.layers):
                full[layer, :p] = prefix_loader(layer)
        relook_s = claims.full_page_s(chunk) * (min_read_share or 1.0) if page_compute_s is not None else 0.0
        if split is None and page_compute_s is not None and not from_disk:
            claims.wait_read(relook_s)  # the loader's first read, if it is quick (a span in the page cache)
        while not errors and (pages_now := claims.next_chunk(chunk)) is not None:
            if not pages_now:  # the loader would get there first at its current rate: look again a little later
                claims.wait_done(relook_s)
                continue
            t_chunk = time.perf_counter()
            _prefill_pages(model, span_ids, full, pages_now, ps, p, rope, p + s + n)
            if copies is not None:
                torch.cuda.current_stream(dev).synchronize()  # the chunk is done, not only queued
            claims.computed(len(pages_now), time.perf_counter() - t_chunk)
            chunks.append((t_chunk - t0, len(pages_now), time.perf_counter() - t_chunk))
            computed = pages_now.stop
        compute_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        for loader in loading:
            loader.result()
        wait_s = time.perf_counter() - t1
    finally:
        errors.append(RuntimeError("stopped"))  # (a no-op once done) the loader stops at its next page
        pool.shutdown(wait=True)
    if len(errors) > 1:
        raise errors[0]
    if copies is not None:
        torch.cuda.current_stream(dev).wait_stream(copies)
    t_new = time.perf_counter()
    x = model.embed(new_ids)
    positions = torch.arange(p + s, p + s + n, device=dev)
    xs = torch.empty(model.cfg.layers, n, model.cfg.hidden, dtype=model.dtype, device=dev) if inputs else None
    for layer in range(model.cfg.layers):
        if xs is not None:
            xs[layer] = model.attention_input(layer, x)
        q, k, v = model.qkv(layer, x, positions, rope)
        out[layer, s:, 0], out[layer, s:, 1] = k, v
        x = model.finish_layer(layer, x, _attend(q, full[layer], p, p + s))
    if copies is not None:
        torch.cuda.current_stream(dev).synchronize()  # (timed as done, not as queued)
    return MeetResult(out, x[-1], computed, len(claims.reads) + claims.placed_early, claims.recomputed, compute_s,
                      claims.ended - claims.began, wait_s, xs, tuple(claims.reads), tuple(chunks),
                      time.perf_counter() - t_new, claims.placed_early)


def _on_stream(stream: Optional[torch.cuda.Stream]):
    """`torch.cuda.stream(stream)`, or nothing for None (a CPU model)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _place(model: LlamaModel, page: StoredPage, out: torch.Tensor, positions: torch.Tensor,
           rope: Optional[Rope], stage: Optional[torch.Tensor] = None) -> int:
    """Write a read page into `out` [layers, page_size, 2, H, D] (on the model's device: a host page is copied
    without blocking, which is asynchronous from pinned memory, into `stage` first where given: one contiguous
    transfer); 1 if its K and V were recomputed from activations."""
    if page.x is None:
        if stage is not None:
            stage.copy_(page.kv, non_blocking=True)
            out.copy_(stage)
        else:
            out.copy_(page.kv, non_blocking=True)
        return 0
    x = page.x.to(device=out.device, non_blocking=True)
    for layer in range(model.cfg.layers):
        out[layer, :, 0], out[layer, :, 1] = model.kv_from_input(layer, x[layer].to(model.dtype), positions, rope)
    return 1


def _prefill_pages(model: LlamaModel, span_ids: torch.Tensor, full: torch.Tensor, pages: range, ps: int, p: int,
                   rope: Optional[Rope], total: int) -> None:
    """Compute the KV of span pages `pages` into `full` [layers, p + ..., 2, H, D] (the prefix's KV in its first `p`
    rows: a chunked prefill over the prefix and the pages before them). On a CPU their attention rounds as the
    server's prefill of the whole prompt after the prefix (`total` tokens in all) would (`part_attention`), so the
    pages' KV is what SGLang's own prefill computes, bit for bit."""
    a, b = p + pages.start * ps, p + pages.stop * ps
    x = model.embed(span_ids[a - p : b - p])
    positions = torch.arange(a, b, device=x.device)
    masks: dict = {}  # (the same for every layer of the chunk)
    for layer in range(model.cfg.layers):
        q, k, v = model.qkv(layer, x, positions, rope)
        full[layer, a:b, 0], full[layer, a:b, 1] = k, v
        x = model.finish_layer(layer, x, _attend(q, full[layer, :b], p, a, None if q.is_cuda else total, masks))


def _attend(q: torch.Tensor, kv: torch.Tensor, p: int, offset: int, total: Optional[int] = None,
            masks: Optional[dict] = None) -> torch.Tensor:
    """Causal attention of queries `q` (the last of the keys, after `offset` earlier ones) over `kv` [tokens, 2, H,
    D] (the prefix's `p` rows first); with `total`, rounded as one extend of [p, total) rounds them
    (`part_attention`, its masks kept in `masks`)."""
    if total is not None:
        return part_attention(q, kv[:, 0], kv[:, 1], offset, prefix=p, total=total, masks=masks)
    return causal_attention(q, kv[:, 0], kv[:, 1], offset)


class MemoryPages:
    """A span held in memory (tests, engine benchmarks): its full KV [layers, pages * page_size, 2, H, D] and, if
    given, its attention inputs `x` [layers, pages * page_size, hidden] -- pages below `x_pages` are then read as
    activations; `delay_s` per page read imitates a storage speed, `fail` names pages whose read raises."""

    def __init__(self, kv: torch.Tensor, page_size: int, delay_s: float = 0.0, fail: frozenset = frozenset(),
                 x: Optional[torch.Tensor] = None, x_pages: int = 0):
        self.kv, self.page_size, self.pages = kv, page_size, kv.shape[1] // page_size
        self.delay_s, self.fail, self.x, self.x_pages = delay_s, fail, x, x_pages if x is not None else 0
        self.reads: list[int] = []

    def read(self, page: int) -> StoredPage:
        if self.delay_s:
            time.sleep(self.delay_s)
        if page in self.fail:
            raise SpanMiss(f"page {page} unreadable")
        self.reads.append(page)
        rows = slice(page * self.page_size, (page + 1) * self.page_size)
        if page < self.x_pages:
            return StoredPage(x=self.x[:, rows].clone())
        return StoredPage(kv=self.kv[:, rows].clone())
