"""A request that prefills alone goes before the next piece of another request's chunked prefill, once per piece.

SGLang prefills a prompt longer than `--chunked-prefill-size` in pieces, one forward each, and gives what a piece
leaves of the chunk budget to the requests waiting: a short request waits for about one piece. A request that
prefills alone (`ForwardHook.prefill_alone`: a stored span a loader took, a prompt marked for blending) joins no
batch that has a request, so it waited for every piece left -- several forwards of seconds each on a CPU. Here, when
the next request in line prefills alone and its whole prompt fits one chunk, the scheduler's pass is run with the
chunked request set aside: that request's batch runs now, the piece in the next pass. The chunked request loses one
forward of that request's, as it would lose budget to requests joining its piece; once per piece, so a stream of
such requests alternates with the pieces and never stalls them.

Seam (plugin.py): `Scheduler.get_new_batch_prefill` (AROUND), registered with the first prefill-alone predicate.
Counted: `prefill_ahead_of_chunks`. Not with `--enable-mixed-chunk` (its chunk budget shrinks with the running
batch), nor with `--tiered-ahead-of-chunks off` (the hook is not registered: SGLang's order). A failure in the
decision is logged and counted (`hook_errors`); the pass runs SGLang's way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")


def piece(chunked) -> tuple[str, int]:
    """Names the next piece of a chunked request: (its rid, the tokens it has computed)."""
    return chunked.rid, int(chunked.prefix_len)


def fits_one_chunk(scheduler, req) -> bool:
    """Would SGLang prefill `req`'s whole prompt (and any output of an earlier admission) in one extend?"""
    limit = getattr(scheduler, "chunked_prefill_size", None)
    return limit is None or limit <= 0 or len(req.origin_input_ids) + len(req.output_ids) <= limit


class AheadOfChunks:
    def __init__(self, rt: Runtime, alone: Callable[[Any], bool], on: bool = True) -> None:
        self.rt, self.alone, self.on = rt, alone, on
        self.skipped: Optional[tuple[str, int]] = None  # the piece last set aside (piece())
        self._errors = 0

    def register(self) -> None:
        """Register the hook (nothing when off)."""
        if not self.on:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill", self._around,
                              HookType.AROUND)

    def would_go(self, scheduler, req) -> bool:
        """Would `req`, next in line and prefilling alone, go before the chunked request's next piece? False when
        off, no request is being chunked, its next piece was set aside once already, or `req` does not fit one
        chunk."""
        chunked = scheduler.chunked_req
        return (self.on and chunked is not None and chunked is not req and self.skipped != piece(chunked)
                and not getattr(scheduler, "is_mixed_chunk", False) and fits_one_chunk(scheduler, req))

    def _next(self, scheduler) -> Optional[Any]:
        """The request that goes ahead in this pass, or None."""
        try:
            queue = scheduler.waiting_queue
            req = queue[0] if queue else None
            return req if req is not None and self.alone(req) and self.would_go(scheduler, req) else None
        except Exception:  # noqa: BLE001 -- SGLang's own pass runs
            self._errors += 1
            self.rt.events.count("hook_errors")
            if self._errors == 1:
                logger.exception("tiered: the ahead-of-chunks check failed; SGLang schedules the pass")
            return None

    def _around(self, original, scheduler, running_batch, *args, **kwargs):
        req = self._next(scheduler)
        if req is None:
            return original(scheduler, running_batch, *args, **kwargs)
        chunked, queue = scheduler.chunked_req, scheduler.waiting_queue
        self.skipped = piece(chunked)
        scheduler.chunked_req, scheduler.waiting_queue = None, [req]
        try:
            plan = original(scheduler, running_batch, *args, **kwargs)
        finally:
            left = scheduler.waiting_queue  # (SGLang rebinds it; requests it preempted are queued there)
            scheduler.chunked_req = chunked
            before = {id(r) for r in queue}
            scheduler.waiting_queue = ([r for r in left if r is req] + queue[1:] +
                                       [r for r in left if id(r) not in before])
        if plan.batch_to_run is None:  # not admitted (no room): the piece runs in this pass after all
            return original(scheduler, plan.running_batch, *args, **kwargs)
        self.rt.events.count("prefill_ahead_of_chunks")
        return plan
