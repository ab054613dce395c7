"""Compute the front of a stored span while loading its back (Cake: "Compute Or Load KV Cache? Why Not Both?",
arXiv 2410.03065), exact, on the layer-by-layer engine, for any Llama-family model.

A prompt = an exact prefix P (its KV already in memory), a stored span S of whole pages and new tokens C. Two workers
share S's pages: compute (the caller's thread) prefills chunks of up to `chunk` pages from the front, each attending
to P and the pages before it; the loader (`loaders` background threads) reads whole pages from the back, the last
first -- every layer's K and V, or where a page's activations are stored, every layer's attention input X, from which
it recomputes K and V (KVPR). Every page is claimed by exactly one of them; they meet wherever the storage's and the
CPU's speeds put the point, and `split` forces it instead. Then C's layers run over [P, S, C] as a full prefill would.
Exact by construction: every token's KV is either computed from the true prefix or the stored copy of it.

A chunk cannot be abandoned halfway, so with an estimate of a page's compute (`page_compute_s`) compute claims the
chunk that ends the span soonest (`best_claim`) at the loader's current rate: the mean of its last reads, the read in
flight counted once it has taken longer, the caller's `page_read_s` before the first read is in. Both rates are this
load's own, so the rule follows a disk or a CPU that slows down under load. Without an estimate the two simply race.

A page the loader cannot read (`SpanMiss`) abandons the whole load: raised to the caller, who falls back.

On a CUDA model the loader's copies (from pinned host memory) run on a CUDA stream of its own, each waited for on
the loader's thread, and each compute chunk is waited for before the next claim; there the first read in flight does
not count (a CUDA loader's first copy takes 2-4x its next ones, measured).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
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


def best_claim(free: int, compute_s: float, read_s: float, floor_s: float = 0.0) -> int:
    """Pages compute should take of `free` unclaimed ones, a page computed in `compute_s` while the loader reads one
    in `read_s`: the k that ends the span soonest, max(k x compute_s, (free - k) x read_s) (the smaller k on a tie),
    and none unless it ends before the loader alone would. A chunk that takes at least `floor_s` however few its
    pages (a GPU host launching its kernels) takes as many pages as the floor pays for once it binds."""
    k = int(free * read_s / (read_s + compute_s))  # where the two lines cross, rounded down
    if k < free:
        k = min((k, k + 1), key=lambda j: (max(j * compute_s, (free - j) * read_s), j))
    if floor_s and 0 < k < free and max(k * compute_s, (free - k) * read_s) < floor_s:  # the floor binds
        k = min(free, max(k, int(floor_s / compute_s)))
    return k if k and max(floor_s, k * compute_s, (free - k) * read_s) < free * read_s else 0


class _Claims:
    """Which pages compute and the loader hold: [0, front) compute's, [low, pages) the loader's (shared, locked),
    and the rates compute decides by. The loader may be `workers` threads, each reading one page at a time: a page
    then comes in every (seconds per read) / workers."""

    def __init__(self, pages: int, split: Optional[int], page_compute_s: Optional[float], page_read_s: float = 0.0,
                 first_in_flight: bool = True, workers: int = 1, chunk_floor_s: float = 0.0) -> None:
        self.front, self.low = 0, pages
        self.split = split  # compute stops here and the loader never goes below it (None: they meet)
        self.page_compute_s = page_compute_s  # compute's seconds per page (None: claim whenever a page is free)
        self.page_read_s = page_read_s  # the estimate of a read until one is in
        self.first_in_flight = first_in_flight  # whether the first read's time in flight counts before it is in
        self.workers = workers
        self.chunk_floor_s = chunk_floor_s  # the least seconds a chunk takes (a GPU host's kernel launches)
        self.reads: list[float] = []  # the loader's seconds per page so far (each on its own thread)
        self.started: deque[float] = deque()  # when the reads in flight began, oldest first
        self.recomputed = 0  # pages the loader recomputed from activations
        self.began = self.ended = 0.0  # the loader's first read and its last page placed (time.perf_counter())
        self.lock = threading.Lock()
        self.read_done = threading.Condition(self.lock)

    def next_chunk(self, chunk: int) -> Optional[range]:
        """Compute's next pages (at most `chunk`); an empty range: not now (the loader would be there first at its
        current rate); None: done (it reached the loader or the forced split)."""
        with self.lock:
            limit = self.low if self.split is None else min(self.low, self.split)
            free = limit - self.front
            if free <= 0:
                return None
            take = min(chunk, free)
            if self.split is None and self.page_compute_s is not None:
                recent = self.reads[-4:]  # (one stall between fast reads is not the rate; a run of slow ones is)
                per_read = sum(recent) / len(recent) / self.workers if recent else self.page_read_s
                if self.started and (self.reads or self.first_in_flight):
                    in_flight = time.perf_counter() - self.started[0]
                    per_read = max(per_read, (sum(recent) + in_flight) / (len(recent) + 1) / self.workers)
                take = min(take, best_claim(free, self.page_compute_s, per_read, self.chunk_floor_s))
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

    def computed(self, pages: int, seconds: float) -> None:
        """A chunk of `pages` took `seconds`: compute's rate from now on (unless the chunk took no longer than the
        floor: its time was the floor's, not its pages')."""
        with self.lock:
            if self.page_compute_s is not None and seconds > self.chunk_floor_s:
                self.page_compute_s = seconds / pages


@torch.inference_mode()
def meet_prefill(model: LlamaModel, span_ids: torch.Tensor, new_ids: torch.Tensor, *, prefix_len: int,
                 source: PageSource, prefix_loader: Optional[Callable[[int], torch.Tensor]] = None, chunk: int = 1,
                 split: Optional[int] = None, page_compute_s: Optional[float] = None, page_read_s: float = 0.0,
                 chunk_floor_s: float = 0.0, rope: Optional[Rope] = None, inputs: bool = False, loaders: int = 1,
                 out: Optional[torch.Tensor] = None) -> MeetResult:
    """Prefill `new_ids` after the prefix (`prefix_loader(layer)` -> [prefix_len, 2, kv_heads, head_dim], called
    once per layer) and the stored span whose token ids are `span_ids` (see the module docstring).

    `chunk`: the most pages compute takes at once. `split`: compute exactly the first `split` pages and load the
    rest. `page_compute_s`: an estimate of one page's compute for the claim rule (None: a plain race), with
    `page_read_s`, one page's read until the first is in; `chunk_floor_s`: the least seconds a chunk takes however
    few its pages (a GPU host's kernel launches; 0 on a CPU). `rope`: the rotation (a server passes its own kernel,
    so that computed keys match the ones it stored). `inputs`: also return the new tokens' attention inputs.
    `loaders`: threads reading pages at once (a CPU model only). `out`: where the prefix's KV is gathered and the
    result's goes, [layers, prefix_len + |S| + |C|, 2, kv_heads, head_dim] on the model's device (a server's reused
    buffer); default a new one."""
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
    claims = _Claims(pages, split, page_compute_s, page_read_s, first_in_flight=copies is None, workers=workers,
                     chunk_floor_s=chunk_floor_s)
    errors: list[BaseException] = []
    # (on a CUDA model a page arrives whole in one buffer, then is spread over the layers: no allocation per page)
    stage = torch.empty_like(out[:, :ps]) if copies is not None else None

    @torch.inference_mode()  # (thread-local: the loader writes into the result, an inference tensor)
    def load() -> None:
        with _on_stream(copies):
            while not errors and (page := claims.next_load()) is not None:
                t0 = time.perf_counter()
                try:
                    recomputed = _place(model, source.read(page), out[:, page * ps : (page + 1) * ps],
                                        torch.arange(p + page * ps, p + (page + 1) * ps, device=dev), rope, stage)
                    if copies is not None:
                        copies.synchronize()  # the page is on the device: its read time is the transfer's
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller's thread
                    errors.append(exc)
                    return
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
        relook_s = page_compute_s or 0.0
        if split is None and page_compute_s is not None:
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
    return MeetResult(out, x[-1], computed, len(claims.reads), claims.recomputed, compute_s,
                      claims.ended - claims.began, wait_s, xs, tuple(claims.reads), tuple(chunks),
                      time.perf_counter() - t_new)


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
