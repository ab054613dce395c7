"""Chained prefill (KV-Runahead) of long prompts inside the SGLang server.

With `--tiered-runahead-ranks N` (N >= 2), every scheduler process (CPU, TP = PP = DP = 1) becomes the last rank of
a chain of N ranks (`engine.runahead_ranks.RunaheadRanks`): N - 1 helper processes on the same machine, each holding a
full copy of the weights, compute the earlier slices of the prompt and pass the accumulated KV along point to point
(gloo, a private process group); the scheduler computes the last slice on SGLang's own weights (views), layer by
layer as each layer's KV arrives, and ends up with the full KV and the last token's hidden state.

Seam (listed in plugin.py): `RunaheadHandler` on the shared Llama forward hook (model_forward.py), asked after
blending and the stored-span loaders. It takes an extend batch of exactly one request with at least
`--tiered-runahead-min-tokens` new tokens, no input logprobs, no hidden-state capture and nothing our engine cannot
compute (`model_forward.engine_declines`: counted fallback); a cached radix prefix is sent to rank 0 and extended
(so each piece of a chunked prefill qualifies on its own). The KV lands in the request's slots and enters the
radix cache (and the host / SSD tiers) like any exact prefill. Anything else runs SGLang's own forward.

Failure: the helpers start in a background thread at the first forward (until they are ready, long prompts take
the normal path). A rank that dies or stalls longer than `--tiered-runahead-timeout` makes that prefill fall back to
SGLang's forward (nothing was written to the pool yet); the chain is torn down and restarted in the background,
and given up after `MAX_RESTARTS` consecutive failures. Logs: one line per chained prefill or fallback
(`tiered runahead: rid ...`); Prometheus counters `sglang_tiered:runahead_*` (metrics.py).

Split: the measured table of `sglang-tiered runahead-tune` (interpolated between lengths) when one exists for N
ranks, else a FLOP-balanced split (`policy.partition.flop_balanced_bounds`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from sglang_tiered.engine.parallel_prefill import RunaheadError, bounds_from_fractions
from sglang_tiered.engine.runahead_ranks import RunaheadRanks
from sglang_tiered.integration import model_forward, settings
from sglang_tiered.policy.partition import PartitionTable, flop_balanced_bounds

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")

MAX_RESTARTS = 3


class _Runtime:
    """Per scheduler process: the chain, its split, its restarts."""

    def __init__(self, current: settings.Settings, engine) -> None:
        cfg = current.config
        self.ranks, self.min_tokens = cfg.runahead_ranks, cfg.runahead_min_tokens
        self.threads = current.runahead_threads
        self.engine = engine
        self.chain = RunaheadRanks(self.engine, ("pretrained", str(Path(current.model_path).resolve())), self.ranks,
                                   threads=self.threads, timeout_s=cfg.runahead_timeout)
        self.table = self._load_table(current.runahead_partitions, self.ranks)
        c = self.engine.cfg
        self.linear_flops = 2.0 * (c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim
                                   + c.heads * c.head_dim * c.hidden + 3 * c.hidden * c.intermediate)
        self.pair_flops = 4.0 * c.heads * c.head_dim
        self.prefills = 0
        self.fallbacks = 0
        self.consecutive_failures = 0
        self._starter: Optional[threading.Thread] = None
        self._gave_up = False

    @staticmethod
    def _load_table(path: str, ranks: int) -> Optional[PartitionTable]:
        if not path or not os.path.isfile(path):
            logger.info("tiered runahead: no partition table; using FLOP-balanced splits "
                        "(run `sglang-tiered runahead-tune --ranks %d` to measure better ones)", ranks)
            return None
        table = PartitionTable.load(path)
        if ranks not in table.entries:
            logger.warning("tiered runahead: %s has no partitions for %d ranks; using FLOP-balanced splits",
                           path, ranks)
            return None
        logger.info("tiered runahead: partitions from %s (lengths %s)", path, sorted(table.entries[ranks]))
        return table

    @property
    def given_up(self) -> bool:
        return self.consecutive_failures > MAX_RESTARTS

    def ensure_started(self) -> None:
        """Start (or restart) the helpers in the background unless running, starting, or given up."""
        if self.chain.ready or (self._starter is not None and self._starter.is_alive()):
            return
        if self.given_up:
            if not self._gave_up:
                self._gave_up = True
                logger.warning("tiered runahead: giving up after %d consecutive chain failures; long prompts use "
                               "SGLang's prefill until the server restarts", self.consecutive_failures)
            return
        self._starter = threading.Thread(target=self._start, name="tiered-runahead-start", daemon=True)
        self._starter.start()

    def _start(self) -> None:
        try:
            self.chain.start()
        except RunaheadError as exc:
            self.consecutive_failures += 1
            logger.warning("tiered runahead: chain ranks failed to start (%d/%d): %s", self.consecutive_failures,
                           MAX_RESTARTS + 1, exc)

    def bounds(self, prefix: int, tokens: int) -> list[int]:
        if self.table is not None:
            fractions = self.table.lookup(self.ranks, prefix + tokens)
            return [prefix + b for b in bounds_from_fractions(tokens, fractions)]
        return flop_balanced_bounds(prefix, tokens, self.ranks, self.linear_flops, self.pair_flops)


def _unsupported(module, fb, reqs) -> Optional[str]:
    declined = next((why for why in map(model_forward.engine_declines, reqs) if why is not None), None)
    if declined is not None:
        return declined
    if fb.return_logprob:
        return "logprobs were requested"
    mode = getattr(fb, "capture_hidden_mode", None)
    if mode is not None and getattr(mode, "need_capture", lambda: False)():
        return "hidden states are captured"
    if not model_forward.whole_model_in_rank(module):
        return "pipeline parallelism"
    return None


class RunaheadHandler(model_forward.ForwardHandler):
    """The chained prefill of a long single-request extend (see the module docstring)."""

    name = "runahead"

    def build_runtime(self, module) -> _Runtime:
        return _Runtime(self.rt.settings, self.rt.forward.engine(module))

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        rt = self.runtime(module)  # built at the first forward: the helpers start early, in the background
        if rt is None:
            return None
        rt.ensure_started()
        if fb.batch_size != 1 or fb.extend_seq_lens_cpu[0] < rt.min_tokens:
            return None
        why = _unsupported(module, fb, self.rt.forward.batch_requests(fb))
        if why is None and not rt.chain.ready:
            why = "the chain ranks are not running" + (" (given up)" if rt.given_up else "")
        if why is None:
            try:
                return self._chained_forward(rt, fb.rids[0] if fb.rids else "?", input_ids, fb)
            except RunaheadError as exc:  # the chain stopped itself; nothing was written to the pool
                rt.consecutive_failures += 1
                why = f"chain failed: {exc}"
                rt.ensure_started()
        rt.fallbacks += 1
        self.fallback(list(fb.rids or []), why)
        return None


    @torch.inference_mode()
    def _chained_forward(self, rt: _Runtime, rid: str, input_ids: torch.Tensor, fb) -> torch.Tensor:
        t0 = time.perf_counter()
        prefix, tokens = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
        bounds = rt.bounds(prefix, tokens)
        ids = input_ids.to(torch.int64).cpu()
        threads = torch.get_num_threads()
        torch.set_num_threads(rt.threads)  # the last rank gets its share of the cores, like every helper
        try:
            res = rt.chain.prefill(ids, bounds, model_forward.prefix_kv_reader(fb) if prefix else None)
        finally:
            torch.set_num_threads(threads)
        t_chain = time.perf_counter() - t0
        hidden = model_forward.write_extend(fb, rt.engine, res.kv[:, prefix:], res.last_hidden)
        rt.consecutive_failures = 0
        rt.prefills += 1
        events = self.rt.events
        events.count("runahead_prefills")
        events.count("runahead_tokens", tokens)
        events.count("runahead_bytes_sent", res.bytes_sent)
        logger.info("tiered runahead: rid %s tokens=%d radix_prefix=%d ranks=%d bounds=%s chain=%.3fs total=%.3fs "
                    "(chained prefills %d, fallbacks %d)", rid, tokens, prefix, rt.ranks, bounds, t_chain,
                    time.perf_counter() - t0, rt.prefills, rt.fallbacks)
        return hidden


def register_hooks(rt: Runtime) -> bool:
    """Register the forward handler in processes of a server with runahead on. Returns True if registered."""
    current = rt.settings
    if current is None or not current.runahead_on:
        return False
    rt.forward.add_handler(RunaheadHandler(rt))
    return True
