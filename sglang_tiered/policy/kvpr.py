"""Compute-or-load decisions for a stored span (KVPR and the two-sided loader of engine/meet.py). Pure arithmetic,
no torch, no SGLang.

A stored span is filled by two workers that meet where the disk's and the CPU's speeds put them (engine/meet.py):
compute prefills pages from the front, from their token ids; the loader reads pages from the back -- as KV
(`kv_bytes` per token-layer), or, where a page's activations are stored and that is cheaper, as its attention
inputs X (`x_bytes` per token-layer) from which it recomputes K and V (`recompute_s` per token-layer). The meet
itself needs no plan; what is decided here, per request, from the measured `Profile`:

* `gate`: whether activations can ever pay on this model (X smaller than the KV it replaces: MHA models; GQA models
  such as SmolLM2 store none);
* `activations_pay`: whether the loader brings a page in faster as X than as KV at the measured read rate
  (`activation_read_s`): on one thread, read then recompute, x_bytes / v + recompute_s against kv_bytes / v (per
  token-layer); where that is too fast for compute to join, on MEET_LOADERS threads, one page's read beside another's
  recompute: max(x_bytes / v, the activation loads' own measured cost, recompute_s until one is in);
* `meet_pays`: whether to take the span at all (`auto`) rather than leave it to SGLang's own load (which reports
  the hit in SGLang's own cached-token counts): only where reading it takes longer than computing MEET_MIN_PAGES of
  its pages;
* whether compute joins a load: only while a page reads in at least MEET_MIN_READ_SHARE of a page's compute (the
  claim rule in engine/meet.py measures both as the load runs; the loader alone takes the span otherwise). A page's
  compute is its share of a chunk of MEET_CHUNK_PAGES pages (`chunk_page_s`): a chunk takes `Profile.chunk_s`
  whatever its length -- on a CPU the model's weights are read from memory once per chunk -- plus `span_s` per
  token-layer, both measured (engine/kvpr_profile.py `measure_chunks`).
  `auto` takes a span on which compute may not join (a page read below MEET_TAKE_READ_SHARE of a page's compute)
  only where the loader reads activations: reading KV alone, our loader is SGLang's load with more CPU work per
  byte (measured on one loader thread: 1.24x / 1.36x SGLang's load on the MHA model at the disk's own speed, 4096 /
  8064 tokens; `--tiered-kvpr-choice measured` times the two where compute would not join);
* `beside`: compute priced as measured beside a loader (`chunk_slowdown`: a load's chunks against their estimates;
  the profile measures compute alone, and on a CPU the loader's copies and recomputes take cores from it);
* `loaders`: how many threads read pages at once -- MEET_LOADERS where the loader is expected to take the span
  alone (a disk serves two reads at once faster than one after the other), one where compute may join (the threads'
  copies would take the cores from compute).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

from sglang_tiered.policy.compute_choice import ALONE, COMPUTE, MEET
from sglang_tiered.policy.load_choice import EXPLORE_MAX
from sglang_tiered.policy.read_rate import moving_average


@dataclass(frozen=True)
class Profile:
    """Measured speeds of this machine for the served model (see engine/kvpr_profile.py)."""

    read_bytes_per_s: float  # the SSD read path, page cache bypassed
    recompute_s: float  # seconds to recompute K and V of one token in one layer from its activations
    layer_s: float  # seconds of one layer of the model for one new token (projections and MLP, no long attention)
    stored_s: float = 0.0  # compute-stream seconds per stored token-layer, however it arrived (assembling the
    #                        span's KV, attending over it, writing it to the pool)
    x_load_s: float = 0.0  # wall seconds per token-layer of loads that read only activations on MEET_LOADERS
    #                        threads, as measured (integration/kvpr.py); 0: none yet
    chunk_s: float = 0.0  # seconds a chunk of span pages computed from token ids takes whatever its length (the
    #                       model's weights read from memory once per chunk), beyond `span_s` per token-layer
    span_s: float = 0.0  # seconds per span token-layer computed in a chunk, beyond `chunk_s`; 0: not measured (a
    #                      page then costs its tokens' `layer_s + stored_s`, and a chunk nothing more)
    slowdown: Optional[float] = None  # compute's parts priced at this factor beside a loader (`beside`); None:
    #                                   compute as measured alone


@dataclass(frozen=True)
class Shape:
    """Bytes per token per layer of the two stored representations."""

    layers: int
    x_bytes: int  # hidden * itemsize
    kv_bytes: int  # 2 * kv_heads * head_dim * itemsize


def gate(shape: Shape) -> Optional[str]:
    """None if activations can pay on this model, else why not."""
    if shape.x_bytes >= shape.kv_bytes:
        return (f"activations are {shape.x_bytes / shape.kv_bytes:.2f}x the size of the KV they would replace "
                "(hidden size >= 2 x kv_heads x head_dim): a GQA model, nothing to save")
    return None


# compute joins a load only while a page reads in at least this share of a page's compute: the two-sided load then
# finishes in c / (c + t) of the loader's time (c, t: seconds per computed / read page), a gain below 20 % that the
# two sides' contention for the CPU eats (measured in one run, SmolLM2 bf16: at 200 MB/s, a 4096-token span, a read
# 9 ms against 45 ms of compute, two-sided 0.643 s vs the loader alone 0.584 s; at the disk's own speed 0.326 vs
# 0.261 s)
MEET_MIN_READ_SHARE = 0.25

# the gain compute must promise to join an activation load once its slowdown beside a loader is measured (`beside`
# prices the contention MEET_MIN_READ_SHARE stood in for): only the swing of that factor from load to load (1.5-2.05x
# in one run moved the estimate of the two together by +-5 %). Measured (the MHA model, AMD AVX2, float32, 25 MB/s,
# a second client busy): with MEET_MIN_READ_SHARE on top of factors of 1.5-2.05x, compute stayed out of loads that,
# joined, brought a page in every 0.14 s against 0.18 s for two loader threads alone (8064 tokens: 17.5-18.3 s
# joined, 23.0-23.2 s alone), 10-23 % faster on paper
MEET_PRICED_MARGIN = 0.1


def join_margin(prof: Profile) -> float:
    """The gain compute must promise to join an activation load (`activation_read_s`): MEET_PRICED_MARGIN where
    `prof` prices compute `beside` a loader as measured, MEET_MIN_READ_SHARE (standing in for that contention)
    where it does not."""
    return MEET_MIN_READ_SHARE if prof.slowdown is None else MEET_PRICED_MARGIN


def activations_pay(shape: Shape, prof: Profile, page_size: int) -> bool:
    """Does the loader bring a page in faster as activations (K, V recomputed) than as KV, under `prof`?"""
    if gate(shape) is not None:
        return False
    return activation_read_s(shape, prof, page_size)[0] < page_read_s(shape, prof, page_size, False)


def page_compute_s(prof: Profile, layers: int, page_size: int) -> float:
    """Seconds one more page adds to a chunk of a stored span prefilled from its token ids (every layer; a chunk
    also takes `prof.chunk_s` whatever its length). Without a measured chunk (`span_s` 0): its tokens' layer time
    (the attention over what came before it is in `stored_s`, small next to the projections and the MLP)."""
    return layers * page_size * (prof.span_s or prof.layer_s + prof.stored_s)


def chunk_page_s(prof: Profile, layers: int, page_size: int, pages: int = 0) -> float:
    """Seconds per page of a chunk of `pages` pages (default MEET_CHUNK_PAGES, the most compute takes at once): its
    fixed part shared out. Measured in one run (SmolLM2, bf16, an Intel Xeon with AMX, 64-token pages): chunks of
    1 / 2 / 4 / 8 pages took 89 / 127 / 188 / 315 ms -- 57 ms a chunk and 32 ms a page -- where one page's layer
    time put every page at 91 ms."""
    pages = pages or MEET_CHUNK_PAGES
    return prof.chunk_s / pages + page_compute_s(prof, layers, page_size)


def page_read_s(shape: Shape, prof: Profile, page_size: int, activations: bool) -> float:
    """Seconds for the loader to bring one page in: its KV read, or its activations read and K, V recomputed
    (`activation_read_s`)."""
    if activations:
        return activation_read_s(shape, prof, page_size)[0]
    return shape.layers * page_size * shape.kv_bytes / prof.read_bytes_per_s


def activation_read_s(shape: Shape, prof: Profile, page_size: int) -> tuple[float, int]:
    """(seconds per page, threads) for the loader bringing pages in as activations: alone on MEET_LOADERS threads,
    or on one thread beside compute, whichever the join rule picks. Alone, one page's read runs beside another's
    recompute, so a page every max(read, recompute) -- the recompute term the activation loads' own measured cost
    once one is in (`x_load_s`), the profile's one-thread recompute before (two threads do not halve it: on the MHA
    model, 2 cores, activation loads measured 9.9-10.1 us per token-layer at the disk's own speed and at 200 MB/s
    against 8.2-8.3 us for one recompute on one thread). Beside compute (`chunk_page_s` a page), one thread reads
    then recomputes, and the two together bring a page in every both = one x c / (one + c). Compute joins where
    both x (1 + margin) <= alone, the margin `join_margin(prof)`: MEET_MIN_READ_SHARE, the rule for KV (a read of
    at least that share of a page's compute), where one thread and two read at the disk's one rate, standing in for
    the two sides' contention for the CPU until compute's slowdown beside a loader is measured; MEET_PRICED_MARGIN
    once `prof` is compute `beside` a loader as measured. Measured (MHA model, Intel with AMX, bf16, 200 MB/s,
    8064 tokens): reads of 9.4 ms a page alone against 37.4 ms of compute a page put the two-thread rate at the KV
    rule's threshold, compute joined a one-thread loader, both sides ran 2-3.5x slower than their estimates beside
    each other's CPU work (the recompute is CPU work too), and the load took 1.11x SGLang's against the loader
    alone's 0.74x."""
    return _activation_plan(shape, prof, page_size)[:2]


def _activation_plan(shape: Shape, prof: Profile, page_size: int) -> tuple[float, int, float]:
    """`activation_read_s`'s (seconds per page, threads), and the share of a page's compute (c) that the loader's
    measured pages must reach for compute to join them at run time (`Decision.join_share`). The join rule,
    both x (1 + margin) <= alone with both = one x c / (one + c), rearranged: alone / c >= (1 + margin) x one /
    (one + c) -- so on two threads the run-time rule is that share (at least the KV rule's), on one thread the KV
    rule."""
    tokens = shape.layers * page_size
    apart = alone_page_s(shape, prof, page_size, True)
    one = tokens * (shape.x_bytes / prof.read_bytes_per_s + prof.recompute_s)
    c = chunk_page_s(prof, shape.layers, page_size)
    share = (1 + join_margin(prof)) * one / (one + c)
    if apart < share * c:
        return apart, MEET_LOADERS, max(MEET_MIN_READ_SHARE, share)
    return one, 1, MEET_MIN_READ_SHARE


# the most pages compute prefills at once in a two-sided load: a wider chunk runs wider matrix products (on the CPU
# here 4 pages took 0.55-0.77x the time per page of 1 page at a time, measured against each other in one run), but a
# chunk cannot be abandoned, so the claim rule (engine/meet.py) may take fewer; more than 4 overshot the meet when the
# first reads from a throttled disk were slow
MEET_CHUNK_PAGES = 4

# `auto` takes a span that the loader would read as KV only where the profile puts a page's read at this share of a
# page's compute or more: the profile's estimate is looser than the engine's rule above because the engine decides
# on the load's own measured rates (compute chunks of 4 pages run 0.55-0.77x a page's time; measured in one run,
# SmolLM2 bf16, 200 MB/s: the profile said 8.7 ms a read against 62.8 ms a page (0.14), the loads met at page 12 of
# 126 and finished in 1.05 s against 1.31 s for SGLang's load); below it (the MHA model at the disk's own speed:
# 0.04) SGLang loads the span
MEET_TAKE_READ_SHARE = MEET_MIN_READ_SHARE / 2

# loader threads for a span the loader is expected to take alone: reading files of 4.2 MB (the MHA model's pages) from
# this machine's own disk with the page cache dropped, 2 at once took 0.65-0.9x the time of 1 after the other (4 at
# once no better than 2); each page's checksum and copy then also run beside another's, on 2 cores
MEET_LOADERS = 2


# `auto` takes a span only where reading it takes longer than computing this many pages: below, our loader could
# gain a few milliseconds at most, and SGLang's own load keeps the hit in SGLang's cached-token counts
MEET_MIN_PAGES = 2


def meet_pays(pages: int, read_s: float, page_s: float, chunk_s: float = 0.0) -> bool:
    """`auto`: take a stored span of `pages` pages with our loader rather than SGLang's whole load only if reading it
    (`read_s` per page) takes longer than computing MEET_MIN_PAGES pages in one chunk (`chunk_s` + `page_s` each)."""
    return pages * read_s > chunk_s + MEET_MIN_PAGES * page_s


@dataclass(frozen=True)
class Decision:
    """What the loader does with a stored span, decided from the profile before it starts."""

    take: bool  # our loader takes the span (else SGLang's own load)
    activations: bool  # it reads pages as activations where stored (else as KV)
    read_s: float  # seconds to bring one page in, as it reads them
    page_s: float  # seconds one more page adds to a chunk computed from token ids (`page_compute_s`)
    chunk_s: float  # seconds a chunk takes whatever its length (`Profile.chunk_s`)
    compute_joins: bool  # reads are slow enough next to compute for compute to take pages (engine/meet.py decides
    #                      again as the load runs, from the speeds it measures)
    join_share: float = MEET_MIN_READ_SHARE  # that run-time rule: compute joins only while the loader brings a page
    #                      in every this share of a page's compute or slower (engine/meet.py's `min_read_share`)


def decide(shape: Shape, prof: Profile, pages: int, page_size: int, *, stored_activations: bool,
           forced: bool) -> Decision:
    """The loader's plan for a span of `pages` pages: activations wherever stored when `forced`, else where they pay;
    taken always when `forced`, else where `meet_pays` and either the loader reads activations or compute may join
    (a page read takes MEET_TAKE_READ_SHARE of a page's compute or more; alone on KV the loader only repeats
    SGLang's load, slower). A page's compute here: its share of a chunk of MEET_CHUNK_PAGES (`chunk_page_s`)."""
    use_x = stored_activations and (forced or activations_pay(shape, prof, page_size))
    page_s, full_s = page_compute_s(prof, shape.layers, page_size), chunk_page_s(prof, shape.layers, page_size)
    if use_x:  # (the join rule for activations weighs the loader alone on two threads: activation_read_s)
        read_s, threads, share = _activation_plan(shape, prof, page_size)
        joins = threads == 1
    else:
        read_s, share = page_read_s(shape, prof, page_size, False), MEET_MIN_READ_SHARE
        joins = read_s >= share * full_s
    take = forced or (meet_pays(pages, read_s, page_s, prof.chunk_s) and
                      (use_x or read_s >= MEET_TAKE_READ_SHARE * full_s))
    return Decision(take, use_x, read_s, page_s, prof.chunk_s, joins, share)


def warm_alone(pages: int, warm: int, d: Decision) -> bool:
    """`auto`, on a span compute would gain on (`d.take`) whose last `warm` of `pages` pages have their files in the
    OS page cache (read at memory speed): our loader alone reads it -- the cold pages left read faster than computing
    MEET_MIN_PAGES pages (`meet_pays` false for them), so compute's first chunk would outlast the whole load (measured
    in stop 64: the MHA model's 4096 tokens read into the page cache at arrival, two-sided computed 4 pages in
    0.37-0.51 s beside a 0.08 s read; the loader alone read all 64 in 0.05-0.06 s)."""
    return warm > 0 and not meet_pays(pages - warm, d.read_s, d.page_s, d.chunk_s)


def beside(prof: Profile, slowdown: float) -> Profile:
    """`prof` (compute as measured alone) with compute's parts (a layer, a stored token-layer, a chunk's fixed part,
    a span token-layer) taking `slowdown` times as long: compute as measured beside a loader (`chunk_slowdown`),
    and the activation join rule's margin with it (`join_margin`). The loader's parts (the read rate, the
    recompute) are the load's own measurements already."""
    assert prof.slowdown is None, "a profile is priced once"
    return replace(prof, layer_s=prof.layer_s * slowdown, stored_s=prof.stored_s * slowdown,
                   chunk_s=prof.chunk_s * slowdown, span_s=prof.span_s * slowdown, slowdown=slowdown)


def chunk_slowdown(chunks: Sequence[tuple[float, int, float]], load_s: float, chunk_s: float,
                   page_s: float) -> Optional[float]:
    """How many times its estimate compute took beside the loader in one load: the seconds of the chunks that began
    while the loader was reading (`chunks`: (seconds into the load, pages, seconds) each; the loader read for
    `load_s` seconds from the start) over what `chunk_s` + pages x `page_s` each predicted; None without such a
    chunk. Measured (the MHA model, Intel with AMX, bf16, 2 cores, 200 MB/s): a 4-page chunk beside a loader
    recomputing K and V from activations took 2.1-3.4x its estimate, beside a KV loader 1.2-2.0x; claims sized on
    the profile alone overshot the meet (a 1024-token span's one chunk outlasted the loader by 0.1 s)."""
    took = predicted = 0.0
    for at, pages, seconds in chunks:
        if at < load_s:
            took += seconds
            predicted += chunk_s + pages * page_s
    return took / predicted if predicted > 0 else None


def forward_s(prof: Profile, layers: int, tokens: int, prefix: int = 0) -> float:
    """The profile's seconds for one forward computing `tokens` tokens after `prefix` cached ones, as one chunk:
    `chunk_s`, each token-layer's `page_compute_s` share, and `stored_s` per prefix token-layer (attending over it).
    SGLang's own forward of the MHA model's 1056 tokens took 0.8-1.8x this in stop 47's runs (policy/compute_choice.py
    scales it by what the server measures)."""
    return prof.chunk_s + page_compute_s(prof, layers, tokens) + layers * prefix * prof.stored_s


def meet_s(pages: int, read_s: float, compute_s: float) -> float:
    """The profile's seconds for a two-sided load of `pages` pages, the loader bringing a page in every `read_s`,
    compute one every `compute_s` (`chunk_page_s`): they meet after pages / (1 / compute_s + 1 / read_s)."""
    return pages / (1 / compute_s + 1 / read_s)


def alone_page_s(shape: Shape, prof: Profile, page_size: int, activations: bool) -> float:
    """Seconds per page for the loader alone on MEET_LOADERS threads, compute taking no page: a KV page's read, or
    for activations one page's read beside another's recompute, a page every max(read, recompute) -- the recompute
    term the activation loads' own measured cost once one is in (`x_load_s`), the profile's one-thread recompute
    before (`activation_read_s`)."""
    if not activations:
        return page_read_s(shape, prof, page_size, False)
    tokens = shape.layers * page_size
    return tokens * max(shape.x_bytes / prof.read_bytes_per_s, prof.x_load_s or prof.recompute_s)


class Slowdown:
    """Compute's time beside a loader over the profile's (measured alone), per kind of load (the loader reading
    activations -- its recomputes are CPU work -- or KV): the first load's `chunk_slowdown`, then a moving average
    (`read_rate.moving_average`); 1 until measured. Thread-safe.

    A factor that keeps compute out of loads it would join at the profile's times (`kept_out`) is measured again only
    when compute joins one, so a factor taken under a passing burst of other work would keep it out for good. So such
    loads are counted (`keep_out`): after 1, then 2, 4, ... of them (at most EXPLORE_MAX) compute is let in once at
    the profile's times, a retry, and that load's sample replaces the factor (`observe(..., retry=True)`: it is newer
    than the evidence that kept compute out). Where the slowdown lasts, about log2(n) of n such loads are retries;
    after a burst that kept compute out of k loads, it is let in again within about k more. Planning a load compute
    joins by the factor starts the waits again from 1 (`joined`)."""

    def __init__(self) -> None:
        self._factor: dict[bool, float] = {}
        self._wait: dict[bool, int] = {}  # loads kept out between two retries
        self._since: dict[bool, int] = {}  # loads kept out since the last retry
        self._lock = threading.Lock()

    def factor(self, activations: bool) -> float:
        with self._lock:
            return self._factor.get(activations, 1.0)

    def observe(self, activations: bool, sample: float, *, retry: bool = False) -> float:
        """Fold one load's `sample` (times the profile) in -- a retry's replaces the factor; returns the factor after
        it."""
        with self._lock:
            old = self._factor.get(activations)
            new = sample if old is None or retry else moving_average(old, sample)
            self._factor[activations] = new
            return new

    def keep_out(self, activations: bool) -> Optional[int]:
        """Planning a load the factor keeps compute out of (`kept_out`): how many more such loads compute stays out of
        after this one, or None when this one is the retry (compute let in at the profile's times; the wait before
        the next retry doubles)."""
        with self._lock:
            wait, since = self._wait.get(activations, 1), self._since.get(activations, 0)
            if since >= wait:
                self._since[activations], self._wait[activations] = 0, min(2 * wait, EXPLORE_MAX)
                return None
            self._since[activations] = since + 1
            return wait - since - 1

    def joined(self, activations: bool) -> None:
        """Planning a load compute joins by the factor: the waits before retries start again from 1."""
        with self._lock:
            self._wait.pop(activations, None)
            self._since.pop(activations, None)

    @staticmethod
    def kept_out(alone: Decision, slowed: Decision) -> bool:
        """Did the factor keep compute out of a load (decided `slowed`) that it would join at the profile's times
        (decided `alone`)?"""
        return alone.compute_joins and not slowed.compute_joins

    def price(self, alone: Decision, redecide: Callable[[float], Decision], *, book: bool = True) -> Priced:
        """A load decided `alone` at the profile's own times, decided again by `redecide(factor)` with compute's
        estimates the profile's times `factor`. The factor, its counts (`keep_out`, `joined`) and the sample the load
        gives (`observe`) are all keyed by the kind of load the profile's own times decide (`alone.activations`): the
        factor is what compute measured beside loads planned with it, also where pricing compute changes how their
        pages are read. `book`: count kept-out and joined loads (False where the meet point is forced -- the factor
        decides nothing there -- or the load will be no sample, its pages read ahead). A retry is decided at the
        profile's times (factor 1)."""
        kind = alone.activations
        factor = self.factor(kind)
        d = redecide(factor) if factor != 1.0 else alone
        if not book:
            return Priced(d, factor, kind)
        if self.kept_out(alone, d):
            left = self.keep_out(kind)
            return Priced(alone, 1.0, kind, retry=True) if left is None else Priced(d, factor, kind, kept_out=left)
        if d.compute_joins:
            self.joined(kind)
        return Priced(d, factor, kind)


@dataclass(frozen=True)
class Priced:
    """A load's decision with compute priced as measured beside its kind of load (`Slowdown.price`)."""

    decision: Decision
    factor: float  # compute's estimates are the profile's times this (1.0: unmeasured, or a retry)
    kind: bool  # the factor's key: the profile's own times read the pages as activations
    kept_out: Optional[int] = None  # the factor kept compute out of a load it would join at the profile's times:
    #                                 how many more such loads before it is let in again
    retry: bool = False  # compute let in at the profile's times, to measure its slowdown again


def reads_as_auto(shape: Shape, prof: Profile, page_size: int, *, stored_activations: bool) -> bool:
    """Whether a forced load reads its pages as `auto` would (activations or KV): only then is it a sample of our
    loader as `auto` runs it. A forced load reads activations wherever stored (`decide`), `auto` where they pay."""
    return not stored_activations or activations_pay(shape, prof, page_size)


def loaders(d: Decision, forced_pages: Optional[int]) -> int:
    """Threads for the loader of a span decided as `d` with the meet point forced to `forced_pages` pages (None:
    they meet): MEET_LOADERS where compute computes nothing or is not expected to join, else 1."""
    return MEET_LOADERS if forced_pages == 0 or (forced_pages is None and not d.compute_joins) else 1


def early_as_kv(*, pages: int, kv_page: int, x_page: int, recompute_page_s: float, rest_page_s: float,
                queued_bytes: int, wait_s: float, bps: Optional[float]) -> bool:
    """Read a taken span's `pages` pages from admission on as KV (`kv_page` bytes each) rather than as activations
    (`x_page` bytes each; their K and V then recomputed on the forward, `recompute_page_s` a page)? The request waits
    about `wait_s` seconds for other forwards (0: its forward is next); in that time the early reader gets through
    the `queued_bytes` of loads admitted before it, then this span's pages at `bps` (None: not measured yet --
    taken as all in either way). What is not in when the forward begins costs `rest_page_s` a page there (the
    plan's way: read as it reads them, compute joining where it does). KV where the forward's expected work is no
    more: (pages - KV pages in) x rest, against activation pages in x recompute + (pages - those) x rest. So KV where
    the wait reads it all in (placing KV is a copy), activations where the wait is short next to the KV's read and
    the recompute is cheap next to a page's read; the forward next: as the plan reads them."""
    if wait_s <= 0:
        return False
    if bps is None:
        return True
    room = max(0.0, wait_s * bps - queued_bytes)
    kv_in, x_in = min(pages, int(room // kv_page)), min(pages, int(room // x_page))
    return (pages - kv_in) * rest_page_s <= x_in * recompute_page_s + (pages - x_in) * rest_page_s


@dataclass(frozen=True)
class Route:
    """How a stored span is filled: `way` (policy/compute_choice.py: MEET, ALONE or COMPUTE, a timed way; None: not
    one of them, an unmeasured load), `pages` (the meet point forced, in pages computed from token ids; None: compute
    and the loader meet where they meet), `threads` (the loader's, `loaders`)."""

    way: Optional[str]
    pages: Optional[int]
    threads: int


def route(mode: str | int, d: Decision, pages: int, page_size: int, *, anyway: bool,
          chosen: Optional[str]) -> Optional[Route]:
    """The way a span of `pages` stored pages decided as `d` is filled under `mode` (`auto`, `force`, or tokens
    computed from token ids; `off` and `compute` need no decision); None: SGLang's own load.
    `auto`: where compute would gain (`d.take`), the way `chosen` by compute_choice.Estimates (required there);
    elsewhere the loader alone (meet point 0, MEET_LOADERS threads) where our loader takes the span `anyway` (behind
    other prefills, or measured faster than SGLang's load), else SGLang's load. `force`: the two meet (a timed MEET
    where compute is expected to join). A number: that many tokens' pages computed, at most the span."""
    if mode == "force":
        return Route(MEET if d.compute_joins else None, None, loaders(d, None))
    if mode != "auto":
        forced = min(int(mode) // page_size, pages)
        return Route(None, forced, loaders(d, forced))
    if not d.take:
        return Route(None, 0, MEET_LOADERS) if anyway else None
    if chosen not in (MEET, ALONE, COMPUTE):
        raise ValueError(f"`auto` on a span compute would gain on needs the way chosen, got {chosen!r}")
    forced = 0 if chosen == ALONE else None
    return Route(chosen, forced, 0 if chosen == COMPUTE else loaders(d, forced))


def auto_example(shape: Shape, prof: Profile, page_size: int, tokens: int = 4096) -> str:
    """What `auto` does with a stored span of `tokens` tokens under `prof` (one line, for logs and the CLI)."""
    pages = tokens // page_size
    d = decide(shape, prof, pages, page_size, stored_activations=gate(shape) is None, forced=False)
    how = "as activations" if d.activations else "as KV"
    if not d.take and not meet_pays(pages, d.read_s, d.page_s, d.chunk_s):
        return (f"a {tokens}-token span: SGLang's own load (reading it, {pages * d.read_s:.3f}s {how}, is faster "
                f"than computing {MEET_MIN_PAGES} pages, {d.chunk_s + MEET_MIN_PAGES * d.page_s:.3f}s)")
    per_page = f"{chunk_page_s(prof, shape.layers, page_size) * 1e3:.1f} ms a page in chunks of {MEET_CHUNK_PAGES}"
    if not d.take:
        return (f"a {tokens}-token span: SGLang's own load (a page reads in {d.read_s * 1e3:.1f} ms {how}, too fast "
                f"next to {per_page} for compute to join)")
    if not d.compute_joins:
        return (f"a {tokens}-token span: read by our loader, {how} ({d.read_s * 1e3:.1f} ms a page against "
                f"{per_page}: compute joins if the load's own reads are slower), {pages * d.read_s:.3f}s")
    return (f"a {tokens}-token span: two-sided, pages read {how} ({d.read_s * 1e3:.1f} ms each) from the back while "
            f"pages are computed ({per_page}) from the front")
