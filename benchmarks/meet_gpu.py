"""Compute-or-load on a GPU, component level (issue #26, item 4): the two-sided loader of engine/meet.py on a CUDA
model -- the span's front computed on the current stream while its back is copied from pinned host memory on a
stream of its own -- against loading everything and computing everything, at 7B-like shapes with random weights.

Per model (`--models`: `7b-mha`, Llama-2-7B's shape; `8b-gqa`, Llama-3-8B's with 8 KV heads; `tiny`, for a smoke
run on the CPU) and stored span (`--lengths` tokens, whole pages of `--page-size`) plus 32 new tokens:
  * `compute`: every page of the span computed from its token ids (chunks of 4 pages), the reference;
  * `load`: every page copied host -> device (its KV is the `compute` run's, kept in pinned host memory page by
    page, as a host tier would hold it);
  * `meet`: both at once, meeting where they meet (Cake's scheme: no estimates);
  * `meet-rule`: the same with the claim rule the server uses, fed this run's own per-page compute and copy times.
Time to the new tokens' last hidden state (the span's KV on the device and the new tokens' layers run), CUDA
synchronised, median of `--repeats` after a warm-up. Exactness: each configuration's greedy next token against
`compute`'s, and the largest difference of its last hidden state (bf16: rounding-level).

    .venv/bin/python benchmarks/meet_gpu.py [--models 7b-mha 8b-gqa] [--lengths 4096 8192 16384 32768]
    .venv/bin/python benchmarks/meet_gpu.py --device cpu --models tiny --lengths 256 512   # a smoke run

Writes benchmarks/results/meet_gpu.json and .png and prints one verdict line: meet's time against the better of
load and compute at every point.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, machine, save  # noqa: E402

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
CHUNK = 4  # pages compute takes at once (policy/kvpr.py's MEET_CHUNK_PAGES)


class HostPages:
    """A stored span in host memory, page-major [pages, layers, page_size, 2, H, D] (pinned on a CUDA machine, so
    that each page's copy is one asynchronous transfer): `read` returns a page's view, no copy."""

    def __init__(self, kv: torch.Tensor, page_size: int) -> None:
        layers, tokens = kv.shape[0], kv.shape[1]
        self.pages, self.page_size = tokens // page_size, page_size
        paged = kv.view(layers, self.pages, page_size, *kv.shape[2:]).transpose(0, 1)
        self.host = torch.empty(paged.shape, dtype=kv.dtype, pin_memory=kv.is_cuda)
        self.host.copy_(paged)

    def read(self, page: int) -> StoredPage:
        return StoredPage(kv=self.host[page])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, *args) -> tuple[float, MeetResult]:
    sync(device)
    t0 = time.perf_counter()
    res = fn(*args)
    sync(device)
    return time.perf_counter() - t0, res


def run_point(model: LlamaModel, tokens: int, page_size: int, repeats: int) -> dict:
    device = model.device
    pages = tokens // page_size
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.cfg.vocab, (pages * page_size + NEW,), generator=g)
    span_ids, new_ids = ids[: pages * page_size], ids[pages * page_size :]

    def compute():
        return meet_prefill(model, span_ids, new_ids, prefix_len=0, source=_Unread(pages, page_size), chunk=CHUNK,
                            split=pages)

    _, reference = timed(device, compute)  # warm-up, and the stored copy
    stored = HostPages(reference.kv[:, : pages * page_size], page_size)
    reference_token = int(model.logits(reference.hidden[None])[0].argmax())
    times: dict[str, list[float]] = {"compute": [], "load": [], "meet": [], "meet-rule": []}
    results: dict[str, MeetResult] = {}
    per_page: dict[str, float] = {}

    def run(config: str) -> MeetResult:
        if config == "compute":
            return compute()
        if config == "load":
            return meet_prefill(model, span_ids, new_ids, prefix_len=0, source=stored, chunk=CHUNK, split=0)
        if config == "meet":
            return meet_prefill(model, span_ids, new_ids, prefix_len=0, source=stored, chunk=CHUNK)
        return meet_prefill(model, span_ids, new_ids, prefix_len=0, source=stored, chunk=CHUNK,
                            page_compute_s=per_page["compute"], page_read_s=per_page["load"], min_read_share=0.25)

    for config in times:  # warm-up of each path (and the per-page times the rule is fed)
        seconds, _ = timed(device, run, config)
        if config in ("compute", "load"):
            per_page[config] = seconds / pages
    for _ in range(repeats):
        for config in times:
            seconds, results[config] = timed(device, run, config)
            times[config].append(seconds)
    out: dict = {"pages": pages, "kv_bytes": stored.host.numel() * stored.host.element_size()}
    for config, ts in times.items():
        res = results[config]
        token = int(model.logits(res.hidden[None])[0].argmax())
        out[config] = {"s": statistics.median(ts), "runs": ts, "computed_pages": res.computed_pages,
                       "loaded_pages": res.loaded_pages, "same_token": token == reference_token,
                       "max_hidden_diff": float((res.hidden.float() - reference.hidden.float()).abs().max())}
    return out


class _Unread:
    """The source of a span computed whole (none of its pages is read)."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.pages, self.page_size = pages, page_size

    def read(self, page: int) -> StoredPage:
        raise AssertionError("compute-only reads no page")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    for ax, (name, points) in zip(axes[0], results.items()):
        lengths = sorted(int(n) for n in points)
        for config, style in (("compute", "^--"), ("load", "s--"), ("meet", "o-"), ("meet-rule", "x:")):
            ax.plot(lengths, [points[str(n)][config]["s"] for n in lengths], style, label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("stored span (tokens)")
        ax.set_ylabel("time to the prefix KV + 32 new tokens (s)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["7b-mha", "8b-gqa"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--name", default="meet_gpu")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("meet_gpu: no CUDA device here (run it where a GPU is lent, or --device cpu --models tiny for a smoke "
              "run)", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    results: dict = {}
    with torch.inference_mode():
        for name in a.models:
            model = LlamaModel.random(MODELS[name], seed=0, dtype=dtype, device=device)
            results[name] = {}
            for n in a.lengths:
                point = run_point(model, n, a.page_size, a.repeats)
                results[name][str(n)] = point
                print(f"[meet_gpu] {name} {n} tokens: " + ", ".join(
                    f"{c} {point[c]['s']:.3f}s" for c in ("compute", "load", "meet", "meet-rule")) +
                    f"; meet computed {point['meet']['computed_pages']} of {point['pages']} pages", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ratios = [(f"{m}/{n}", p["meet"]["s"] / min(p["load"]["s"], p["compute"]["s"]))
              for m, pts in results.items() for n, p in pts.items()]
    exact = all(p[c]["same_token"] for pts in results.values() for p in pts.values() for c in ("load", "meet",
                                                                                                "meet-rule"))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    verdict = (f"on {device_name}, {a.dtype}: meet / min(load, compute) " +
               ", ".join(f"{w} {r:.2f}x" for w, r in ratios) +
               f"; greedy next token as compute's at every point: {'yes' if exact else 'NO'}")
    save(a.name, {"machine": machine(), "device": device_name, "dtype": a.dtype, "page_size": a.page_size,
                  "models": {m: MODELS[m].__dict__ for m in a.models}, "repeats": a.repeats, "results": results,
                  "verdict": verdict})
    plot(results, RESULTS / f"{a.name}.png")
    print("verdict:", verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
