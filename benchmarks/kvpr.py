"""Partial-recompute loading (KVPR) through the server (CPU, multi-head-attention models with random weights).

For each model (`smollm2-mha`: SmolLM2-135M's shape with 9 KV heads; `wide`: hidden 1024, 16 KV heads), each disk
speed (the disk's own and, with the server's block-device reads throttled by `shared/tools/slow-disk`, each of
`--slow-mbps`) and each prefix length (`--lengths` tokens, whole pages): a document of that length is prefilled
once (its KV pages and activations reach the SSD tier), then -- device and host flushed, the SSD tier's files
evicted from the page cache before every request -- the document plus a 32-token question is sent with
`custom_params.tiered_kvpr` =
  * "off": SGLang's own L3 load of every page (the full load users get without KVPR),
  * l tokens for l on a grid (0 = our loader reading all KV, ..., the whole span recomputed),
  * "auto": the split the scheduler chooses from the measured profile.
Reported per point: TTFT (client side, max_new_tokens=1, median of `--repeats`) and the loader's load time (its
log line). Verdicts, per (model, disk, length) where the scheduler chose l > 0 ("KVPR should win"): auto within
5 % of the best grid point, >= 25 % lower TTFT than the full load (the better of "off" and l = 0); everywhere:
auto never more than 3 % slower than SGLang's full load ("off"). Modes are measured interleaved (one round over
all of them in a shuffled order, `--repeats` rounds).

    .venv/bin/python benchmarks/kvpr.py [--lengths 1024 4096] [--slow-mbps 200 100 50] [--models smollm2-mha wide]

Writes benchmarks/results/kvpr.json and .png, prints one verdict line.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (  # noqa: E402
    RESULTS,
    SLOW_DISK,
    PromptSource,
    auto_dtype,
    evict_from_page_cache,
    machine,
    save,
    server_read_bytes,
)

from sglang_tiered.engine.llama import LlamaConfig  # noqa: E402
from sglang_tiered.models import random_model_dir  # noqa: E402
from sglang_tiered.server_process import ServerProcess, metric_total  # noqa: E402

PAGE = 64
QUESTION = 32
MODELS = {
    "smollm2-mha": LlamaConfig(hidden=576, layers=30, heads=9, kv_heads=9, head_dim=64, intermediate=1536,
                               vocab=49152),
    "wide": LlamaConfig(hidden=1024, layers=24, heads=16, kv_heads=16, head_dim=64, intermediate=2816, vocab=49152),
}


def request(s: ServerProcess, ids: list[int], mode) -> tuple[float, dict]:
    t0 = time.perf_counter()
    status, body = s.request("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0, "custom_params": {"tiered_kvpr": mode}}}, timeout=600)
    if status != 200:
        raise RuntimeError(f"request failed: {body}")
    return time.perf_counter() - t0, body


def measure_once(s: ServerProcess, ssd: Path, ids: list[int], mode) -> dict:
    s.flush_cache()
    evict_from_page_cache(ssd)
    mark, before = s.log_mark(), server_read_bytes(s)
    ttft, body = request(s, ids, mode)
    line = (s.log_lines("tiered kvpr: rid", since=mark) or [""])[-1]
    load = re.search(r"total=([\d.]+)s", line)
    l_tok = re.search(r"recomputed l=(\d+)", line)
    return {"ttft_s": ttft, "load_s": float(load.group(1)) if load else None,
            "l": int(l_tok.group(1)) if l_tok else None, "read_bytes": server_read_bytes(s) - before,
            "output": body["output_ids"], "model_line": line.split("(", 1)[-1][:200] if line else ""}


def measure(s: ServerProcess, ssd: Path, ids: list[int], modes: dict, repeats: int) -> dict:
    """Every mode once per round in a shuffled order (seeded), rounds repeated: drift and the previous request's
    after-effects hit all modes alike; medians."""
    rows: dict = {name: [] for name in modes}
    order = list(modes)
    for r in range(repeats):
        random.Random(r).shuffle(order)
        for name in order:
            rows[name].append(measure_once(s, ssd, ids, modes[name]))
    out = {}
    for name, rs in rows.items():
        loads = [r["load_s"] for r in rs if r["load_s"] is not None]
        out[name] = {"ttft_s": statistics.median(r["ttft_s"] for r in rs), "rows": rs,
                     "load_s": statistics.median(loads) if loads else None, "l": rs[0]["l"],
                     "read_mib": statistics.median(r["read_bytes"] for r in rs) / 2**20,
                     "same_output": all(r["output"] == rs[0]["output"] for r in rs)}
    return out


def run_disk(model: str, model_dir: Path, disk: str, mbps: int | None, lengths: list[int], repeats: int,
             dtype: str, source: PromptSource, tmp: Path) -> dict:
    tag = f"{model}-{disk.replace(' MB/s', 'mbps')}"
    ssd = tmp / f"ssd-{tag}"
    wrapper = [] if mbps is None else [str(SLOW_DISK), "--dir", str(tmp), str(mbps), "--"]
    longest = max(lengths) + 2 * PAGE  # the document, the question, the first output token: one chunk
    args = ["--kv-backend", "tiered", "--max-total-tokens", str(2 * longest), "--dtype", dtype,
            "--tiered-ssd-dir", str(ssd), "--tiered-stats-interval", "0", "--enable-metrics",
            "--chunked-prefill-size", str(longest), "--tiered-kvpr", "auto"]
    out: dict = {}
    with ServerProcess(args, log_path=tmp / f"{tag}.log", model_path=str(model_dir), wrapper=wrapper) as s:
        docs = {n: source.tok(source.take(n + 16))["input_ids"][:n] for n in lengths}
        question = source.tok(source.take(QUESTION + 8))["input_ids"][:QUESTION]
        for n, doc in docs.items():  # store the documents' pages and activations
            written = metric_total(s.get("/metrics"), "sglang_tiered:kvpr_activation_pages_written_total")
            request(s, doc + question[::-1], "off")
            deadline = time.monotonic() + 120
            while metric_total(s.get("/metrics"), "sglang_tiered:kvpr_activation_pages_written_total") < \
                    written + n // PAGE and time.monotonic() < deadline:
                time.sleep(0.3)
        profile = s.log_lines("tiered kvpr: profile") + s.log_lines("tiered kvpr: SSD read bandwidth")
        for n, doc in docs.items():
            ids = doc + question
            grid = sorted({0, n // 4 // PAGE * PAGE, n // 2 // PAGE * PAGE, 3 * n // 4 // PAGE * PAGE, n})
            modes = {"off": "off", **{f"l={l_tok}": l_tok for l_tok in grid}, "auto": "auto"}
            points = measure(s, ssd, ids, modes, repeats)
            out[str(n)] = points
            grid_best = min((p["ttft_s"], k) for k, p in points.items() if k.startswith("l="))
            full = min(points["off"]["ttft_s"], points["l=0"]["ttft_s"])
            auto = points["auto"]
            print(f"[kvpr] {model} {disk} {n} tokens: off {points['off']['ttft_s']:.3f}s, "
                  + ", ".join(f"{k} {p['ttft_s']:.3f}s" for k, p in points.items() if k.startswith("l=")) +
                  f", auto (l={auto['l']}) {auto['ttft_s']:.3f}s; best grid {grid_best[1]}; "
                  f"auto/full {auto['ttft_s'] / full:.2f}", flush=True)
        out["profile"] = profile[-2:]
    return out


def verdicts(results: dict) -> dict:
    checks = {"within_5pct_of_best": [], "25pct_faster_where_chosen": [], "never_3pct_slower": []}
    for model, disks in results.items():
        for disk, lengths in disks.items():
            for n, p in lengths.items():
                if n == "profile":
                    continue
                where = f"{model}/{disk}/{n}"
                best = min(v["ttft_s"] for k, v in p.items() if k.startswith("l="))
                full = min(p["off"]["ttft_s"], p["l=0"]["ttft_s"])
                auto = p["auto"]
                chose = auto["l"] is not None and auto["l"] > 0
                off = p["off"]["ttft_s"]  # SGLang's own full load: what a user gets without KVPR
                checks["never_3pct_slower"].append((where, auto["ttft_s"] <= 1.03 * off, auto["ttft_s"] / off))
                if chose:
                    checks["within_5pct_of_best"].append((where, auto["ttft_s"] <= 1.05 * best,
                                                          auto["ttft_s"] / best))
                    checks["25pct_faster_where_chosen"].append((where, auto["ttft_s"] <= 0.75 * full,
                                                                auto["ttft_s"] / full))
    return checks


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, d, n) for m, ds in results.items() for d, ls in ds.items() for n in ls if n != "profile"]
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, (m, d, n) in zip(axes.flat, panels):
        p = results[m][d][n]
        grid = sorted((int(k[2:]), v["ttft_s"]) for k, v in p.items() if k.startswith("l="))
        ax.plot([g[0] for g in grid], [g[1] for g in grid], "o-", label="fixed l")
        ax.axhline(p["off"]["ttft_s"], color="gray", ls="--", label="SGLang full load")
        if p["auto"]["l"] is not None:
            ax.plot([p["auto"]["l"]], [p["auto"]["ttft_s"]], "r*", ms=12, label="scheduler's l")
        else:
            ax.axhline(p["auto"]["ttft_s"], color="red", ls=":", label="auto (l = 0: SGLang's load)")
        ax.set_title(f"{m}, {d}, {n} tok", fontsize=9)
        ax.set_xlabel("l (tokens recomputed)")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--slow-mbps", nargs="*", type=int, default=[200, 100, 50])
    ap.add_argument("--skip-native", action="store_true", help="only the throttled disks")
    ap.add_argument("--merge", action="store_true",
                    help="keep the last JSON's results and replace only the (model, disk, length) points run now")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="default: what --dtype auto picks on this machine")
    ap.add_argument("--verdict-only", action="store_true", help="recompute the verdict and plot from the last JSON")
    args = ap.parse_args()
    if args.verdict_only:
        import json

        payload = json.loads((RESULTS / "kvpr.json").read_text())
        return report(payload["results"], payload)
    if any(n % PAGE for n in args.lengths):
        ap.error(f"--lengths must be multiples of the page size ({PAGE})")
    dtype = args.dtype or auto_dtype()
    source = PromptSource()
    results: dict = {}
    previous = None
    if args.merge and (RESULTS / "kvpr.json").exists():
        import json

        previous = json.loads((RESULTS / "kvpr.json").read_text())
        results = previous["results"]
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:  # on the disk, not tmpfs: slow-disk throttles it
        tmp = Path(tmp)
        for model in args.models:
            model_dir = random_model_dir(tmp / model, MODELS[model], seed=0)
            results.setdefault(model, {})
            for mbps in ([] if args.skip_native else [None]) + args.slow_mbps:
                disk = "native" if mbps is None else f"{mbps} MB/s"
                got = run_disk(model, model_dir, disk, mbps, args.lengths, args.repeats, dtype, source, tmp)
                results[model].setdefault(disk, {}).update(got)
    payload = {"machine": machine(), "dtype": dtype, "models": {m: MODELS[m].__dict__ for m in results},
               "args": vars(args), "results": results}
    if previous is not None:
        payload["merged_from"] = {"args": previous.get("args"), "machine": previous.get("machine")}
    return report(results, payload)


def report(results: dict, payload: dict) -> int:
    checks = verdicts(results)
    ok = {k: all(c[1] for c in v) for k, v in checks.items()}
    payload["checks"] = {k: [{"where": w, "pass": p, "ratio": round(r, 3)} for w, p, r in v]
                         for k, v in checks.items()}
    path = save("kvpr", payload)
    plot(results, RESULTS / "kvpr.png")
    summary = "; ".join(f"{k} {'PASS' if ok[k] else 'MISS'} ({sum(c[1] for c in checks[k])}/{len(checks[k])})"
                        for k in checks)
    print(f"VERDICT kvpr ({payload['dtype']}, {payload['machine']['cpu_capability']}): {summary}; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
