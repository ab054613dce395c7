"""TTFT of cold prefill vs device / host / SSD / SSD-after-restart hits, sglang-tiered vs SGLang's built-in
hierarchical cache with its `file` storage backend, same prompts, same run (protocol: benchmarks/_harness.py).

    .venv/bin/python benchmarks/tier_hits.py [--lengths 512 1024 2048 4096] [--repeats 5]

Writes benchmarks/results/tier_hits-<machine class>.json and .png and prints a one-line verdict. Configurations:
  tiered              --kv-backend tiered (prefix-aware CPU attention, the default)
  tiered-torch-native --kv-backend tiered --tiered-cpu-attention torch_native (isolates the store from attention)
  sglang-file         --enable-hierarchical-cache --hicache-storage-backend file (SGLang's own L3, torch_native)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (  # noqa: E402
    RESULTS,
    PromptSource,
    auto_dtype,
    disk_read_bandwidth,
    hicache_args,
    kv_bytes_per_token,
    machine,
    machine_class,
    plot,
    run_config,
    save,
)

DTYPE = ["bfloat16"]  # set from --dtype in main(): every configuration of a run computes in the same dtype


def tiered(attention: str):
    def args(store: Path, length: int) -> list[str]:
        return ["--kv-backend", "tiered", "--tiered-ssd-dir", str(store), "--tiered-host-size", "3x",
                "--tiered-ssd-capacity", "8G", "--tiered-stats-interval", "0", "--tiered-cpu-attention", attention,
                "--dtype", DTYPE[0]]
    return args


def sglang_file(store: Path, length: int) -> list[str]:
    return [*hicache_args("file", {"file_storage_path": str(store)}, ratio=3), "--dtype", DTYPE[0]]


CONFIGS = {
    "tiered": (tiered("prefix_aware"), "*.kvp"),
    "tiered-torch-native": (tiered("torch_native"), "*.kvp"),
    "sglang-file": (sglang_file, "*.bin"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--workdir", default=None, help="storage directories and server logs (default: a temp dir)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: what --dtype auto picks on this machine")
    a = p.parse_args()
    DTYPE[0] = a.dtype or auto_dtype()
    kv_bytes = kv_bytes_per_token(DTYPE[0])
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tier-hits-"))
    prompts = PromptSource()
    disk = disk_read_bandwidth(work)
    print(f"disk sequential read: {disk['bytes_per_s'] / 1e9:.2f} GB/s (page cache dropped: "
          f"{disk['page_cache_dropped']}); {DTYPE[0]}, KV bytes per token: {kv_bytes}", flush=True)
    results = {}
    for name in a.configs:
        make_args, pattern = CONFIGS[name]
        results[name] = run_config(name, make_args, a.lengths, a.repeats, work, prompts,
                                   stored=lambda store, pat=pattern: sum(1 for _ in store.rglob(pat)))
    name = f"tier_hits-{machine_class()}"
    payload = {"machine": machine(), "disk": disk, "dtype": DTYPE[0], "kv_bytes_per_token": kv_bytes,
               "repeats": a.repeats, "model": "SmolLM2-135M-Instruct", "results": results,
               "verdict": verdict(results, disk, kv_bytes)}
    save(name, payload)
    plot(results, RESULTS / f"{name}.png", "TTFT by cache tier (median), SmolLM2-135M, CPU")
    print(payload["verdict"])
    return 0


def verdict(results: dict, disk: dict, kv_bytes: int) -> str:
    key = "2048" if "2048" in results.get("tiered", {}) else next(iter(results.get("tiered", {"": 0})))
    if "tiered" not in results:
        return "tier_hits: no 'tiered' configuration was run"
    ours = results["tiered"][key]
    ratio = ours["ssd"]["median_s"] / ours["cold"]["median_s"]
    io_floor = int(key) * kv_bytes / disk["bytes_per_s"]
    parts = [f"tier_hits @{key} tokens: SSD hit {ours['ssd']['median_s']:.3f} s = {ratio:.2f}x cold "
             f"{ours['cold']['median_s']:.3f} s (target <= 0.25x: {'PASS' if ratio <= 0.25 else 'MISS'}); "
             f"disk read floor {io_floor * 1000:.0f} ms"]
    if "sglang-file" in results:
        theirs = results["sglang-file"][key]["ssd"]["median_s"]
        ok = ours["ssd"]["median_s"] <= theirs
        parts.append(f"vs SGLang file backend hit {theirs:.3f} s ({'PASS' if ok else 'MISS'})")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
