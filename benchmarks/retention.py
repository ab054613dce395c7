"""What retention buys and what it costs, through the server (SmolLM2 in the dtype `--dtype auto` picks here).

    .venv/bin/python benchmarks/retention.py [--rounds 3] [--requests 48] [--parts pin overhead]

Part `pin`: a server with small pools (device 2048 tokens, host 2x, SSD 64M). A document asked with
`custom_params.tiered_retain` and a control document of the same length asked without; then, each round, a flood
of other prompts larger than device + host + SSD, and both again in shuffled order (the SSD tier's files evicted
from the page cache first): TTFT of the pinned document (still on device or host) vs the control (it left every
tier and is computed again).
Part `overhead`: the tree core retention needs. SGLang's Rust tree core cannot rank pinned nodes, so with retention
on (the default) the cache runs on SGLang's Python tree core; `--tiered-max-retain 0` keeps the Rust core. The same
Zipf workload on both (12 documents x 1024 tokens + a question each, 2 concurrent clients, device pool 4096 tokens),
the two servers alternated twice: TTFT median / p90 and requests per second.
Writes benchmarks/results/retention-<machine class>.json and .png and prints a one-line verdict.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (  # noqa: E402
    RESULTS,
    PromptSource,
    auto_dtype,
    evict_from_page_cache,
    machine,
    machine_class,
    save,
    stream_generate,
)

from sglang_tiered.server_process import ServerProcess, cached_details, exit_cleanly_on_sigterm  # noqa: E402

DOC_TOKENS = 1024
PIN_DEVICE, PIN_SSD = 2048, 64 << 20


def server(tmp: Path, name: str, dtype: str, *extra: str, max_tokens: int = 4096) -> ServerProcess:
    args = ["--kv-backend", "tiered", "--max-total-tokens", str(max_tokens), "--tiered-host-size", "2x",
            "--tiered-ssd-dir", str(tmp / name), "--tiered-stats-interval", "0", "--dtype", dtype, *extra]
    return ServerProcess(args, log_path=tmp / f"{name}.log")


def ask(s: ServerProcess, text: str, **custom) -> dict:
    out = stream_generate(s, {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                                "custom_params": custom}})
    return {"ttft_s": out["ttft_s"], "cached": cached_details(out)}


def part_pin(tmp: Path, dtype: str, rounds: int, src: PromptSource) -> dict:
    token_bytes = 23040 * (2 if dtype == "float32" else 1)
    flood_tokens = PIN_DEVICE * 3 + PIN_SSD // token_bytes + 256
    rows = []
    with server(tmp, "pin", dtype, "--tiered-ssd-capacity", str(PIN_SSD), "--tiered-retain-share", "0.9",
                max_tokens=PIN_DEVICE) as s:
        pinned, control = src.take(DOC_TOKENS // 2), src.take(DOC_TOKENS // 2)
        ask(s, pinned, tiered_retain=600)
        ask(s, control)
        for r in range(rounds):  # the same two documents every round: the control is computed again each time
            sent = 0
            while sent < flood_tokens:
                s.generate(src.take(DOC_TOKENS), max_new_tokens=1)
                sent += DOC_TOKENS
            evict_from_page_cache(tmp / "pin")
            order = [("pinned", pinned), ("control", control)]
            random.Random(r).shuffle(order)
            row = {name: ask(s, text) for name, text in order}
            rows.append(row)
            print(f"round {r}: pinned {row['pinned']['ttft_s']:.3f} s {row['pinned']['cached']}, control "
                  f"{row['control']['ttft_s']:.3f} s {row['control']['cached']}", flush=True)
    med = {k: statistics.median(row[k]["ttft_s"] for row in rows) for k in ("pinned", "control")}
    return {"rows": rows, "median_s": med, "flood_tokens": flood_tokens, "device_tokens": PIN_DEVICE,
            "ssd_capacity": PIN_SSD, "doc_tokens": DOC_TOKENS // 2}


def zipf_workload(src: PromptSource, requests: int, seed: int = 0) -> list[str]:
    docs = [src.take(DOC_TOKENS) for _ in range(12)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(docs))]
    rng = random.Random(seed)
    return [rng.choices(docs, weights)[0] + f"\n\nQuestion {i}: what is the point here?\nAnswer:"
            for i in range(requests)]


def run_workload(s: ServerProcess, texts: list[str]) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        ttfts = sorted(pool.map(lambda t: ask(s, t)["ttft_s"], texts))
    wall = time.perf_counter() - t0
    return {"ttft_median_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "requests_per_s": len(texts) / wall, "ttfts_s": ttfts}


def part_overhead(tmp: Path, dtype: str, requests: int, src: PromptSource) -> dict:
    texts = zipf_workload(src, requests)
    configs = {"rust core (retention off)": ("--tiered-max-retain", "0"), "python core (retention on)": ()}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for rep in range(2):
        for name, extra in (configs.items() if rep == 0 else reversed(configs.items())):
            with server(tmp, f"overhead-{rep}-{len(runs[name])}-{'rust' if extra else 'python'}", dtype, *extra) as s:
                core = "python" if s.log_lines("on SGLang's python tree core") else "rust"
                result = {**run_workload(s, texts), "tree_core": core}
            runs[name].append(result)
            print(f"{name} ({core}): median TTFT {result['ttft_median_s']:.3f} s, {result['requests_per_s']:.2f} "
                  "req/s", flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in ("ttft_median_s", "ttft_p90_s",
                                                                        "requests_per_s")}
               for name, rs in runs.items()}
    return {"runs": runs, "summary": summary, "requests": requests, "docs": 12, "doc_tokens": DOC_TOKENS}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if "pin" in data:
        med = data["pin"]["median_s"]
        axes[0].bar(list(med), list(med.values()), color=["tab:green", "tab:gray"])
        axes[0].set_title("after a flood: TTFT, median (s)")
    if "overhead" in data:
        summ = data["overhead"]["summary"]
        axes[1].bar(list(summ), [v["ttft_median_s"] for v in summ.values()], color=["tab:blue", "tab:orange"])
        axes[1].set_title("Zipf workload, 2 clients: TTFT median (s)")
        axes[1].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--parts", nargs="+", default=["pin", "overhead"], choices=["pin", "overhead"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    a = p.parse_args()
    exit_cleanly_on_sigterm()
    dtype = a.dtype or auto_dtype()
    data: dict = {"machine": machine(), "dtype": dtype}
    src = PromptSource()
    with tempfile.TemporaryDirectory(prefix="retention-bench-") as tmp:
        if "pin" in a.parts:
            data["pin"] = part_pin(Path(tmp), dtype, a.rounds, src)
        if "overhead" in a.parts:
            data["overhead"] = part_overhead(Path(tmp), dtype, a.requests, src)
    verdict = []
    if "pin" in data:
        med = data["pin"]["median_s"]
        verdict.append(f"pinned prompt after a flood {med['pinned']:.3f} s vs unpinned {med['control']:.3f} s "
                       f"({med['control'] / med['pinned']:.2f}x)")
    if "overhead" in data:
        s = data["overhead"]["summary"]
        rust, py = s["rust core (retention off)"], s["python core (retention on)"]
        verdict.append(f"Python tree core (retention on) vs Rust: TTFT median "
                       f"{py['ttft_median_s'] / rust['ttft_median_s']:.2f}x, throughput "
                       f"{py['requests_per_s'] / rust['requests_per_s']:.2f}x")
    data["verdict"] = "; ".join(verdict)
    name = f"retention-{machine_class()}"
    save(name, data)
    plot(data, RESULTS / f"{name}.png")
    print("verdict:", data["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
