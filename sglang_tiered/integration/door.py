"""The one door for stored spans: at admission, once per request, decide who loads the part of its prompt that must
come from the SSD (or remote) tier, and record it in one request attribute. Also where retention pins are taken.

Seam (listed in plugin.py): `Scheduler._prefetch_kvcache` (AROUND), which SGLang calls for every request it queues
(and again for one re-admitted after a retraction: decided afresh).

* Retention: a request with `custom_params.tiered_retain` = N seconds pins its prompt's complete pages for
  min(N, `--tiered-max-retain`) seconds (`policy/retention.py`; counted `retain_pins`, `retain_released`,
  `retain_refused`). Placement and the SSD index honour pins (`placement.rank`, `storage/disk_index.py`).
* Loaders, in the order they were added (`add`): gated sparse loading (`sparse.py`), compute-or-load
  (`kvpr.py`). The first loader whose mode the request asks for (`wants`: the server's flag or the request's
  custom_params) decides alone: its `plan(scheduler, req, start)` for the stored span from token `start` (after the
  device + host match), or None -- then SGLang's own L3 prefetch loads it, as it does for requests no loader wants,
  for prompts marked for blending, and for requests our engine cannot compute (`engine_declines`: a LoRA adapter,
  multimodal inputs, input embeddings; counted as that loader's fallback).
* Namespaces: before anything is matched, each mechanism that keeps approximate KV under a radix namespace of its
  own (blend.py) may extend the request's `extra_key` (`namespacers`, as SGLang's own elastic-EP namespacing does).
* The decision: `req.tiered_load`, a `Load(loader, plan)` or None (SGLang's). A request with a load skips SGLang's
  L3 prefetch (its stored tokens become extend tokens, computed or loaded by the loader's forward handler) and
  prefills alone. The handler reads the plan with `planned(req, name)`; when it cannot follow it, it says why
  (`ForwardHandler.fallback`) and SGLang computes the span.
A failure inside the door is logged and counted (`hook_errors`); the request then gets SGLang's prefetch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from sglang_tiered.engine.span_miss import SpanMiss
from sglang_tiered.integration import model_forward
from sglang_tiered.integration.keys import page_keys
from sglang_tiered.integration.model_forward import ForwardHandler, engine_declines
from sglang_tiered.integration.requests import options
from sglang_tiered.policy.retention import PinRefused

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")

CENSUS_EVERY_S = 1.0  # how often the device/host residency of pinned pages is counted (at admissions)


@dataclass(frozen=True)
class Load:
    """Who loads a request's stored span: `loader` ("sparse", "kvpr") following its `plan`."""

    loader: str
    plan: Any


class Loader(Protocol):
    name: str
    handler: SpanHandler  # its forward handler: computes the span and counts the loader's fallbacks

    def admit(self, scheduler, req) -> None:
        """Every request at admission, before the decision (forget what an earlier admission left)."""
        ...

    def wants(self, req) -> bool:
        """The loader runs in this process and the request's mode (flag or custom_params) asks for it."""
        ...

    def plan(self, scheduler, req, start: int) -> Optional[Any]:
        """The load of `req`'s stored span from token `start` (page-aligned or not), or None (SGLang loads it)."""
        ...


def planned(req, loader: str) -> Optional[Any]:
    """The plan of `req`'s stored span if `loader` took it at the door, else None."""
    load = getattr(req, "tiered_load", None)
    return load.plan if load is not None and load.loader == loader else None


def has_load(req) -> bool:
    return getattr(req, "tiered_load", None) is not None


def matched(req) -> int:
    """Tokens of `req`'s prompt matched on device and host as it was queued (`init_next_round_input`, which SGLang
    runs on every request it queues where an L3 is on: `Scheduler._prefetch_kvcache`)."""
    return req.prefix_len + req.host_hit_length


class SpanHandler(ForwardHandler):
    """The forward handler of a loader: computes the extend batch of the request whose stored span the loader took
    at the door, following its plan. Shared reasons to decline (then the load is dropped, logged and counted, and
    SGLang computes the span): `model_forward.why_not_whole_prompt` (a batch of several, a chunked piece, input
    logprobs, a request our engine cannot compute), the loader's own (`check`), the engine disabled here, and a
    stored span that cannot be read (`SpanMiss`, raised by `load`). Subclasses set `name` (the loader's) and
    implement `check` and `load`."""

    def build_runtime(self, module):
        return self.rt.forward.engine(module)

    def check(self, fb, req, plan: Any) -> tuple[Optional[str], Any]:
        """(why the plan cannot be followed now, or None; the plan to follow)."""
        return None, plan

    def load(self, engine, module, req, fb, plan: Any) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        reqs = [r for r in self.rt.forward.batch_requests(fb) if planned(r, self.name) is not None]
        if not reqs:
            return None
        req = reqs[0]
        plan = planned(req, self.name)
        why = model_forward.why_not_whole_prompt(fb, req)
        if why is None:
            why, plan = self.check(fb, req, plan)
        engine = self.runtime(module) if why is None else None
        if why is None and engine is None:
            why = f"disabled in this process: {self.disabled}"
        if why is None:
            try:
                return self.load(engine, module, req, fb, plan)
            except SpanMiss as exc:
                how = getattr(plan, "mode", None)  # why the loader took the span, where its plan says
                why = f"stored span unreadable: {exc}" + (f" (taken by {how})" if how else "")
        for r in reqs:
            r.tiered_load = None
        self.fallback([r.rid for r in reqs], why + "; SGLang computes the span")
        return None


