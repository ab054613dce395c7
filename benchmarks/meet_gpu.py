"""Compute-or-load on a GPU, component level: the two-sided loader of engine/meet.py on a CUDA
model -- the span's front computed on the current stream while its back is copied to the device on a stream of its
own -- against loading everything and computing everything, at 7B-like shapes with random weights.

Per model (`--models`: `7b-mha`, Llama-2-7B's shape; `8b-gqa`, Llama-3-8B's with 8 KV heads; `tiny`, for a smoke
run on the CPU) and stored span (`--lengths` tokens, whole pages of `--page-size`) plus 32 new tokens:
  * `compute`: every page of the span computed from its token ids, `--chunk` pages at a time (meet's own compute);
  * `compute-full`: the whole prompt in one forward (`LlamaModel.prefill`): the fastest compute-only this engine has;
  * `load`: every page read and copied to the device (its KV is `compute`'s);
  * `meet`: both at once, meeting where they meet (Cake's scheme: no estimates);
  * `meet-rule`: the same with the claim rule the server uses, fed this point's own per-page compute and read times
    (from the warm-up runs: compute's seconds on the span's pages and the loader's wall seconds, each per page; the
    new tokens' layers left out, as a server's profile of reads and compute leaves them out);
  * `compute-wide`, `meet-wide`: `compute` and `meet-rule` with no cap on a claim (compute's first claim is then as
    large as the rule says: the whole span for `compute-wide`), against chunking's cost on a GPU;
  * `meet-floor`: `meet-wide` with the rule told the least time a chunk takes (`chunk_floor_s`: the least of three
    one-page chunks' times, where the host launching a chunk's kernels is the cost, not its pages).
Where the stored pages are read from (`--source`): `host`, pinned host memory page by page, as a host tier holds
them (one asynchronous transfer per page); `disk`, one file per page under `--disk-dir` (an SSD tier's layout), the
files evicted from the page cache before every run and each page read into a pinned buffer, then copied.
Time to the new tokens' last hidden state (the span's KV on the device and the new tokens' layers run), CUDA
synchronised, median of `--repeats` after a warm-up of each configuration. Exactness: each configuration's greedy
next token against `compute`'s, and the largest difference of its logits (bf16: rounding-level).

    python benchmarks/meet_gpu.py [--models 7b-mha 8b-gqa] [--lengths 4096 8192 16384 32768] [--source host]
    .venv/bin/python benchmarks/meet_gpu.py --device cpu --models tiny --lengths 256 512   # a smoke run

Needs torch and this package on the path, not SGLang. Writes benchmarks/results/<--name>.json (after every point)
and .png, and prints one verdict line: meet's time against the better of load and compute at every point.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, evict_from_page_cache, machine, save  # noqa: E402

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel  # noqa: E402
from sglang_tiered.engine.meet import MeetResult, StoredPage, meet_prefill  # noqa: E402

MODELS = {
    "7b-mha": LlamaConfig(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                          vocab=32000),
    "8b-gqa": LlamaConfig(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                          vocab=32000),
    "tiny": LlamaConfig(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000),
}
NEW = 32
CONFIGS = ("compute", "compute-full", "load", "meet", "meet-rule", "compute-wide", "meet-wide", "meet-floor")


class HostPages:
    """A stored span in host memory, page-major [pages, layers, page_size, 2, H, D] (pinned on a CUDA machine, so
    that each page's copy is one asynchronous transfer): `read` returns a page's view, no copy."""

    def __init__(self, kv: torch.Tensor, page_size: int) -> None:
        layers, tokens = kv.shape[0], kv.shape[1]
        self.pages, self.page_size = tokens // page_size, page_size
        paged = kv.view(layers, self.pages, page_size, *kv.shape[2:]).transpose(0, 1)
        self.host = torch.empty(paged.shape, dtype=kv.dtype, pin_memory=kv.is_cuda)
        for page in range(self.pages):  # (page by page: a whole-span copy would stage the span on the device)
            self.host[page].copy_(paged[page])
        self.bytes = self.host.numel() * self.host.element_size()

    def evict(self) -> None:
        pass

    def read(self, page: int) -> StoredPage:
        return StoredPage(kv=self.host[page])

    def close(self) -> None:
        pass


class DiskPages:
    """A stored span as one file per page under `directory`, read into one pinned buffer. The buffer is reused: the
    loader of engine/meet.py waits for each page's copy to the device before it reads the next page."""

    def __init__(self, kv: torch.Tensor, page_size: int, directory: Path) -> None:
        layers, tokens = kv.shape[0], kv.shape[1]
        self.pages, self.page_size, self.directory = tokens // page_size, page_size, directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        paged = kv.view(layers, self.pages, page_size, *kv.shape[2:]).transpose(0, 1)
        for page in range(self.pages):
            data = paged[page].contiguous().cpu()
            with open(self._path(page), "wb") as f:
                f.write(data.view(torch.uint8).reshape(-1).numpy().tobytes())
        self.buffer = torch.empty(paged.shape[1:], dtype=kv.dtype, pin_memory=kv.is_cuda)
        self.bytes = self.pages * self.buffer.numel() * self.buffer.element_size()

    def _path(self, page: int) -> Path:
        return self.directory / f"{page:06d}.kv"

    def evict(self) -> None:
        """Drop the page files from the page cache: the next reads reach the disk."""
        evict_from_page_cache(self.directory)

    def read(self, page: int) -> StoredPage:
        view = memoryview(self.buffer.view(torch.uint8).reshape(-1).numpy())
        with open(self._path(page), "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(f"{self._path(page)}: short read ({done} of {len(view)} bytes)")
                done += got
        return StoredPage(kv=self.buffer)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def best(point: dict, configs: tuple[str, ...]) -> float:
    """The least seconds among `configs` of a point (those it measured)."""
    return min(point[c]["s"] for c in configs if "s" in point.get(c, {}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_point(model: LlamaModel, tokens: int, a: argparse.Namespace) -> dict:
    device, ps = model.device, a.page_size
    pages = tokens // ps
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.cfg.vocab, (pages * ps + NEW,), generator=g)
    span_ids, new_ids = ids[: pages * ps], ids[pages * ps :]
    chunk = a.chunk or (16 if device.type == "cuda" else 4)

    def meet(source, wide: bool = False, **kw) -> MeetResult:
        return meet_prefill(model, span_ids, new_ids, prefix_len=0, source=source, chunk=pages if wide else chunk,
                            **kw)

    reference = meet(_Unread(pages, ps), split=pages)  # the stored copy (and compute's warm-up)
    reference_logits = model.logits(reference.hidden[None])[0]
    source = (HostPages(reference.kv[:, : pages * ps], ps) if a.source == "host"
              else DiskPages(reference.kv[:, : pages * ps], ps, Path(a.disk_dir)))
    del reference
    one_page = [meet_prefill(model, span_ids[:ps], new_ids, prefix_len=0, source=_Unread(1, ps), split=1).chunks[0][2]
                for _ in range(3)]  # (the first call of new shapes can take 0.1-0.8 s: measured on an H200)
    per_page: dict[str, float] = {"floor": min(one_page)}  # a chunk's least time: one page's

    def run(config: str) -> tuple[torch.Tensor, dict]:
        """One timed run: (the next token's logits, what it did)."""
        source.evict()
        sync(device)
        t0 = time.perf_counter()
        if config == "compute-full":
            out = model.prefill(ids)
            sync(device)
            return out.logits, {"s": time.perf_counter() - t0}
        wide = config in ("compute-wide", "meet-wide", "meet-floor")  # (no cap on a claim)
        if config in ("compute", "compute-wide"):
            res = meet(_Unread(pages, ps), wide, split=pages)
        elif config == "load":
            res = meet(source, split=0)
        elif config == "meet":
            res = meet(source)
        else:
            res = meet(source, wide, page_compute_s=per_page["compute"],
                       page_read_s=per_page["load"],
                       chunk_floor_s=per_page["floor"] if config == "meet-floor" else 0.0)
        sync(device)
        seconds = time.perf_counter() - t0
        return model.logits(res.hidden[None])[0], {"s": seconds, "computed_pages": res.computed_pages,
                                                   "loaded_pages": res.loaded_pages, "load_s": res.load_s,
                                                   "span_s": res.compute_s if config == "compute" else res.load_s,
                                                   "compute_s": res.compute_s, "new_s": res.new_s,
                                                   "first_reads_s": list(res.reads[:4]),
                                                   "chunks": [list(c) for c in res.chunks]}

    out: dict = {"pages": pages, "chunk_pages": chunk, "source": a.source, "kv_bytes": source.bytes}
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    logits: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}
    try:
        for rnd in range(a.repeats + 1):  # round 0: the warm-ups (and the per-page times the rule is fed)
            for config in CONFIGS:
                if config in failed:
                    continue
                try:
                    logits[config], row = run(config)
                except RuntimeError as exc:  # (out of memory, a kernel this device lacks): recorded, the rest goes on
                    failed[config] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                if rnd == 0:  # the rule's inputs: the engine's own times on the span, as a server profiles them
                    if config in ("compute", "load"):  # (not the whole run's: that has the new tokens' layers)
                        per_page[config] = row["span_s"] / pages
                else:
                    runs[config].append(row)
        if a.profile:  # where compute's time goes: one forward, chunks of `chunk` pages, one claim of the span
            try:
                out["profile"] = profiled({"compute-full": lambda: model.prefill(ids),
                                           "compute": lambda: meet(_Unread(pages, ps), split=pages),
                                           "compute-wide": lambda: meet(_Unread(pages, ps), True, split=pages)},
                                          device)
            except RuntimeError as exc:  # (a profiler this machine lacks): recorded, the point stands
                out["profile"] = f"== profiler failed: {type(exc).__name__}: {exc}"
            print("\n".join(line for line in out["profile"].splitlines() if line.startswith("==")), flush=True)
    finally:
        source.close()
    reference_token = int(reference_logits.argmax())
    for config in CONFIGS:
        if config in failed:
            out[config] = {"error": failed[config]}
            continue
        rows = runs[config]
        out[config] = {"s": statistics.median(r["s"] for r in rows), "runs": [r["s"] for r in rows],
                       "computed_pages": [r.get("computed_pages") for r in rows],
                       "loaded_pages": [r.get("loaded_pages") for r in rows],
                       "first_reads_s": [r.get("first_reads_s") for r in rows],
                       "chunks": [r.get("chunks") for r in rows],  # compute's claims: [seconds in, pages, seconds]
                       "new_s": [r.get("new_s") for r in rows],  # the new tokens' layers after the meet
                       "compute_s": [r.get("compute_s") for r in rows],
                       "same_token": int(logits[config].argmax()) == reference_token,
                       "max_logit_diff": float((logits[config] - reference_logits).abs().max())}
    out["per_page_s"] = per_page
    return out


class _Unread:
    """The source of a span computed whole (none of its pages is read)."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.pages, self.page_size = pages, page_size

    def read(self, page: int) -> StoredPage:
        raise AssertionError("compute-only reads no page")


def profiled(calls: dict, device: torch.device) -> str:
    """torch.profiler of one call of each of `calls` {name: fn}: wall seconds, device (kernel) seconds, kernels
    launched and host seconds in launches, then the top device-time rows: where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for name, fn in calls.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            wall = time.perf_counter() - t0
        rows = prof.key_averages()
        kernel_s = sum(e.self_device_time_total for e in rows) / 1e6
        launches = [e for e in rows if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")]
        ops = sum(e.count for e in rows if e.key.startswith("aten::"))
        out.append(f"== {name}: wall {wall * 1e3:.1f} ms, device {kernel_s * 1e3:.1f} ms, "
                   f"{sum(e.count for e in launches)} launches ({sum(e.cpu_time_total for e in launches) / 1e3:.1f} ms "
                   f"of host time), {ops} aten calls")
        out.append(rows.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    for ax, (name, points) in zip(axes[0], results.items()):
        lengths = sorted(int(n) for n in points)
        for config, style in zip(CONFIGS, ("^--", "v--", "s--", "o-", "x:", "^:", "d-", "*-")):
            xs = [n for n in lengths if "s" in points[str(n)][config]]
            ax.plot(xs, [points[str(n)][config]["s"] for n in xs], style, label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("stored span (tokens)")
        ax.set_ylabel(f"time to the prefix KV + {NEW} new tokens (s)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["7b-mha", "8b-gqa"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=0, help="pages compute takes at once (0: 16 on CUDA, 4 on a CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--source", choices=["host", "disk"], default="host")
    ap.add_argument("--disk-dir", default="/tmp/meet-gpu-pages")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--name", default="meet_gpu")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="Python's thread switch interval for this run, seconds (0: the default, 0.005)")
    ap.add_argument("--profile", action="store_true", help="also profile compute's configurations at every point")
    ap.add_argument("--merge", action="store_true", help="keep the other models' results already in --name's JSON")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("meet_gpu: no CUDA device here (run it where a GPU is lent, or --device cpu --models tiny for a smoke "
              "run)", file=sys.stderr)
        return 2
    if a.switch_interval:  # (how long the loader thread may wait for the GIL while compute launches kernels)
        sys.setswitchinterval(a.switch_interval)
    dtype = getattr(torch, a.dtype)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict = {}
    previous = RESULTS / f"{a.name}.json"
    if a.merge and previous.exists():
        results.update({m: r for m, r in json.loads(previous.read_text())["results"].items() if m not in a.models})
    payload = {"machine": machine(), "device": device_name, "dtype": a.dtype, "page_size": a.page_size,
               "source": a.source, "models": {m: MODELS[m].__dict__ for m in results.keys() | set(a.models)},
               "repeats": a.repeats, "switch_interval_s": sys.getswitchinterval(), "results": results}
    started = time.perf_counter()
    with torch.inference_mode():
        for name in a.models:
            model = LlamaModel.random(MODELS[name], seed=0, dtype=dtype, device=device)
            results[name] = {}
            for n in a.lengths:
                point = run_point(model, n, a)
                results[name][str(n)] = point
                save(a.name, payload)  # after every point: a run cut short keeps what it measured
                print(f"[meet_gpu {time.perf_counter() - started:.0f}s] {name} {n} tokens ({a.source}): " + ", ".join(
                    f"{c} {point[c]['s']:.3f}s" if "s" in point[c] else f"{c} {point[c]['error']}"
                    for c in CONFIGS) + f"; meet computed {point['meet'].get('computed_pages')} of {point['pages']} "
                    "pages", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    compute_load = ("compute", "compute-full", "compute-wide", "load")
    ratios = [(f"{m}/{n}", *(p[c]["s"] / best(p, compute_load) if "s" in p.get(c, {}) else float("nan")
                             for c in ("meet", "meet-rule", "meet-wide", "meet-floor")))
              for m, pts in results.items() for n, p in pts.items()]
    exact = all(p[c].get("same_token", True) for pts in results.values() for p in pts.values() for c in CONFIGS)
    verdict = (f"on {device_name}, {a.dtype}, pages from {a.source}: meet | meet-rule | meet-wide | meet-floor / "
               "min(load, compute, compute-full, compute-wide) " + ", ".join(
                   f"{w} {r:.2f}x | {q:.2f}x | {z:.2f}x | {f:.2f}x" for w, r, q, z, f in ratios) +
               f"; greedy next token as compute's everywhere: {'yes' if exact else 'NO'}")
    payload["verdict"] = verdict
    save(a.name, payload)
    plot(results, RESULTS / f"{a.name}.png")
    print("verdict:", verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
