"""The samples of the measured choice between our loader and SGLang's own load of a stored span
(policy/load_choice.py): which requests count, and when their time starts and ends.

* Start: admission (`Door`, via `KVPR.admit`), for a request admitted while the scheduler is fully idle (nothing
  running or waiting: its time is its own) or only decoding (other requests' decode batches running, nothing
  waiting, no prefill in flight: its time is what a request costs among decodes); `req.tiered_admitted_at`, and
  the condition, `req.tiered_condition` (`admission_condition`). Samples of the two conditions are kept apart.
* End: the end of its prefill forward (`ForwardHook.after_extend`), if that forward computed its whole prompt and
  nothing else. One sample per request, at its first extend forward.
* Our loader waits for nothing before its forward (no prefetch: the read is in the forward), so a request of ours
  admitted while others ran (given our loader behind other prefills, kvpr.py) is a sample too: its forward's own
  seconds (`ForwardHook.last_extend_s`). That is how a `rule` server learns what our loader costs on spans it
  otherwise leaves to SGLang, and stops taking them behind prefills shorter than that cost.
* Which load: ours, where our loader took the span and computed none of it, reading its pages as `auto` would
  (`req.tiered_pure_load`, set by the handler: a forced load that reads activations where `auto` reads KV -- the MHA
  model at the disk's own speed, where recomputing from activations is the slower way -- is another load, and its
  samples had made `auto` keep SGLang's load without ever timing ours as it would run); SGLang's, where SGLang's own
  forward ran it and SGLang reports tokens it took from storage (`req.cached_tokens_storage`), or where the choice
  gave it the span (`left_to_sglang`): then the sample is over the whole span, whatever SGLang's load brought in -- a
  prefetch that gives up and leaves the span to be computed is that load's cost (measured: the MHA model at 100 MB/s,
  4096 tokens, SGLang's prefetch brought nothing in and the request took 12-13 s; counted as no sample, it left
  SGLang's load unmeasured, so the choice kept trying it). Such a sample, where SGLang's load brought in less than
  half of the span, is conclusive (`LoadChoice.observe`): the choice does not give SGLang's load a second span of that
  size to measure, which would cost the same again (12-13 s there, for each of the first two).
  Anything else (a two-sided load, blending, a fallback) is no sample.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from sglang_tiered.integration.door import planned
from sglang_tiered.policy.load_choice import DECODING, IDLE, OURS, SGLANG, LoadChoice, Rates, bucket

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")


class LoadTiming:
    """Collects the samples of `choice` for the loader named `loader` ("kvpr") on pages of `page_size` tokens."""

    def __init__(self, rt: Runtime, choice: LoadChoice, loader: str) -> None:
        self.rt, self.choice, self.loader = rt, choice, loader
        self.page_size = 0  # set when the store is open
        self._ahead: dict[tuple[str, int], str] = {}  # per condition and bucket, the load ahead (for the log)

    def admitted(self, scheduler, req) -> None:
        """At admission: start the clock of a request admitted while the scheduler is idle or only decoding."""
        req.tiered_condition = admission_condition(scheduler)
        req.tiered_admitted_at = time.perf_counter() if req.tiered_condition is not None else None
        req.tiered_pure_load = False
        req.tiered_given_sglang = 0

    @staticmethod
    def left_to_sglang(req, tokens: int) -> None:
        """The choice gave SGLang's load `req`'s stored span of `tokens` tokens: its sample is over all of them."""
        req.tiered_given_sglang = tokens

    @staticmethod
    def condition(req) -> Optional[str]:
        """At admission: IDLE or DECODING, `req`'s load will be a sample under that condition; None: it will not."""
        return getattr(req, "tiered_condition", None)

    def ended(self, fb, by: Optional[str]) -> None:
        """After an extend forward (`ForwardHook.after_extend`): fold in the sample of its request, if it is one."""
        reqs = self.rt.forward.batch_requests(fb)
        admitted = [getattr(r, "tiered_admitted_at", None) for r in reqs]
        for r in reqs:
            r.tiered_admitted_at = None  # one sample per request, at its first extend forward
        req = self.rt.forward.whole_alone(fb)  # (not a chunked piece: the whole prefill)
        if req is None or not self.page_size:
            return
        t0 = admitted[0]
        load, tokens, conclusive = self._which(req, by)
        if load is None or tokens < self.page_size:
            return
        if t0 is not None:
            self._fold(load, tokens, time.perf_counter() - t0, req.tiered_condition, conclusive)
        elif load == OURS:  # admitted behind other prefills: its forward is its own time, as at idle
            self._fold(load, tokens, self.rt.forward.last_extend_s, IDLE)

    def _which(self, req, by: Optional[str]) -> tuple[Optional[str], int, bool]:
        """(the load that brought `req`'s span in, or None where it is no sample; the span's stored tokens; whether
        the sample is conclusive: SGLang's load brought in less than half of the span the choice gave it, so its
        request computed the rest -- not one page short, which a load that did not give up may be)."""
        plan = planned(req, self.loader)
        if by == self.loader and plan is not None and req.tiered_pure_load:
            return OURS, len(plan.keys) * self.page_size, False
        if by is None and plan is None:
            brought, given = int(getattr(req, "cached_tokens_storage", 0) or 0), getattr(req, "tiered_given_sglang", 0)
            return SGLANG, max(brought, given), 2 * brought < given
        return None, 0, False

    def _fold(self, load: str, tokens: int, seconds: float, when: str, conclusive: bool = False) -> None:
        rates = self.choice.observe(load, tokens, self.page_size, seconds, when, conclusive)
        self.rt.events.count("kvpr_choice_samples")
        if when == DECODING:
            self.rt.events.count("kvpr_choice_samples_decoding")
        if not rates.measured():
            return
        b, ahead = bucket(tokens // self.page_size), rates.ahead()
        if self._ahead.get((when, b)) != ahead:
            self._ahead[(when, b)] = ahead
            logger.info("tiered kvpr: stored spans of %s%s: %s, %s", _pages(b),
                        " among decodes" if when == DECODING else "", _describe(rates, when),
                        "our loader takes them" if ahead == OURS else "SGLang's own load takes them")


def _pages(b: int) -> str:
    return f"{1 << b}-{(2 << b) - 1} pages" if b else "1 page"


def admission_condition(scheduler) -> Optional[str]:
    """What the scheduler is doing as a request is admitted, for the measured choice: IDLE (nothing running or
    waiting), DECODING (a decode batch running; nothing waiting, no chunked prefill, the last batch not a prefill:
    behind a prefill `behind_prefills` decides), or None (a load admitted now is no sample)."""
    if scheduler.is_fully_idle():
        return IDLE
    last = scheduler.last_batch
    if scheduler.running_batch.is_empty() or scheduler.waiting_queue or scheduler.chunked_req is not None or \
            (last is not None and last.forward_mode.is_extend()):
        return None
    return DECODING


def _describe(r: Rates, when: str) -> str:
    return (f"our loader {r.per_token_s[OURS] * 1e3:.3f} s vs SGLang's load {r.per_token_s[SGLANG] * 1e3:.3f} s per "
            f"1k stored tokens ({r.samples[OURS]} and {r.samples[SGLANG]} loads timed "
            f"{'among decodes' if when == DECODING else 'at idle'})")