class Door:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.loaders: list[Loader] = []
        self.namespacers: list[Callable[[Any], None]] = []  # called with every request before its first match
        self.residency: dict[str, int] = {}  # pinned pages on "device" / "host" at the last census
        self._census_at = 0.0
        self._errors = 0

    def register(self) -> None:
        """Install the admission hook (once per process)."""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", self._around_prefetch,
                              HookType.AROUND)
        self.rt.forward.track_batches()
        self.rt.forward.prefill_alone(has_load)

    def add(self, loader: Loader) -> None:
        self.loaders.append(loader)

    def loader(self, name: str) -> Optional[Loader]:
        """The loader called `name` in this process, or None."""
        return next((x for x in self.loaders if x.name == name), None)

    def _around_prefetch(self, original, scheduler, req, *args, **kwargs):
        req.tiered_load = None  # decided afresh at every admission
        for namespace in self.namespacers:
            try:
                namespace(req)
            except Exception:
                self.rt.events.count("hook_errors")
                logger.exception("tiered: namespacing rid %s failed", req.rid)
        store = self.rt.store
        if store is None:
            return original(scheduler, req, *args, **kwargs)
        try:
            self._retain(scheduler, req, store)
            load = self._decide(scheduler, req)
        except Exception:
            self._errors += 1
            self.rt.events.count("hook_errors")
            if self._errors == 1:
                logger.exception("tiered: admission of rid %s failed; SGLang prefetches as usual", req.rid)
            load = None
        if load is None:
            return original(scheduler, req, *args, **kwargs)
        req.tiered_load = load
        return None  # no L3 prefetch: the stored span is the loader's

    def _decide(self, scheduler, req) -> Optional[Load]:
        for loader in self.loaders:
            loader.admit(scheduler, req)
        loader = next((x for x in self.loaders if x.wants(req)), None)
        if loader is None or options(req).chunks is not None:
            return None
        why = engine_declines(req)
        if why is not None:
            loader.handler.fallback([req.rid], why + "; SGLang loads the stored prefix")
            return None
        req.init_next_round_input(scheduler.tree_cache, cow_mamba=False)
        plan = loader.plan(scheduler, req, matched(req))
        return Load(loader.name, plan) if plan is not None else None

    # ------------------------------------------------------------------------------------------- retention
    def _retain(self, scheduler, req, store) -> None:
        retention = store.retention
        seconds = options(req).retain
        if seconds is not None and retention.max_seconds > 0 and float(seconds) > 0:  # (no room at all: refused)
            keys = page_keys(req, len(req.origin_input_ids), store.page_size)
            if keys:
                try:
                    pin, released = retention.pin(keys, float(seconds))
                except PinRefused as exc:
                    self.rt.events.count("retain_refused")
                    logger.warning("tiered retain: rid %s not pinned: %s", req.rid, exc)
                else:
                    self.rt.events.count("retain_pins")
                    self.rt.events.count("retain_released", len(released))
                    logger.info("tiered retain: rid %s pins %d pages for %.0f s (%d pins, %d released early)",
                                req.rid, len(keys), pin.until - retention.clock(), len(retention), len(released))
        now = time.monotonic()
        if len(retention) and now - self._census_at >= CENSUS_EVERY_S:
            self._census_at = now
            self.residency = census(scheduler.tree_cache, retention.pinned)
        elif not len(retention):
            self.residency = {}


def census(cache, pinned) -> dict[str, int]:
    """Pinned pages on device and on host, by a walk of SGLang's Python tree (the Rust core is not walkable: {})."""
    root = getattr(getattr(cache, "tree_core", None), "root_node", None)
    if root is None or not hasattr(root, "children"):
        return {}
    device = host = 0
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        n = sum(1 for key in node.hash_value or () if pinned(key))
        if n:
            device += n if not node.evicted else 0
            host += n if node.backuped else 0
    return {"device": device, "host": host}
