"""Whether SGLang's own forward should compute a stored span that the two-sided loader would take (`COMPUTE`), or
the two meet (`MEET`). Pure bookkeeping: no torch, no SGLang.

Where reading is several times slower than computing (the MHA model's 1024 tokens at 25 MB/s on 2 cores: load
2.3-2.5 s, SGLang's recompute 0.64-0.82 s), the two-sided load computes most of the span in chunks of
MEET_CHUNK_PAGES beside a loader that takes CPU from it, and one forward of the whole span can be faster (stop 47:
two-sided 0.74-0.78 s against that forward's 0.64 s in one hour, 0.82-1.21 s in others). Neither estimate comes
straight from the profile: its chunk fit put SGLang's forward of 1056 tokens at 0.40-0.99 s in runs where the whole
request took 0.64-0.82 s, and compute beside a loader runs 0.7-3.4x its time alone. So each is the profile's
estimate times a factor the server measures on its own forwards (`Estimates`):

* `COMPUTE`: SGLang's forward of a request prefilled alone from its token ids (a miss, or a span left to it here),
  its wall seconds over `policy/kvpr.forward_s` of the same tokens, per span size (`load_choice.bucket`: a forward's
  fixed costs weigh differently at 16 pages than at 126);
* `MEET`: a two-sided load's forward, its wall seconds over `policy/kvpr.meet_s` as planned (with compute priced
  beside the loader), per kind of load (activations or KV) and span size.

Each factor is the median of its last RECENT samples, not a moving average, so that one slow forward does not
linger: measured on the MHA model at 10 MB/s, the first sample (the prompt's first prefill, soon after the server
started) put SGLang's forward at 1.71 s, and a moving average then estimated it at 1.53, 1.42, 1.30, 1.14 s over the
next loads while it took about 1.0 s -- the span met every time, 1.09 s against 1.04 s. On a shared VM one forward in
several is slowed by other work too.

`choose`: until both factors are measured, `MEET` (as before this choice existed). Then the lower estimate, and where
that is `COMPUTE`, after every `period(gap)` such decisions one `MEET` anyway: a span left to SGLang's forward reads
nothing, so the read rate and the meet's factor are renewed only by such a retry (a disk that got faster).

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

MEET, COMPUTE = "meet", "compute"
RECENT = 5  # samples a factor is the median of


@dataclass(frozen=True)
class Choice:
    how: str  # MEET or COMPUTE
    exploring: bool  # MEET taken to time it again, though COMPUTE is estimated faster
    meet_s: Optional[float] = None  # the calibrated estimates (None: a factor not measured yet)
    compute_s: Optional[float] = None


class Estimates:
    """The per-process factors (measured over the profile's estimate) of both ways (thread-safe)."""

    def __init__(self) -> None:
        self._samples: dict[tuple, deque] = {}  # (COMPUTE, bucket) or (MEET, activations, bucket): recent factors
        self._decisions: dict[tuple[bool, int], int] = {}  # COMPUTE decisions since the last MEET retry
        self._lock = threading.Lock()

    @staticmethod
    def key(how: str, pages: int, activations: bool = False) -> tuple:
        return (COMPUTE, bucket(pages)) if how == COMPUTE else (MEET, activations, bucket(pages))

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

    def choose(self, pages: int, activations: bool, meet_s: float, compute_s: float) -> Choice:
        """MEET or COMPUTE for a span of `pages` pages that the loader would read (as activations or KV) beside
        compute, from the profile's estimates of both ways (`meet_s`, `compute_s`, seconds) times their factors."""
        with self._lock:
            fm, fc = self._median(self.key(MEET, pages, activations)), self._median(self.key(COMPUTE, pages))
            if fm is None or fc is None:
                return Choice(MEET, False, fm and meet_s * fm, fc and compute_s * fc)
            m, c = meet_s * fm, compute_s * fc
            if m <= c:
                return Choice(MEET, False, m, c)
            k = (activations, bucket(pages))
            self._decisions[k] = n = self._decisions.get(k, 0) + 1
            if n >= period(m / c):
                self._decisions[k] = 0
                return Choice(MEET, True, m, c)
            return Choice(COMPUTE, False, m, c)
