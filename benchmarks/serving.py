"""Serving throughput and TTFT measured the way SGLang users measure them: SGLang's own benchmark client
(`python -m sglang.benchmark.serving`, run from `.venv-bench/`, built by `scripts/bench-env.sh`: the client's
`datasets` dependency stays out of the server's environment) against one server per configuration and workload.

Workloads:
  * `gsp`: SGLang's `generated-shared-prefix` dataset, Zipf groups (alpha 1.0): 16 groups x 6 prompts, 1,536-token
    shared system prompts, 128-token questions, 32 output tokens, 4 concurrent clients; device pool 4,096 tokens
    (three or so groups fit: the others come from host memory or storage).
  * `gsp-multiturn`: the same with 3 turns per conversation (16 conversations, one per group draw).
  * `rag`: a custom dataset from HotpotQA dev (questions 1000 on; 0-999 are reserved): each request is one
    question's 10 paragraphs, each marked with the chunk separator, in an order shuffled per request, then the
    question; every question is asked `--rag-repeats` times (retrieval returns the same paragraphs in another
    order). 16 output tokens, at 1, 4 and 8 concurrent clients, a fresh server and store per point.

Configurations (same run, same dtype, `--max-total-tokens 4096`, host memory 3x the device pool, SGLang's loop
without overlap in every one but `tiered-overlap`, as a CPU server with `--kv-backend tiered` runs it; docs/cpu.md):
  radix          SGLang's radix cache alone
  hicache-file   SGLang HiCache with its `file` storage backend
  tiered         --kv-backend tiered (prefix-aware CPU attention)
  tiered-native  --kv-backend tiered --tiered-cpu-attention torch_native (SGLang's attention: isolates the store)
  tiered-overlap tiered with SGLANG_TIERED_CPU_OVERLAP=1: SGLang's overlap loop, which CPU servers turn off by
                 default (docs/cpu.md); not in the default set
and for `rag` (`--rag-configs`): `blend` (--tiered-blend blend: chunk KV reused in any order) against `prefix`
(--tiered-blend prefix: the separators removed, SGLang's exact prefill and radix cache), and `prefix-alone`: `prefix`
with SGLang admitting one request per prefill batch (chunked prefill off, a 1,024-token prefill budget: a second
request never fits) -- what prefilling one request at a time, as blend does with marked requests, costs SGLang's
own path on this machine. A rag run keeps the rag points it does not measure (same questions and repeats).

Per point: req/s, TTFT median / p90 (the client's), cached tokens (the client's --cache-report), and from the
server's /metrics the mean time requests waited in the queue (`sglang:queue_time_seconds`) -- where marked
(`blend`) requests, prefilled one at a time, queue behind each other, this is where it shows.

    bash scripts/bench-env.sh && .venv/bin/python benchmarks/serving.py [--workloads gsp gsp-multiturn rag]

Writes benchmarks/results/serving-<machine class>.json and .png (workloads not run keep their last results; `--name`
another name) and prints one verdict line; `--logs DIR` keeps the servers' and clients' logs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, SGLANG_CPU_LOOP, auto_dtype, hicache_args, machine, machine_class, save  # noqa: E402
from hotpotqa import SEP, load_questions, prompt  # noqa: E402

from sglang_tiered.integration.server_flags import CPU_OVERLAP_ENV  # noqa: E402 (1: SGLang's overlap loop)
from sglang_tiered.models import default_model_path  # noqa: E402
from sglang_tiered.server_process import ServerProcess, exit_cleanly_on_sigterm, metric_total  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / ".venv-bench" / "bin" / "python"
DEVICE_TOKENS = 4096
GSP = ["--dataset-name", "generated-shared-prefix", "--gsp-group-distribution", "zipf", "--gsp-zipf-alpha", "1.0",
       "--gsp-num-groups", "16", "--gsp-system-prompt-len", "1536", "--gsp-question-len", "128",
       "--gsp-output-len", "32"]
WORKLOADS = {
    "gsp": GSP + ["--gsp-prompts-per-group", "6", "--num-prompts", "96"],
    "gsp-multiturn": GSP + ["--gsp-prompts-per-group", "1", "--gsp-num-turns", "3", "--num-prompts", "16"],
}
SGLANG_CONFIGS = ("radix", "hicache-file")  # SGLang's own caches, without the plugin


def server_args(config: str, store: Path, dtype: str) -> list[str]:
    common = ["--max-total-tokens", str(DEVICE_TOKENS), "--dtype", dtype, "--enable-metrics"]
    if config == "radix":
        return common + SGLANG_CPU_LOOP
    if config == "hicache-file":
        return common + hicache_args("file", {"file_storage_path": str(store)}, ratio=3)
    tiered = common + ["--kv-backend", "tiered", "--tiered-ssd-dir", str(store), "--tiered-host-size", "3x",
                       "--tiered-ssd-capacity", "8G", "--tiered-stats-interval", "0"]
    if config in ("tiered", "tiered-overlap"):
        return tiered
    if config == "tiered-native":
        return tiered + ["--tiered-cpu-attention", "torch_native"]
    if config in ("blend", "prefix"):
        return tiered + ["--tiered-blend", config, "--chunked-prefill-size", "8192"]
    if config == "prefix-alone":
        return tiered + ["--tiered-blend", "prefix", "--chunked-prefill-size", "-1", "--max-prefill-tokens", "1024"]
    raise ValueError(config)


def rag_dataset(path: Path, start: int, questions: int, repeats: int) -> int:
    """Write the RAG workload as SGLang's custom JSONL (a user turn, an assistant turn); returns its request count."""
    rows = []
    for k, q in enumerate(load_questions(start, questions)):
        for r in range(repeats):
            order = list(range(len(q["context"])))
            random.Random(f"{start + k}/{r}").shuffle(order)
            rows.append({"conversations": [{"role": "user", "content": prompt(q, order)},
                                           {"role": "assistant", "content": q["answer"]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def run_client(s: ServerProcess, workload: list[str], concurrency: int, out: Path, log: Path) -> dict:
    """One `sglang.benchmark.serving` run against `s`; its JSONL result line plus the per-request TTFTs. Multi-turn
    workloads go through SGLang's OpenAI chat endpoint (the client's only multi-turn backend for SGLang)."""
    backend = "sglang-oai-chat" if "--gsp-num-turns" in workload else "sglang"
    cmd = [str(CLIENT), "-m", "sglang.benchmark.serving", "--backend", backend, "--host", "127.0.0.1",
           "--port", str(s.port), "--model", "smollm2", "--tokenizer", str(default_model_path()),
           "--max-concurrency", str(concurrency), "--output-file", str(out), "--output-details", "--cache-report",
           "--disable-tqdm", "--seed", "1", "--ready-check-timeout-sec", "0", "--warmup-requests", "1", *workload]
    with open(log, "ab") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600, cwd=ROOT,
                              start_new_session=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the benchmark client failed ({done.returncode}); the end of its output:\n"
                           + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    return json.loads(out.read_text().strip().splitlines()[-1])


def measure(config: str, workload: list[str], concurrency: int, tmp: Path, dtype: str, tag: str,
            logs: Path | None = None) -> dict:
    """One point; the server's and the client's logs go to `logs` (kept) or `tmp` (removed at the end)."""
    store = tmp / f"store-{tag}"
    store.mkdir()
    where = logs or tmp
    env = {CPU_OVERLAP_ENV: "1"} if config == "tiered-overlap" else None
    with ServerProcess(server_args(config, store, dtype), log_path=where / f"{tag}.log", env=env) as s:
        t0 = time.monotonic()
        r = run_client(s, workload, concurrency, tmp / f"{tag}.jsonl", where / f"{tag}.client.log")
        metrics = s.get("/metrics")
        fallbacks = len(s.log_lines("runs a normal prefill"))  # any forward handler's fallback to SGLang's prefill
    queued = metric_total(metrics, "sglang:queue_time_seconds_sum")
    count = metric_total(metrics, "sglang:queue_time_seconds_count")
    point = {k: r.get(k) for k in ("completed", "request_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                                   "mean_ttft_ms", "total_input_tokens", "total_output_tokens", "duration")}
    point.update(cache=r.get("cache_report"), queue_mean_s=queued / count if count else None,
                 blend_fallbacks=fallbacks, wall_s=time.monotonic() - t0, ttfts_s=r.get("ttfts"))
    print(f"[serving] {tag}: {point['request_throughput']:.3f} req/s, TTFT median "
          f"{point['median_ttft_ms'] / 1e3:.2f} s, p90 {point['p90_ttft_ms'] / 1e3:.2f} s, queue mean "
          f"{(point['queue_mean_s'] or 0):.2f} s, cached {((r.get('cache_report') or {}).get('cache_hit_rate_pct'))} %",
          flush=True)
    return point


def combined(points: list[dict]) -> dict:
    """One point from rounds of it: the median round's numbers (by req/s) as the point's, every round under
    `rounds` (a single round is returned as it is)."""
    if len(points) == 1:
        return points[0]
    ranked = sorted(points, key=lambda p: p["request_throughput"])
    return {**ranked[len(ranked) // 2], "rounds": points,
            "median_of_rounds": {k: statistics.median(p[k] for p in points)
                                 for k in ("request_throughput", "median_ttft_ms", "p90_ttft_ms")}}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        points = results[name]
        labels = list(points)
        ax.bar(range(len(labels)), [points[k]["request_throughput"] for k in labels], color="tab:blue")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("req/s", color="tab:blue")
        twin = ax.twinx()
        twin.plot(range(len(labels)), [points[k]["median_ttft_ms"] / 1e3 for k in labels], "o-", color="tab:red",
                  label="TTFT median")
        twin.plot(range(len(labels)), [points[k]["p90_ttft_ms"] / 1e3 for k in labels], "x--", color="tab:red",
                  label="TTFT p90")
        twin.set_ylabel("TTFT (s)", color="tab:red")
        twin.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["gsp", "gsp-multiturn", "rag"],
                    choices=["gsp", "gsp-multiturn", "rag"])
    ap.add_argument("--configs", nargs="+", default=["radix", "hicache-file", "tiered", "tiered-native"])
    ap.add_argument("--concurrency", type=int, default=4, help="clients for the gsp workloads")
    ap.add_argument("--rag-start", type=int, default=1000)
    ap.add_argument("--rag-questions", type=int, default=12)
    ap.add_argument("--rag-repeats", type=int, default=3)
    ap.add_argument("--rag-concurrency", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--rag-configs", nargs="+", default=["prefix", "blend", "prefix-alone"],
                    choices=["prefix", "blend", "prefix-alone"])
    ap.add_argument("--dtype", default=None, help="default: what --dtype auto picks on this machine")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each gsp point, the configurations alternating")
    ap.add_argument("--name", default=None,
                    help="results under benchmarks/results/NAME.json and .png (default: serving-<machine class>)")
    ap.add_argument("--logs", type=Path, default=None, help="keep the servers' and clients' logs in this directory")
    a = ap.parse_args()
    a.name = a.name or f"serving-{machine_class()}"
    if not CLIENT.exists():
        raise SystemExit("the benchmark client's environment is missing: bash scripts/bench-env.sh")
    exit_cleanly_on_sigterm()
    if a.logs is not None:
        a.logs.mkdir(parents=True, exist_ok=True)
    dtype = a.dtype or auto_dtype()
    results: dict[str, dict] = {}
    data = {"machine": machine(), "dtype": dtype, "device_tokens": DEVICE_TOKENS, "workloads": {}, "results": results}
    earlier = RESULTS / f"{a.name}.json"
    if earlier.exists():  # a run of some workloads keeps the other workloads' last results
        old = json.loads(earlier.read_text())
        for name in (w for w in old.get("results", {}) if w not in a.workloads or w == "rag"):
            results[name], data["workloads"][name] = old["results"][name], old["workloads"].get(name)

    def keep() -> None:
        save(a.name, data)

    with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"[serving] logs and stores under {tmp}", flush=True)
        for name in (w for w in a.workloads if w != "rag"):
            data["workloads"][name] = {"args": WORKLOADS[name], "concurrency": a.concurrency}
            results[name] = {}
            runs: dict[str, list[dict]] = {c: [] for c in a.configs}
            for r in range(a.rounds):
                for config in a.configs if r % 2 == 0 else reversed(a.configs):
                    tag = f"{name}-{config}" + (f"-{r}" if a.rounds > 1 else "")
                    runs[config].append(measure(config, WORKLOADS[name], a.concurrency, tmp, dtype, tag, a.logs))
                    results[name][config] = combined(runs[config])
                    keep()
        if "rag" in a.workloads:
            path = tmp / "rag.jsonl"
            n = rag_dataset(path, a.rag_start, a.rag_questions, a.rag_repeats)
            workload = ["--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", str(n),
                        "--sharegpt-output-len", "16"]
            same = {"questions": [a.rag_start, a.rag_start + a.rag_questions], "repeats": a.rag_repeats,
                    "requests": n, "separator": SEP}
            old = data["workloads"].get("rag") or {}
            if {k: old.get(k) for k in same} != same:
                results["rag"] = {}  # another workload: its points are not comparable
            data["workloads"]["rag"] = {**same, "concurrency": sorted(set(old.get("concurrency", [])) |
                                                                      set(a.rag_concurrency))}
            results.setdefault("rag", {})
            for c in a.rag_concurrency:
                for config in a.rag_configs:
                    results["rag"][f"{config} x{c}"] = measure(config, workload, c, tmp, dtype, f"rag-{config}-{c}",
                                                               a.logs)
                    keep()
    data["verdict"] = verdict(results)
    keep()
    plot(results, RESULTS / f"{a.name}.png")
    print("verdict:", data["verdict"])
    return 0


def shown(point: dict) -> str:
    return f"{point['request_throughput']:.2f} req/s, TTFT median {point['median_ttft_ms'] / 1e3:.2f} s"


def verdict(results: dict) -> str:
    """Per workload: `tiered` against the best of SGLang's own configurations (by req/s), then `tiered-native`
    (the store at SGLang's attention); per rag point: blend against prefix."""
    parts = []
    for name in ("gsp", "gsp-multiturn"):
        r = results.get(name, {})
        best = max((c for c in r if c in SGLANG_CONFIGS), key=lambda c: r[c]["request_throughput"], default=None)
        if "tiered" in r and best is not None:
            parts.append(f"{name}: tiered {shown(r['tiered'])} vs SGLang's best {best} {shown(r[best])}")
            if "tiered-native" in r:
                parts[-1] += f"; at SGLang's attention (tiered-native) {shown(r['tiered-native'])}"
    rag = results.get("rag", {})
    for key in sorted({k.split(" x")[1] for k in rag}, key=int):
        b, p = rag.get(f"blend x{key}"), rag.get(f"prefix x{key}")
        if b and p:
            parts.append(f"rag x{key}: blend {b['request_throughput']:.2f} req/s, TTFT median "
                         f"{b['median_ttft_ms'] / 1e3:.2f} s vs prefix {p['request_throughput']:.2f} req/s, "
                         f"{p['median_ttft_ms'] / 1e3:.2f} s")
            alone = rag.get(f"prefix-alone x{key}")
            if alone:
                parts[-1] += (f", prefix one request per prefill {alone['request_throughput']:.2f} req/s, "
                              f"{alone['median_ttft_ms'] / 1e3:.2f} s")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
