"""TTFT of one long prefill: single process vs TSP (even split, all-gather, masked attention) vs chained prefill
(KV-Runahead) with an even split, a searched split, and a split interpolated from the table of the other lengths
(leave-one-out), on 2 CPU ranks of 1 thread each; the single process uses the same 2 threads. Also the bytes each
parallel method sends. SmolLM2-135M weights, random token ids.

    .venv/bin/python benchmarks/runahead.py [--lengths 1024 2048 4096 8192] [--repeats 3] [--dtype bfloat16]

Writes benchmarks/results/runahead.json and .png, prints a one-line verdict. Targets (2 ranks, longest context):
searched chain <= 0.8x TSP and <= 0.65x single process; chain sends about half of TSP's bytes; interpolated within
3 % of searched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, auto_dtype, machine, save  # noqa: E402

from sglang_tiered.engine.parallel_prefill import bounds_from_fractions, even_bounds, runahead_prefill, tsp_prefill  # noqa: E402
from sglang_tiered.engine.ranks import run_ranks  # noqa: E402
from sglang_tiered.engine.tuning import load_model, runahead_measure, timed, tsp_time  # noqa: E402
from sglang_tiered.models import default_model_path  # noqa: E402
from sglang_tiered.policy.partition import PartitionTable, binary_search_two  # noqa: E402


def ids_for(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))


def single_target(rank, world, spec, lengths, repeats, dtype):
    model = load_model(spec, getattr(torch, dtype))
    out = {}
    for n in lengths:
        ids = ids_for(n, model.cfg.vocab)
        out[n] = timed(lambda ids=ids: model.prefill(ids), repeats)
        print(f"[single] {n} tokens: {out[n]:.3f} s", flush=True)
    return out


def parallel_target(rank, world, spec, lengths, repeats, dtype):
    model = load_model(spec, getattr(torch, dtype))
    say = (lambda m: print(m, flush=True)) if rank == 0 else None
    rows = {}
    for n in lengths:
        ids = ids_for(n, model.cfg.vocab)
        row = {}
        row["tsp_s"] = tsp_time(model, ids, repeats)
        even = even_bounds(n, world)
        row["chain_even_s"] = timed(lambda ids=ids, b=even: runahead_prefill(model, ids, b), repeats)
        fractions, _ = binary_search_two(runahead_measure(model, ids, 1), tol=0.02, progress=say)
        row["searched_fractions"] = fractions
        searched = bounds_from_fractions(n, fractions)
        row["chain_searched_s"] = runahead_measure(model, ids, repeats)(fractions)
        row["tsp_bytes_sent"] = _bytes(tsp_prefill(model, ids).bytes_sent)
        row["chain_bytes_sent"] = _bytes(runahead_prefill(model, ids, searched).bytes_sent)
        rows[n] = row
        if say:
            say(f"[2 ranks] {n} tokens: tsp {row['tsp_s']:.3f} s, chain even {row['chain_even_s']:.3f} s, "
                f"chain searched {row['chain_searched_s']:.3f} s at {fractions[0]:.3f}/{fractions[1]:.3f}")
    # leave-one-out interpolation: the split for n from the table of the other lengths only
    for n in lengths:
        table = PartitionTable()
        for m in lengths:
            if m != n:
                table.add(world, m, rows[m]["searched_fractions"])
        if not table.entries:
            continue
        fractions = table.lookup(world, n)
        ids = ids_for(n, model.cfg.vocab)
        rows[n]["interpolated_fractions"] = fractions
        rows[n]["chain_interpolated_s"] = runahead_measure(model, ids, repeats)(fractions)
    return rows


def _bytes(sent_by_this_rank: int) -> int:
    """Total bytes sent by all ranks (summed with an all-reduce)."""
    t = torch.tensor([sent_by_this_rank], dtype=torch.int64)
    torch.distributed.all_reduce(t)
    return int(t.item())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: what --dtype auto picks on this machine")
    a = p.parse_args()
    a.dtype = a.dtype or auto_dtype()
    spec = ("pretrained", str(default_model_path()))
    single = run_ranks(1, single_target, (spec, a.lengths, a.repeats, a.dtype), threads=2, timeout_s=7200)[0]
    par = run_ranks(2, parallel_target, (spec, a.lengths, a.repeats, a.dtype), threads=1, timeout_s=7200)[0]
    results = {str(n): {"single_s": single[n], **par[n]} for n in a.lengths}
    save("runahead", {"machine": machine(), "dtype": a.dtype, "repeats": a.repeats, "ranks": 2,
                      "threads_per_rank": 1, "single_threads": 2, "model": "SmolLM2-135M-Instruct", "results": results})
    plot(results)
    print(verdict(results))
    return 0


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(results)
    methods = [("single_s", "single (2 threads)"), ("tsp_s", "TSP"), ("chain_even_s", "chain even"),
               ("chain_searched_s", "chain searched"), ("chain_interpolated_s", "chain interpolated")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(methods)
    for i, (key, label) in enumerate(methods):
        ax.bar([j + i * width for j in range(len(lengths))], [results[n].get(key, 0) for n in lengths], width,
               label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title("Chained prefill (KV-Runahead) vs TSP vs single process, 2 CPU ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "runahead.png", dpi=110)


def verdict(results: dict) -> str:
    n = list(results)[-1]
    r = results[n]
    vs_tsp = r["chain_searched_s"] / r["tsp_s"]
    vs_single = r["chain_searched_s"] / r["single_s"]
    byte_ratio = r["chain_bytes_sent"] / r["tsp_bytes_sent"]
    parts = [f"runahead @{n} tokens: searched chain {r['chain_searched_s']:.3f} s = {vs_tsp:.2f}x TSP "
             f"({'PASS' if vs_tsp <= 0.8 else 'MISS'} <= 0.8), {vs_single:.2f}x single "
             f"({'PASS' if vs_single <= 0.65 else 'MISS'} <= 0.65), bytes {byte_ratio:.2f}x TSP"]
    if "chain_interpolated_s" in r:
        gap = r["chain_interpolated_s"] / r["chain_searched_s"] - 1
        parts.append(f"interpolated {gap * 100:+.1f} % vs searched ({'PASS' if gap <= 0.03 else 'MISS'} <= 3 %)")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
