"""Gated sparse loading in the server (IMPRESS, `--tiered-importance-load gated`, approximate, CPU servers).

A request whose prefix beyond device and host memory is on SSD, in one repacked group (storage/repacker.py), is
served by `engine.sparse.sparse_prefill` instead of SGLang's load of every page:

* Admission -- a loader at the door (`door.py`): a gated request (the server's mode, or
  `custom_params.tiered_importance` = "gated" / "full"; "off" opts out) whose stored run after its device + host
  match holds at least `--tiered-importance-min-tokens` tokens gets a plan (its group and pages): SGLang's L3
  prefetch is skipped, those tokens become extend tokens. The request is kept out of the radix tree
  (`skip_radix_cache_insert`: its KV is approximate) and prefills alone.
* Forward -- `SparseHandler` on the Llama forward hook: the device/host prefix is read from the pool (exact),
  the stored span S is loaded sparsely from the group (the gate decides per layer: `--tiered-importance-gate`, or
  the request's `custom_params.tiered_importance_gate`; each gate keeps its own probe-skipping history), the rest C
  is computed. C's KV and, per layer, the loaded tokens of S go into the request's slots; the others are holes.
  Anything unexpected (a batch of several requests, a piece of a chunked prefill, the group gone or corrupt, a
  request our engine cannot compute) leaves the batch to SGLang's forward, which then computes S exactly (correct,
  slower; logged and counted).
* Decode -- the positions stay the prompt's (the row is full length, holes included, so SGLang's position = slot
  count is right and the stored keys already carry their RoPE). `holes(rid)` tells the prefix-aware CPU attention
  (cpu_attention.py) which prefix positions to skip on each layer, in decode and in any later extend.

Counters: `sglang_tiered:sparse_requests_total`, `..._sparse_gate_passes_total`, `..._sparse_gate_fails_total`
(layers), `..._sparse_attention_dropped_total` (the attention share the picks left out, summed over passed layers),
`..._sparse_probes_skipped_total` (layers loaded whole without a probe: their gate kept failing,
`--tiered-importance-probe-skip`), `..._sparse_tokens_skipped_total` (token-layers of S not loaded),
`..._sparse_bytes_skipped_total` (their K and V), `..._sparse_bytes_read_total` (probe + chunks),
`..._sparse_bytes_needed_total` (K and V of the tokens used: read amplification = read / needed),
`..._sparse_fallbacks_total`, `..._sparse_too_long_total`; one log line per sparse request.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang_tiered.engine.group_span import GroupSpan
from sglang_tiered.engine.sparse import sparse_prefill
from sglang_tiered.integration import faults, model_forward
from sglang_tiered.integration.door import SpanHandler
from sglang_tiered.integration.keys import page_keys
from sglang_tiered.integration.requests import options
from sglang_tiered.policy.importance import GateHistory
from sglang_tiered.storage.group_file import GroupMeta

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")

_MAX_HOLES = 4096  # requests whose holes are remembered (oldest forgotten first)


@dataclass(frozen=True)
class Holes:
    """Prefix positions [start, end) were stored; on layer l only `kept[l]` (absolute positions) were loaded."""

    start: int
    end: int
    kept: tuple[torch.Tensor, ...]

    def positions(self, layer: int, seq_len: int) -> torch.Tensor:
        """The positions a query at the end of a `seq_len`-token sequence may attend on `layer`."""
        return torch.cat([torch.arange(self.start), self.kept[layer], torch.arange(self.end, seq_len)])


@dataclass(frozen=True)
class Plan:
    """A sparse load decided at admission: `pages` pages of `group` from member `first`."""

    group: GroupMeta
    first: int
    pages: int


class Sparse:
    """This process's gated sparse loading: the door's loader, the holes of requests loaded sparsely, and each
    gate's probe-skipping history (a layer one gate fails may pass the other)."""

    name = "sparse"

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.handler = SparseHandler(rt, self)
        self._holes: OrderedDict[str, Holes] = OrderedDict()
        self.histories: dict[tuple[str, float], GateHistory] = {}  # per (gate, ratio): their pass rates differ

    def offer_prompts(self, fb) -> None:
        """After SGLang's own forward of extend batch `fb`: the complete pages of each prompt whose prefill ended
        in it are offered to the store's repacker (never blocks; a full queue drops the offer)."""
        faults.check("repack_offer")
        store = self.rt.store
        if store is None or store.repacker is None:
            return
        for x in self.rt.forward.extends(fb):
            if x.req is None or x.length == 0 or x.prefix + x.length < len(x.req.origin_input_ids):
                continue
            keys = page_keys(x.req, len(x.req.origin_input_ids), store.page_size)
            if keys:
                store.repacker.offer(keys)
                self.rt.events.count("repack_offers")

    # ------------------------------------------------------------------------------------- loader (door.py)
    def admit(self, scheduler, req) -> None:
        self._holes.pop(req.rid, None)

    def wants(self, req) -> bool:
        store = self.rt.store
        return store is not None and store.repacker is not None and self.mode(req) != "off"

    def plan(self, scheduler, req, start: int) -> Optional[Plan]:
        plan = self.stored_run(req, start)
        if plan is None:
            return None
        limit = model_forward.too_long_for_one_extend(scheduler, req, start)
        if limit is not None:
            self.rt.events.count("sparse_too_long")
            logger.info("tiered sparse: rid %s not loaded sparsely: %d tokens to prefill exceed "
                        "--chunked-prefill-size %d; SGLang loads the stored prefix", req.rid,
                        len(req.origin_input_ids) - start, limit)
            return None
        req.skip_radix_cache_insert = True  # approximate KV never enters the tree
        return plan

    def mode(self, req) -> str:
        mode = options(req).sparse
        if mode is not None:
            return mode
        return "gated" if self.rt.settings.config.importance_load == "gated" else "off"

    def gate(self, req) -> str:
        """The request's gate: custom_params.tiered_importance_gate, else `--tiered-importance-gate`."""
        gate = options(req).gate
        return gate if gate is not None else self.rt.settings.config.importance_gate

    def ratio(self, req) -> float:
        """The request's ratio: custom_params.tiered_importance_ratio (checked at the door), else
        `--tiered-importance-ratio`."""
        ratio = options(req).ratio
        return float(ratio) if ratio is not None else self.rt.settings.config.importance_ratio

    def history(self, gate: str, ratio: float) -> GateHistory:
        """The probe-skipping history of loads with this gate and ratio."""
        key = (gate, ratio)
        if key not in self.histories:
            self.histories[key] = GateHistory(self.rt.settings.config.importance_probe_skip)
        return self.histories[key]

    def stored_run(self, req, start: int) -> Optional[Plan]:
        """The pages of `req`'s prompt from token `start` (page-aligned) on that lie, in order, in one repacked
        group -- leaving at least the prompt's last token to compute; None if they hold fewer than
        `--tiered-importance-min-tokens`."""
        tier = self.rt.store.tier
        ps = tier.namespace.page_size
        if start % ps:
            return None
        keys = page_keys(req, len(req.origin_input_ids) - 1, ps)[start // ps :]
        meta = tier.group_of(keys[0]) if keys else None
        if meta is None:
            return None
        first = meta.keys.index(keys[0])
        n = 0
        while n < len(keys) and first + n < len(meta.keys) and meta.keys[first + n] == keys[n]:
            n += 1
        return Plan(meta, first, n) if n * ps >= self.rt.settings.config.importance_min_tokens else None

    # ------------------------------------------------------------------------------------- holes (decode)
    def holes(self, rid: str) -> Optional[Holes]:
        return self._holes.get(rid)

    def remember(self, rid: str, holes: Holes) -> None:
        self._holes[rid] = holes
        while len(self._holes) > _MAX_HOLES:
            self._holes.popitem(last=False)


class SparseHandler(SpanHandler):
    name = "sparse"

    def __init__(self, rt: Runtime, sparse: Sparse) -> None:
        super().__init__(rt)
        self.sparse = sparse

    def check(self, fb, req, plan: Plan) -> tuple[Optional[str], Optional[Plan]]:
        run = self.sparse.stored_run(req, int(fb.extend_prefix_lens_cpu[0]))  # as it is now
        if run is None:
            return "the stored span is gone", None
        return None, run

    def load(self, engine, module, req, fb, plan: Plan) -> torch.Tensor:
        return self._sparse_forward(engine, req, fb, plan)

    @torch.inference_mode()
    def _sparse_forward(self, engine, req: Any, fb, run: Plan) -> torch.Tensor:
        t0 = time.perf_counter()
        cfg = self.rt.settings.config
        events, tier = self.rt.events, self.rt.store.tier
        prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
        span = GroupSpan(tier, run.group, run.first, run.pages)
        s = span.tokens
        ids = torch.tensor(req.origin_input_ids[prefix + s : prefix + ext], dtype=torch.int64)
        mode, gate, ratio = self.sparse.mode(req), self.sparse.gate(req), self.sparse.ratio(req)
        history = self.sparse.history(gate, ratio)
        skip = history.skip() if mode != "full" else frozenset()
        res = sparse_prefill(engine, ids, prefix_len=prefix, span=span,
                             prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None,
                             heads=cfg.importance_heads, window=cfg.importance_window, ratio=ratio,
                             alpha=cfg.importance_alpha, gate=gate, max_drop=cfg.importance_max_drop,
                             force="fail" if mode == "full" else None, skip=skip)
        if mode != "full":
            history.record({g.layer: g.passed for g in res.gates if g.layer not in skip})
        new_kv = engine.empty_kv(ext).zero_()
        new_kv[:, s:] = res.kv
        for layer, (idx, kv) in enumerate(zip(res.kept, res.kept_kv)):
            new_kv[layer, idx] = kv
        hidden = model_forward.write_extend(fb, engine, new_kv, res.hidden)
        if res.loaded_fraction < 1.0:
            self.sparse.remember(req.rid, Holes(prefix, prefix + s, tuple(prefix + idx for idx in res.kept)))
        passes = sum(g.passed for g in res.gates)
        skipped = sum(s - g.loaded for g in res.gates)
        token_layer_bytes = engine.cfg.geometry(engine.dtype.itemsize).token_layer_bytes
        needed = sum(g.loaded for g in res.gates) * token_layer_bytes
        events.count("sparse_requests")
        events.count("sparse_gate_passes", passes)
        events.count("sparse_gate_fails", len(res.gates) - passes)
        events.count("sparse_attention_dropped", sum(g.drop for g in res.gates if g.passed))
        events.count("sparse_probes_skipped", len(skip))
        events.count("sparse_tokens_skipped", skipped)
        events.count("sparse_bytes_skipped", skipped * token_layer_bytes)
        events.count("sparse_bytes_read", span.bytes_read)
        events.count("sparse_bytes_needed", needed)
        tier.stats.add(sparse_bytes_read=span.bytes_read, sparse_bytes_needed=needed)
        logger.info(LOG_LINE, req.rid, prefix, s, ext - s, mode, gate, passes, len(res.gates), len(skip), ratio,
                    res.loaded_fraction, span.bytes_read / 2**20, span.bytes_read / max(1, needed),
                    time.perf_counter() - t0)
        return hidden


LOG_LINE = ("tiered sparse: rid %s sparse load: prefix=%d stored=%d computed=%d mode=%s %s gate passed %d/%d "
            "layers (%d unprobed), ratio %.2f, loaded %.3f of the stored token-layers, %.1f MiB read (read "
            "amplification %.2f), total=%.3fs")
# what `LOG_LINE` says, for readers of the server log (benchmarks): rid, stored tokens, MiB read, read amplification
LOG_PATTERN = re.compile(r"rid (\S+) sparse load: prefix=\d+ stored=(\d+) .* ([0-9.]+) MiB read \(read amplification "
                         r"([0-9.]+)")


def register_hooks(rt: Runtime) -> bool:
    """In scheduler processes of a server with `--tiered-importance-load gated` (per request too, on such a
    server): the door's first loader and a forward handler."""
    current = rt.settings
    if current is None or current.config.importance_load != "gated":
        return False
    sparse = Sparse(rt)
    rt.door.add(sparse)
    rt.forward.add_handler(sparse.handler)
    rt.forward.observe_extends(sparse.offer_prompts)
    return True
