"""Measuring chained-prefill TTFT on real ranks, and building the partition table (`sglang-tiered runahead-tune`).

All ranks run the same search in lockstep: each candidate split is timed on every rank (barrier, chained prefill),
the last rank's elapsed time is broadcast, so every rank sees the same measurements and takes the same decisions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.parallel_prefill import bounds_from_fractions, runahead_prefill, tsp_prefill
from sglang_tiered.policy.partition import PartitionTable, search

ModelSpec = tuple  # ("pretrained", path) | ("random", LlamaConfig or its fields as a dict)


def load_model(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> LlamaModel:
    kind, arg = spec
    if kind == "pretrained":
        return LlamaModel.from_pretrained(arg, dtype)
    if kind == "random":
        return LlamaModel.random(arg if isinstance(arg, LlamaConfig) else LlamaConfig(**arg), dtype=dtype)
    raise ValueError(f"unknown model spec {spec!r}")


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median over `repeats` of the last rank's time from a common barrier to the end of `fn` (seconds), the same
    value on every rank."""
    world = dist.get_world_size()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.broadcast(elapsed, src=world - 1)
        times.append(float(elapsed.item()))
    return statistics.median(times)


def runahead_measure(model: LlamaModel, ids: torch.Tensor, repeats: int) -> Callable[[list[float]], float]:
    def measure(fractions: list[float]) -> float:
        bounds = bounds_from_fractions(ids.shape[0], fractions)
        return timed(lambda: runahead_prefill(model, ids, bounds), repeats)

    return measure


def tsp_time(model: LlamaModel, ids: torch.Tensor, repeats: int) -> float:
    return timed(lambda: tsp_prefill(model, ids), repeats)


def tune_target(rank: int, world: int, spec: ModelSpec, lengths: Sequence[int], repeats: int, dtype: str,
                vocab_seed: int = 0) -> Optional[dict]:
    """Rank body of `runahead-tune`: search every length; rank 0 returns {length: (fractions, seconds)}."""
    model = load_model(spec, getattr(torch, dtype))
    g = torch.Generator().manual_seed(vocab_seed)
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else None
    found = {}
    for n in lengths:
        ids = torch.randint(0, model.cfg.vocab, (n,), generator=g)
        if say:
            say(f"[runahead-tune] {world} ranks, {n} tokens:")
        fractions, seconds = search(runahead_measure(model, ids, repeats), world, progress=say)
        found[n] = (fractions, seconds)
        if say:
            say(f"[runahead-tune] {n} tokens: best split {'/'.join(f'{f:.3f}' for f in fractions)} "
                f"-> {seconds * 1000:.1f} ms")
    return found if rank == 0 else None


def build_table(world: int, spec: ModelSpec, lengths: Sequence[int], *, repeats: int = 3, threads: int = 1,
                dtype: str = "float32", timeout_s: float = 3600) -> PartitionTable:
    from sglang_tiered.engine.ranks import run_ranks

    found = run_ranks(world, tune_target, (spec, list(lengths), repeats, dtype), threads=threads,
                      timeout_s=timeout_s)[0]
    table = PartitionTable(meta={"model": str(spec[1]), "threads_per_rank": threads, "dtype": dtype,
                                 "repeats": repeats})
    for n, (fractions, _) in found.items():
        table.add(world, n, fractions)
    return table
