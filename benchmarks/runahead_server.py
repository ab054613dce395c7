"""TTFT of long prompts in a real SGLang server (CPU, the embedded SmolLM2, bf16): SGLang's own prefill vs chained
prefill (`--tiered-runahead-ranks 2`: the scheduler plus one helper rank process), same prompts, same run.

Per length, every repeat sends a prompt never seen before (disjoint slices of the essays), greedy, max_new_tokens=1,
so TTFT = client-side latency. Prompts longer than SGLang's chunked-prefill size (4096 on CPU) are prefilled in
pieces; with runahead each piece goes through the chain (the second extends the first as a cached prefix).

    .venv/bin/python benchmarks/runahead_server.py [--lengths 2048 4096 8000] [--repeats 3]

Writes benchmarks/results/runahead_server.json and .png, prints a one-line verdict (the engine-level comparison with
TSP and the targets is benchmarks/runahead.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, PromptSource, auto_dtype, machine, save  # noqa: E402

from sglang_tiered.server_process import ServerProcess  # noqa: E402

CONFIGS = {"sglang prefill": [], "chained, 2 ranks": ["--tiered-runahead-ranks", "2"]}


def run(lengths: list[int], repeats: int, min_tokens: int, dtype: str) -> dict:
    source = PromptSource()
    prompts = {n: [source.take(n) for _ in range(repeats + 1)] for n in lengths}  # +1: a warm-up per length
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            args = ["--kv-backend", "tiered", "--max-total-tokens", str(2 * max(lengths) + 1024),
                    "--tiered-ssd-dir", f"{tmp}/{len(out)}", "--tiered-stats-interval", "0",
                    "--tiered-runahead-min-tokens", str(min_tokens), "--dtype", dtype, *extra]
            log = Path(tmp) / f"{len(out)}.log"
            with ServerProcess(args, log_path=log) as s:
                if extra:
                    _wait_ready(log)
                rows = {}
                for n in lengths:
                    times = []
                    for i, p in enumerate(prompts[n]):
                        r = s.generate(p, max_new_tokens=1, timeout=1800)
                        if i:
                            times.append(r["latency_s"])
                        print(f"[{name}] {n} tokens ({r['meta_info']['prompt_tokens']}): {r['latency_s']:.3f} s",
                              flush=True)
                    rows[str(n)] = {"median_s": statistics.median(times), "times_s": times}
                chained = [ln for ln in log.read_text().splitlines() if "tiered runahead: rid" in ln]
                rows["log"] = chained[-3:]
            out[name] = rows
    return out


def _wait_ready(log: Path, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while "chain ranks ready" not in log.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError("chain ranks not ready")
        time.sleep(0.5)


def plot(results: dict, lengths: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(results)
    for i, (name, rows) in enumerate(results.items()):
        ax.bar([j + i * width for j in range(len(lengths))], [rows[str(n)]["median_s"] for n in lengths], width,
               label=name)
    ax.set_xticks([j + width / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title("SGLang server on 2 CPU cores: chained prefill vs SGLang's prefill")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "runahead_server.png", dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])  # SmolLM2 context: 8192
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: what --dtype auto picks on this machine")
    a = p.parse_args()
    dtype = a.dtype or auto_dtype()
    results = run(a.lengths, a.repeats, a.min_tokens, dtype)
    save("runahead_server", {"machine": machine(), "dtype": dtype, "repeats": a.repeats, "ranks": 2,
                             "min_tokens": a.min_tokens, "model": "SmolLM2-135M-Instruct", "results": results})
    plot(results, a.lengths)
    base, chain = results["sglang prefill"], results["chained, 2 ranks"]
    ratios = ", ".join(f"{n}: {chain[str(n)]['median_s']:.2f} s vs {base[str(n)]['median_s']:.2f} s "
                       f"({chain[str(n)]['median_s'] / base[str(n)]['median_s']:.2f}x)" for n in a.lengths)
    print(f"runahead in the server (2 ranks, this CPU): chained vs SGLang's prefill TTFT: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
