"""Replicas sharing one KV store: prefill tokens computed and TTFT with private SSD tiers vs our shared Mooncake
tier vs SGLang's own `--hicache-storage-backend mooncake`, same workload, same master, same run.

    .venv/bin/python benchmarks/shared_store.py [--replicas 2] [--docs 8] [--questions 4] [--doc-tokens 1536]

Workload: `docs` documents of `doc-tokens` tokens, each followed by `questions` different short questions; the
(document, question) requests in a fixed shuffled order, sent by one client round-robin over the replicas (request i
to replica i mod R), one at a time, greedy, one new token (TTFT = client-side latency). Every configuration starts
from empty stores. Configurations (R servers each, started together):
  private          --kv-backend tiered, each replica its own SSD directory (the default)
  shared           the same plus --tiered-remote on one mooncake_master (our shared tier)
  shared-torch-native  the same with SGLang's torch_native CPU attention (what SGLang's own backend runs with), to
                   tell the store's share of a TTFT difference from the prefix-aware attention's
  sglang-mooncake  SGLang's hierarchical cache with its Mooncake L3 backend on the same master
Computed prefill tokens per request = prompt tokens - cached tokens (SGLang's meta_info). After the timed pass every
request is sent again with 8 new tokens to the replica that served it; the answers are compared across
configurations (a wrong page served would change them). Then the per-page latency of the shared tier (Mooncake get
over TCP) is measured against a local SSD page read (page cache dropped for the file), on the shared run's pages.

Writes benchmarks/results/shared_store-<machine class>.json and .png and prints a one-line verdict (target: the
shared tier computes >= 40 % fewer prefill tokens than private tiers with two replicas, median TTFT lower, no
differing answers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (  # noqa: E402
    RESULTS,
    PromptSource,
    auto_dtype,
    evict_from_page_cache,
    hicache_args,
    machine,
    machine_class,
    save,
)

from sglang_tiered.mooncake_master import MooncakeMaster  # noqa: E402
from sglang_tiered.server_process import ServerProcess, cached_details, start_all  # noqa: E402

CONFIGS = ("private", "shared", "shared-torch-native", "sglang-mooncake")
QUESTIONS = ["What is the main argument of the text above?", "Name one example the author gives.",
             "Who is the intended reader?", "What would the author advise a founder?",
             "Summarize the last paragraph in one sentence.", "Which claim is the most surprising?"]


def server_args(config: str, store: Path, master: MooncakeMaster, dtype: str, device_tokens: int) -> list[str]:
    common = ["--max-total-tokens", str(device_tokens), "--dtype", dtype]
    tiered = ["--kv-backend", "tiered", "--tiered-ssd-dir", str(store), "--tiered-stats-interval", "0",
              "--tiered-host-size", "2x", *common]
    if config == "private":
        return tiered
    if config.startswith("shared"):
        attention = ["--tiered-cpu-attention", "torch_native"] if config.endswith("torch-native") else []
        return [*tiered, *master.server_args(), "--tiered-remote-segment", "512M", *attention]
    extra = {"master_server_address": f"127.0.0.1:{master.rpc_port}", "metadata_server": master.metadata_url,
             "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1", "global_segment_size": 512 << 20}
    return [*hicache_args("mooncake", extra, ratio=2), *common]


def run_config(config: str, requests: list[tuple[int, int]], prompts: list[str], replicas: int, work: Path,
               master: MooncakeMaster, dtype: str, device_tokens: int) -> dict:
    servers = [ServerProcess(server_args(config, work / f"{config}-ssd-{i}", master, dtype, device_tokens),
                             log_path=work / f"{config}-{i}.log") for i in range(replicas)]
    print(f"[{config}] starting {replicas} replicas", flush=True)
    start_all(servers)
    rows, answers = [], {}
    try:
        for s in servers:
            s.generate("Warm up.", max_new_tokens=1)
        for i, (doc, q) in enumerate(requests):
            r = servers[i % replicas].generate(prompts[doc * 1000 + q], max_new_tokens=1)
            meta = r["meta_info"]
            cached = int(meta.get("cached_tokens", 0))
            rows.append({"replica": i % replicas, "doc": doc, "question": q, "ttft_s": r["latency_s"],
                         "prompt_tokens": meta["prompt_tokens"], "cached_tokens": cached,
                         "computed_tokens": meta["prompt_tokens"] - cached, "cached": cached_details(r)})
            print(f"[{config}] {i:>3} replica {i % replicas} doc {doc} q {q}: {r['latency_s']:.3f} s, computed "
                  f"{rows[-1]['computed_tokens']:>5}, cached {rows[-1]['cached']}", flush=True)
        for i, (doc, q) in enumerate(requests):
            answers[f"{doc}/{q}"] = servers[i % replicas].generate(prompts[doc * 1000 + q], max_new_tokens=8)["text"]
        stats = [_stats_files(work / f"{config}-ssd-{i}") for i in range(replicas)]
        latency = page_latency(work / f"{config}-ssd-0", master) if config == "shared" else {}
    finally:
        for s in servers:
            s.stop()
    ttft = [r["ttft_s"] for r in rows]
    out = {"requests": rows, "answers": answers, "server_stats": stats, "page_latency": latency,
           "computed_tokens": sum(r["computed_tokens"] for r in rows),
           "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
           "storage_tokens": sum(r["cached"]["storage"] for r in rows),
           "ttft_median_s": statistics.median(ttft), "ttft_p90_s": _quantile(ttft, 0.9),
           "ttft_mean_s": statistics.fmean(ttft)}
    print(f"[{config}] computed {out['computed_tokens']} of {out['prompt_tokens']} prompt tokens, storage tokens "
          f"{out['storage_tokens']}, TTFT median {out['ttft_median_s']:.3f} s p90 {out['ttft_p90_s']:.3f} s",
          flush=True)
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stats_files(ssd: Path) -> list[dict]:
    out = []
    for p in sorted((ssd / "stats").glob("*.json")) if ssd.exists() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return out


def page_latency(ssd: Path, master: MooncakeMaster, limit: int = 64) -> dict:
    """Per-page read latency of the shared run's pages: local SSD file (page cache dropped per file) vs a Mooncake
    get over TCP from the servers' pool, while they run (objects live in the servers' segments)."""
    from sglang_tiered.storage.mooncake_store import MooncakeAddress, MooncakeStore
    from sglang_tiered.storage.page_file import PAGE_SUFFIX, read_header

    files = sorted(ssd.rglob(f"*{PAGE_SUFFIX}"))[:limit]
    if not files:
        return {}
    size = files[0].stat().st_size
    store = MooncakeStore(MooncakeAddress.parse(master.url, master.metadata_url), segment_bytes=64 << 20,
                          object_bytes=size, local_host="127.0.0.1")
    local, remote, found = [], [], 0
    try:
        for f in files:
            evict_from_page_cache(f.parent)
            t0 = time.perf_counter()
            fd = os.open(f, os.O_RDONLY)
            try:
                read_header(fd, os.fstat(fd).st_size)
                os.pread(fd, size, 0)
            finally:
                os.close(fd)
            local.append(time.perf_counter() - t0)
            key = f"sgt/{f.parent.parent.name}/{f.name[: -len(PAGE_SUFFIX)]}"
            t0 = time.perf_counter()
            blob = store.get(key)
            dt = time.perf_counter() - t0
            if blob is not None:
                remote.append(dt)
                found += 1
    finally:
        store.close()
    return {"page_bytes": size, "pages": len(files), "remote_found": found,
            "local_ssd_median_ms": 1000 * statistics.median(local),
            "remote_median_ms": 1000 * statistics.median(remote) if remote else None}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [results[n]["computed_tokens"] for n in names], color="tab:orange")
    axes[0].set_ylabel("prefill tokens computed (all requests)")
    axes[1].bar([n + "\nmedian" for n in names], [results[n]["ttft_median_s"] for n in names], color="tab:blue")
    axes[1].bar([n + "\np90" for n in names], [results[n]["ttft_p90_s"] for n in names], color="tab:cyan")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].tick_params(axis="x", labelsize=7)
    fig.suptitle("Two replicas, shared-prefix workload (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def verdict(results: dict) -> str:
    if "private" not in results or "shared" not in results:
        return "shared_store: needs the private and shared configurations"
    p, s = results["private"], results["shared"]
    fewer = 1 - s["computed_tokens"] / max(1, p["computed_tokens"])
    ttft = s["ttft_median_s"] / p["ttft_median_s"]
    diff = sum(a != p["answers"].get(k) for k, a in s["answers"].items())
    parts = [f"shared_store: shared tier computes {100 * fewer:.0f}% fewer prefill tokens than private tiers "
             f"({s['computed_tokens']} vs {p['computed_tokens']}; target >= 40%: {'PASS' if fewer >= 0.4 else 'MISS'})",
             f"median TTFT {s['ttft_median_s']:.3f} vs {p['ttft_median_s']:.3f} s ({ttft:.2f}x: "
             f"{'PASS' if ttft < 1 else 'MISS'})", f"answers differing from private: {diff} of {len(s['answers'])}"]
    if "sglang-mooncake" in results and "error" not in results["sglang-mooncake"]:
        m = results["sglang-mooncake"]
        mdiff = sum(a != p["answers"].get(k) for k, a in m["answers"].items())
        parts.append(f"SGLang mooncake backend: {m['computed_tokens']} tokens computed, median TTFT "
                     f"{m['ttft_median_s']:.3f} s, {mdiff} answers differing")
    if "shared-torch-native" in results:
        t = results["shared-torch-native"]
        parts.append(f"ours with SGLang's torch_native attention: median TTFT {t['ttft_median_s']:.3f} s")
    elif "sglang-mooncake" in results:
        parts.append(f"SGLang mooncake backend: failed ({results['sglang-mooncake']['error'][:80]})")
    return "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1536)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: what --dtype auto picks on this machine")
    p.add_argument("--workdir", default=None, help="SSD directories and logs (default: a temp dir)")
    a = p.parse_args()
    if not 1 <= a.questions <= len(QUESTIONS):
        p.error(f"--questions: 1 .. {len(QUESTIONS)}")
    dtype = a.dtype or auto_dtype()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="shared-store-"))
    source = PromptSource()
    docs = [source.take(a.doc_tokens) for _ in range(a.docs)]
    prompts = {d * 1000 + q: f"{docs[d]}\n\nQuestion: {QUESTIONS[q]}\nAnswer:" for d in range(a.docs)
               for q in range(a.questions)}
    requests = [(d, q) for d in range(a.docs) for q in range(a.questions)]
    random.Random(0).shuffle(requests)
    device_tokens = 4 * a.doc_tokens  # a replica's device pool holds ~4 documents; its host tier 2x that
    results: dict = {}
    with MooncakeMaster(work / "master.log") as master:
        for config in a.configs:
            try:
                results[config] = run_config(config, requests, prompts, a.replicas, work, master, dtype,
                                             device_tokens)
            except Exception as exc:  # SGLang's backend on a CPU server is not ours to fix: report it
                if config != "sglang-mooncake":
                    raise
                results[config] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"[{config}] failed: {exc}", flush=True)
            if results[config].get("page_latency"):
                print(f"[{config}] per-page latency: {results[config]['page_latency']}", flush=True)
    ok = {k: v for k, v in results.items() if "error" not in v}
    payload = {"machine": machine(), "dtype": dtype, "model": "SmolLM2-135M-Instruct", "replicas": a.replicas,
               "docs": a.docs, "questions": a.questions, "doc_tokens": a.doc_tokens, "device_tokens": device_tokens,
               "results": results, "verdict": verdict(results)}
    name = f"shared_store-{machine_class()}"
    save(name, payload)
    if ok:
        plot(ok, RESULTS / f"{name}.png")
    print(payload["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
