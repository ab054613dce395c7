"""Which of two exact loads of a stored span is faster on this server, measured rather than assumed: our loader
reading the span (`OURS`) or SGLang's own L3 load (`SGLANG`). Pure bookkeeping: no torch, no SGLang.

Where compute cannot gain much (a page reads in a small share of a page's compute: policy/kvpr.py), what is left is
which load brings the span in sooner -- and that differs by machine and model: our loader beat SGLang's load on
SmolLM2 at the disk's own speed on both machines measured (0.76-0.93x), and lost on the MHA model reading KV (1.24x
and 1.36x). So each server measures both on its own loads:

* a sample is one request admitted while the scheduler was idle -- or only decoding (`DECODING`: other requests'
  decode batches running, no prefill waiting or in flight) -- and prefilled whole and alone, with the seconds from
  its admission to the end of its prefill forward (what its user waits for) over the stored tokens that one of the
  two loads brought in;
* samples are kept per condition (`IDLE`, `DECODING`: measured on SmolLM2 with a second client decoding, SGLang's
  load took 0.18-0.30 s longer than our loader where at idle the gap was 0.04-0.1 s, so idle samples would pick the
  wrong one) and per span size -- `bucket(pages)`, powers of two of pages, since a load's fixed costs weigh
  differently at 16 pages than at 126 -- as a moving average of seconds per stored token per load;
* `choose`: within the request's condition, a load with fewer than MIN_SAMPLES samples in the bucket is tried
  first (SGLang's before ours), but only for a request whose sample will count (measurable); then the load with
  the lower average, and after every `period(gap)` measurable decisions the other one, so that a change in either
  (a disk slowing down, a busy CPU) is seen. The period grows with the square of the gap between the two: a retry
  of a load 2-3x slower (our loader reading an MHA model's KV at the disk's own speed: 2.2-3.3x SGLang's load)
  costs at most 1/64 of the ahead load's time on average, where a fixed 1/16 cost 7-14 %. An unmeasurable request
  (condition None) is decided by the idle samples; until both loads are measured in its bucket it gets SGLang's
  load, as before this choice existed.
* except where SGLang's load is predicted to give up (`prefetch_gives_up`: its prefetch deadline is shorter than the
  span's read at the measured read rate; then the span is computed, 3-7x our loader's time on the MHA model at 100
  MB/s): while it has no sample in the bucket, it is not tried and our loader takes the span. A read rate that rises
  past the deadline's lets it be tried as above.

Behind other prefills the idle-time averages miss SGLang's load's real cost (`behind_prefills`): its scheduler skips a
request whose L3 prefetch is still running ("skip staging requests that are ongoing prefetch", `Scheduler.
get_new_batch_prefill`), and the admission's own scheduling pass comes before any prefetch can end -- so where other
prefills keep arriving, SGLang's load waits for at least one more of their forwards (measured on SmolLM2 at 100 MB/s
with a second client's 2048-token prefills back to back: 6.0 s for SGLang's load, 3.2 s for our loader, which reads
within the request's own forward).

Both loads are exact: a wrong choice costs time, never an answer.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Optional

OURS, SGLANG = "ours", "sglang"
IDLE, DECODING = "idle", "decoding"  # what the server did when a sampled request was admitted
MIN_SAMPLES = 2  # samples of each load in a bucket before the averages decide
EXPLORE_EVERY = 16  # measurable decisions in a bucket between retries of the load behind, at a near tie
EXPLORE_MAX = 1024  # ... and at most, whatever the gap
WEIGHT = 0.3  # of a new sample in the moving average


def period(gap: float) -> int:
    """Measurable decisions between two retries of the load behind when it is `gap` (>= 1) times slower:
    EXPLORE_EVERY x gap^2, at most EXPLORE_MAX. A retry's average cost, (gap - 1) / period, is then at most
    1 / (4 x EXPLORE_EVERY) (its peak, at gap 2) for gaps up to 17."""
    return min(EXPLORE_MAX, max(EXPLORE_EVERY, math.ceil(EXPLORE_EVERY * gap * gap)))


def behind_prefills(prefill_s: float, slower_s: Optional[float]) -> bool:
    """Should our loader take a span compute would not join, for a request admitted right after another request's
    prefill forward that took `prefill_s` seconds? SGLang's load would wait about one more such forward; our loader
    costs `slower_s` seconds more than SGLang's load on this span where both are measured at idle (negative: it is
    faster; None: not measured -- taken as equal, both read the same pages)."""
    return prefill_s > max(0.0, slower_s or 0.0)


def prefetch_gives_up(nbytes: int, bps: float, deadline_s: float) -> bool:
    """Would SGLang's L3 prefetch of a span of `nbytes` give up? Under its `timeout` policy (SGLang 0.5.23's default)
    it waits `deadline_s` (prefetch_timeout_base + pages x prefetch_timeout_per_page), then the span is computed:
    so where reading the span at `bps` takes longer than that."""
    return nbytes / bps > deadline_s


def bucket(pages: int) -> int:
    """The size class of a span of `pages` pages: floor(log2(pages)) (1 -> 0, 16-31 -> 4, 64-127 -> 6)."""
    return max(pages, 1).bit_length() - 1


@dataclass
class Rates:
    """One bucket: the moving average of seconds per stored token and the sample count of each load, and the
    measurable decisions made since the last retry of the load behind (or since both were measured)."""

    per_token_s: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=lambda: {OURS: 0, SGLANG: 0})
    decisions: int = 0

    def measured(self) -> bool:
        return all(n >= MIN_SAMPLES for n in self.samples.values())

    def ahead(self) -> str:
        """The load with the lower average (SGLang's on a tie); call only when `measured`."""
        return OURS if self.per_token_s[OURS] < self.per_token_s[SGLANG] else SGLANG

    def gap(self) -> float:
        """How many times slower the load behind is (>= 1); call only when `measured`."""
        fast, slow = sorted(self.per_token_s.values())
        return slow / fast


@dataclass(frozen=True)
class Choice:
    load: str  # OURS or SGLANG
    exploring: bool  # taken to measure it (too few samples, or its periodic retry), not because it is ahead
    predicted: bool = False  # ours because SGLang's load, unsampled here, is predicted to give up


class LoadChoice:
    """The per-process record of both loads' measured speeds (thread-safe)."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, int], Rates] = {}  # per (condition, bucket)
        self._lock = threading.Lock()

    def choose(self, pages: int, condition: Optional[str], sglang_gives_up: bool = False) -> Choice:
        """The load for a stored span of `pages` pages; `condition`: IDLE or DECODING where this request's load will
        be a sample under it, None where it will not (then the idle samples decide, and nothing is explored).
        `sglang_gives_up`: SGLang's load is predicted to give up on this span (`prefetch_gives_up`); while it has no
        sample in the bucket it is not tried, and our loader is (explored until measured, then taken)."""
        measurable = condition is not None
        with self._lock:
            r = self._rates.setdefault((condition or IDLE, bucket(pages)), Rates())
            if sglang_gives_up and r.samples[SGLANG] == 0:
                return Choice(OURS, measurable and r.samples[OURS] < MIN_SAMPLES, predicted=True)
            if not r.measured():
                if not measurable:
                    return Choice(SGLANG, False)
                return Choice(SGLANG if r.samples[SGLANG] < MIN_SAMPLES else OURS, True)
            best = r.ahead()
            if not measurable:
                return Choice(best, False)
            r.decisions += 1
            if r.decisions >= period(r.gap()):
                r.decisions = 0
                return Choice(OURS if best == SGLANG else SGLANG, True)
            return Choice(best, False)

    def slower_s(self, tokens: int, page_size: int) -> Optional[float]:
        """Seconds our loader was measured to take beyond SGLang's load for `tokens` stored tokens (whole pages of
        `page_size`; negative where it is faster), from the per-token averages of the span's bucket at idle, or
        among decodes where the idle ones are not both measured (a server that is never idle); None until both
        loads are measured under one of the two."""
        with self._lock:
            for when in (IDLE, DECODING):
                r = self._rates.get((when, bucket(tokens // page_size)))
                if r is not None and r.measured():
                    return tokens * (r.per_token_s[OURS] - r.per_token_s[SGLANG])
            return None

    def observe(self, load: str, tokens: int, page_size: int, seconds: float, condition: str = IDLE,
                conclusive: bool = False) -> Rates:
        """Fold one sample in: `load` brought `tokens` stored tokens (whole pages of `page_size`) in a request
        admitted under `condition` that took `seconds` from admission to the end of its prefill. `conclusive`: this
        one sample measures the load (SGLang's load gave up on part of the span, which was then computed: a second
        try costs the same), so it counts as MIN_SAMPLES where fewer were taken. Returns the bucket's rates after
        it (a copy)."""
        if load not in (OURS, SGLANG) or condition not in (IDLE, DECODING) or tokens < page_size or seconds <= 0:
            raise ValueError(f"not a sample: {load!r} {condition!r}, {tokens} tokens, {seconds} s")
        with self._lock:
            r = self._rates.setdefault((condition, bucket(tokens // page_size)), Rates())
            rate = seconds / tokens
            old = r.per_token_s.get(load)
            r.per_token_s[load] = rate if old is None else WEIGHT * rate + (1 - WEIGHT) * old
            r.samples[load] = max(r.samples[load] + 1, MIN_SAMPLES if conclusive else 0)
            return Rates(dict(r.per_token_s), dict(r.samples), r.decisions)
