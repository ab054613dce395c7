"""Chained prefill (KV-Runahead) of long prompts inside the SGLang server.

With `--tiered-runahead-ranks N` (N >= 2), every scheduler process (CPU, TP = PP = DP = 1) becomes the last rank of
a chain of N ranks (`engine.chain_ranks.ChainRanks`): N - 1 helper processes on the same machine, each holding a
full copy of the weights, compute the earlier slices of the prompt and pass the accumulated KV along point to point
(gloo, a private process group); the scheduler computes the last slice on SGLang's own weights (views), layer by
layer as each layer's KV arrives, and ends up with the full KV and the last token's hidden state.

Seam: a handler of the shared `LlamaModel.forward` hook (model_forward.py), asked after fusion. It takes an extend
batch of exactly one request with at least `--tiered-runahead-min-tokens` new tokens, no input logprobs and no
hidden-state capture; a cached radix prefix is sent to rank 0 and extended (so each piece of a chunked prefill
qualifies on its own). The KV lands in the request's slots and enters the radix cache (and the host / SSD tiers)
like any exact prefill. Anything else runs SGLang's own forward.

Failure: the helpers start in a background thread at the first forward (until they are ready, long prompts take
the normal path). A rank that dies or stalls longer than `--tiered-runahead-timeout` makes that prefill fall back to
SGLang's forward (nothing was written to the pool yet); the chain is torn down and restarted in the background,
and given up after `MAX_RESTARTS` consecutive failures. Logs: one line per chained prefill or fallback
(`tiered runahead: rid ...`); Prometheus counters `sglang_tiered:runahead_*` (metrics.py).

Split: the measured table of `sglang-tiered runahead-tune` (interpolated between lengths) when one exists for N
ranks, else a FLOP-balanced split (`scheduler.partition.flop_balanced_bounds`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_tiered.engine.chain_ranks import ChainRanks
from sglang_tiered.engine.parallel_prefill import ChainError, bounds_from_fractions
from sglang_tiered.integration import metrics, model_forward
from sglang_tiered.scheduler.partition import PartitionTable, flop_balanced_bounds

logger = logging.getLogger("sglang_tiered")

ENV = "SGLANG_TIERED_RUNAHEAD"
MAX_RESTARTS = 3


@dataclass(frozen=True)
class RunaheadSettings:
    ranks: int
    min_tokens: int
    timeout_s: float
    threads: int  # per helper rank (resolved, >= 1)
    partitions: str  # table path or ""
    model_path: str

    @classmethod
    def from_env(cls) -> Optional[RunaheadSettings]:
        return _parse(os.environ.get(ENV))


@functools.lru_cache(maxsize=4)
def _parse(raw: Optional[str]) -> Optional[RunaheadSettings]:
    return RunaheadSettings(**json.loads(raw)) if raw else None


@dataclass
class RunaheadStats:  # for the log line; tokens and bytes are Prometheus counters (metrics.count)
    prefills: int = 0
    fallbacks: int = 0


class _Runtime:
    """Per scheduler process: the chain, its split, its restarts."""

    def __init__(self, settings: RunaheadSettings, module) -> None:
        self.settings = settings
        self.engine = model_forward.engine_from_sglang(module)
        self.chain = ChainRanks(self.engine, ("pretrained", settings.model_path), settings.ranks,
                                threads=settings.threads, timeout_s=settings.timeout_s)
        self.table = self._load_table(settings)
        c = self.engine.cfg
        self.linear_flops = 2.0 * (c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim
                                   + c.heads * c.head_dim * c.hidden + 3 * c.hidden * c.intermediate)
        self.pair_flops = 4.0 * c.heads * c.head_dim
        self.stats = RunaheadStats()
        self.consecutive_failures = 0
        self._starter: Optional[threading.Thread] = None
        self._gave_up = False

    @staticmethod
    def _load_table(settings: RunaheadSettings) -> Optional[PartitionTable]:
        if not settings.partitions or not os.path.isfile(settings.partitions):
            logger.info("tiered runahead: no partition table; using FLOP-balanced splits "
                        "(run `sglang-tiered runahead-tune --ranks %d` to measure better ones)", settings.ranks)
            return None
        table = PartitionTable.load(settings.partitions)
        if settings.ranks not in table.entries:
            logger.warning("tiered runahead: %s has no partitions for %d ranks; using FLOP-balanced splits",
                           settings.partitions, settings.ranks)
            return None
        logger.info("tiered runahead: partitions from %s (lengths %s)", settings.partitions,
                    sorted(table.entries[settings.ranks]))
        return table

    def ensure_started(self) -> None:
        """Start (or restart) the helpers in the background unless running, starting, or given up."""
        if self.chain.ready or (self._starter is not None and self._starter.is_alive()):
            return
        if self.consecutive_failures > MAX_RESTARTS:
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
        except ChainError as exc:
            self.consecutive_failures += 1
            logger.warning("tiered runahead: chain ranks failed to start (%d/%d): %s", self.consecutive_failures,
                           MAX_RESTARTS + 1, exc)

    def bounds(self, prefix: int, tokens: int) -> list[int]:
        if self.table is not None:
            fractions = self.table.lookup(self.settings.ranks, prefix + tokens)
            return [prefix + b for b in bounds_from_fractions(tokens, fractions)]
        return flop_balanced_bounds(prefix, tokens, self.settings.ranks, self.linear_flops, self.pair_flops)


_runtime: Optional[_Runtime] = None
_disabled: Optional[str] = None


def _unsupported(module, fb) -> Optional[str]:
    if fb.return_logprob:
        return "logprobs were requested"
    mode = getattr(fb, "capture_hidden_mode", None)
    if mode is not None and getattr(mode, "need_capture", lambda: False)():
        return "hidden states are captured"
    if not model_forward.whole_model_in_rank(module):
        return "pipeline parallelism"
    return None


def try_forward(module, input_ids, positions, fb) -> Optional[torch.Tensor]:
    """The chained prefill of a long single-request extend (see the module docstring), or None."""
    global _runtime, _disabled
    settings = RunaheadSettings.from_env()
    if settings is None or settings.ranks < 2 or _disabled is not None:
        return None
    if _runtime is None:
        try:
            _runtime = _Runtime(settings, module)
        except (NotImplementedError, OSError, ValueError) as exc:
            _disabled = str(exc)
            logger.warning("tiered runahead: disabled in this process: %s", exc)
            return None
    rt = _runtime
    rt.ensure_started()
    if fb.batch_size != 1 or fb.extend_seq_lens_cpu[0] < settings.min_tokens:
        return None
    rid = fb.rids[0] if fb.rids else "?"
    why = _unsupported(module, fb)
    if why is None and not rt.chain.ready:
        why = "the chain ranks are not running" + (" (given up)" if rt.consecutive_failures > MAX_RESTARTS else "")
    if why is None:
        try:
            return _chained_forward(rt, rid, input_ids, fb)
        except ChainError as exc:  # the chain stopped itself; nothing was written to the pool
            rt.consecutive_failures += 1
            why = f"chain failed: {exc}"
            rt.ensure_started()
    rt.stats.fallbacks += 1
    metrics.count("runahead_fallbacks")
    logger.info("tiered runahead: rid %s runs a normal prefill (%s)", rid, why)
    return None


@torch.inference_mode()
def _chained_forward(rt: _Runtime, rid: str, input_ids: torch.Tensor, fb) -> torch.Tensor:
    t0 = time.perf_counter()
    prefix, tokens = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
    bounds = rt.bounds(prefix, tokens)
    ids = input_ids.to(torch.int64).cpu()
    threads = torch.get_num_threads()
    torch.set_num_threads(rt.settings.threads)  # the last rank gets its share of the cores, like every helper
    try:
        res = rt.chain.prefill(ids, bounds, model_forward.prefix_kv_reader(fb) if prefix else None)
    finally:
        torch.set_num_threads(threads)
    t_chain = time.perf_counter() - t0
    hidden = model_forward.write_extend(fb, rt.engine, res.kv[:, prefix:], res.last_hidden)
    rt.consecutive_failures = 0
    s = rt.stats
    s.prefills += 1
    metrics.count("runahead_prefills")
    metrics.count("runahead_tokens", tokens)
    metrics.count("runahead_bytes_sent", res.bytes_sent)
    logger.info("tiered runahead: rid %s tokens=%d radix_prefix=%d ranks=%d bounds=%s chain=%.3fs total=%.3fs "
                "(chained prefills %d, fallbacks %d)", rid, tokens, prefix, rt.settings.ranks, bounds, t_chain,
                time.perf_counter() - t0, s.prefills, s.fallbacks)
    return hidden


def register_hooks() -> bool:
    """Register the forward handler in processes started with runahead on (schedulers inherit the environment)."""
    settings = RunaheadSettings.from_env()
    if settings is None or settings.ranks < 2:
        return False
    model_forward.add_handler(try_forward)
    return True
