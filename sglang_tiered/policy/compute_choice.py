"""Which of three ways fills a stored span that the two-sided loader would take with compute joining: the two meet
(`MEET`), our loader reads it alone (`ALONE`), or SGLang's own forward computes it (`COMPUTE`). Pure bookkeeping: no
torch, no SGLang.

Where reading is several times slower than computing (the MHA model's 1024 tokens at 25 MB/s on 2 cores: load
2.3-2.5 s, SGLang's recompute 0.64-0.82 s), the two-sided load computes most of the span in chunks of
MEET_CHUNK_PAGES beside a loader that takes CPU from it, and one forward of the whole span can be faster (stop 47:
two-sided 0.74-0.78 s against that forward's 0.64 s in one hour, 0.82-1.21 s in others). Where reading is only a
little slower than the join rule's threshold (the same span at 200 MB/s), compute's chunks run 1.75-2.2x their profile
beside the loader and the loader alone on two threads is faster (stop 48: 0.35-0.51 s against 0.46-0.62 s). None of
the three estimates comes straight from the profile: its chunk fit put SGLang's forward of 1056 tokens at 0.40-0.99 s
in runs where the whole request took 0.64-0.82 s, and compute beside a loader runs 0.7-3.4x its time alone. So each
is the profile's estimate times a factor the server measures on its own forwards (`Estimates`):

* `COMPUTE`: SGLang's forward of a request prefilled alone from its token ids (a miss, or a span left to it here),
  its wall seconds over `policy/kvpr.forward_s` of the same tokens, per span size (`load_choice.bucket`: a forward's
  fixed costs weigh differently at 16 pages than at 126);
* `MEET`: a two-sided load's forward, its wall seconds over `policy/kvpr.meet_s` as planned (with compute priced
  beside the loader), per kind of load (activations or KV) and span size;
* `ALONE`: a load of the whole span by the loader on MEET_LOADERS threads, compute taking no page, over
  pages x `policy/kvpr.alone_page_s` plus the new tokens' `forward_s`, per kind of load and span size.

Each factor is the median of its last RECENT samples, not a moving average, so that one slow forward does not
linger: measured on the MHA model at 10 MB/s, the first sample (the prompt's first prefill, soon after the server
started) put SGLang's forward at 1.71 s, and a moving average then estimated it at 1.53, 1.42, 1.30, 1.14 s over the
next loads while it took about 1.0 s -- the span met every time, 1.09 s against 1.04 s. On a shared VM one forward in
several is slowed by other work too.

`choose`: until the meet's factor is measured, `MEET` (as before this choice existed). The loader alone, timed only
when taken, is tried once where the profile's estimate of it, unscaled, is below the best measured way's; SGLang's
forward, timed on every miss, is not tried before it is measured. Then the lowest measured estimate; our loader's
ways (`MEET`, `ALONE`) are timed only when taken, so where one of them is measured but not the lowest, after every
`period(gap)` decisions it is taken anyway (a disk that got faster, compute that got less busy).

Both ways are exact (every token's KV computed from the true prefix or its stored copy): a wrong choice costs time,
never an answer.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Optional

from sglang_tiered.policy.load_choice import bucket, period

MEET, ALONE, COMPUTE = "meet", "alone", "compute"
LOADS = (MEET, ALONE)  # our loader's ways: timed only when taken
RECENT = 5  # samples a factor is the median of


@dataclass(frozen=True)
class Choice:
    how: str  # MEET, ALONE or COMPUTE
    exploring: bool  # taken to time it (again), though another way is estimated faster
    meet_s: Optional[float] = None  # the calibrated estimates (None: a factor not measured yet, or not a way here)
    alone_s: Optional[float] = None
    compute_s: Optional[float] = None

    def describe(self) -> str:
        """The way and the measured ways' estimates, for the load's log line: "the loader alone, first try (two-sided
        0.480s, SGLang's forward 1.012s estimated)"."""
        named = ((MEET, "two-sided", self.meet_s), (ALONE, "the loader alone", self.alone_s),
                 (COMPUTE, "SGLang's forward", self.compute_s))
        name, own = next((name, s) for how, name, s in named if how == self.how)
        if self.exploring:
            name += ", first try" if own is None else ", timed again"
        estimates = ", ".join(f"{name} {s:.3f}s" for _, name, s in named if s is not None)
        return f"{name} ({estimates} estimated)" if estimates else name


class Estimates:
    """The per-process factors (measured over the profile's estimate) of the three ways (thread-safe)."""

    def __init__(self) -> None:
        self._samples: dict[tuple, deque] = {}  # (COMPUTE, bucket) or (MEET | ALONE, activations, bucket): factors
        self._decisions: dict[tuple, int] = {}  # (way, activations, bucket): decisions since that way last ran
        self._lock = threading.Lock()

    @staticmethod
    def key(how: str, pages: int, activations: bool = False) -> tuple:
        return (COMPUTE, bucket(pages)) if how == COMPUTE else (how, activations, bucket(pages))

    def observe(self, key: tuple, seconds: float, estimate_s: float) -> float:
        """Add one forward of `seconds` whose profile estimate was `estimate_s` to `key`'s samples; returns the
        factor after it."""
        if seconds <= 0 or estimate_s <= 0:
            raise ValueError(f"not a sample: {seconds} s against an estimate of {estimate_s} s")
        with self._lock:
            self._samples.setdefault(key, deque(maxlen=RECENT)).append(seconds / estimate_s)
            return self._median(key)

    def factor(self, key: tuple) -> Optional[float]:
        with self._lock:
            return self._median(key)

    def _median(self, key: tuple) -> Optional[float]:
        samples = self._samples.get(key)
        return statistics.median(samples) if samples else None

    def choose(self, pages: int, activations: bool, meet_s: float, compute_s: float,
               alone_s: Optional[float] = None) -> Choice:
        """The way for a span of `pages` pages that the loader would read (as activations or KV) with compute
        joining, from the profile's estimates of each way (seconds; `alone_s` None: the loader alone is not one)
        times their factors."""
        profile = {MEET: meet_s, ALONE: alone_s, COMPUTE: compute_s}
        with self._lock:
            est: dict[str, Optional[float]] = {}
            for how, s in profile.items():
                f = None if s is None else self._median(self.key(how, pages, activations))
                est[how] = None if f is None else s * f
            how, exploring = self._pick(est, alone_s, activations, bucket(pages))
            if how in LOADS:  # (only our loader's ways are retried: their counters)
                self._decisions[(how, activations, bucket(pages))] = 0
            return Choice(how, exploring, est[MEET], est[ALONE], est[COMPUTE])

    def _pick(self, est: dict[str, Optional[float]], alone_s: Optional[float], activations: bool,
              size: int) -> tuple[str, bool]:
        """(way, exploring) from the calibrated estimates `est` (under the lock)."""
        if est[MEET] is None:
            return MEET, False
        measured = {how: s for how, s in est.items() if s is not None}
        best = min(measured, key=measured.get)  # (a tie: the first, MEET)
        if alone_s is not None and est[ALONE] is None and alone_s < measured[best]:
            return ALONE, True
        due = []  # our loader's measured ways behind the best, due to be timed again (the faster first)
        for how in sorted((h for h in LOADS if h in measured and h != best), key=measured.get):
            k = (how, activations, size)
            self._decisions[k] = n = self._decisions.get(k, 0) + 1
            if n >= period(measured[how] / measured[best]):
                due.append(how)
        return (due[0], True) if due else (best, False)
