"""Gated sparse loading (IMPRESS) through the server (CPU, the embedded SmolLM2).

Part `placement` (where a Zipf workload's KV is served from): a shared-document workload whose KV does not fit in
device + host memory. `--docs` documents of `--doc-tokens` tokens (cycling through the lengths given; device pool =
the longest + 2048 tokens, host 2x, `--chunked-prefill-size 8192` so that every prompt is one extend), each request
one document + a new question (Zipf popularity, s = 1.1, the same seeded sequence for every configuration), sent by
`--clients` concurrent clients. Configurations: the defaults (SGLang's LRU eviction and load, with compute-or-load) ->
+ gated sparse loading (`--tiered-importance-load gated`); SGLang's own hierarchical cache with its `file` storage
backend (`sglang-file`, its torch_native CPU attention: compare its tokens by tier, not its TTFT); and gated loading
with the opt-in mass gate (`--tiered-importance-gate mass`, ratio 0.3, bound 0.2). Each at the disk's own speed and
with the server's block-device reads throttled to `--slow-mbps` MB/s (`shared/tools/slow-disk`, a kernel I/O throttle;
the SSD files are evicted from the page cache before every request so that SSD hits really read the device). Reported:
TTFT median and p90, bytes the server read from storage, sparse loads and their read amplification, tokens served from
device / host / SSD (a sparse load's span counts as SSD: SGLang reports it as not cached) / computed.

    .venv/bin/python benchmarks/importance.py [--parts placement] [--requests 60] [--slow-mbps 100]

Part `sparse`: gated sparse loading. `--sparse-docs` documents of `--sparse-tokens` tokens, each with a planted fact
("The access code for the archive room is NNNN."), first asked a different question (the prefill that gets the pages
repacked; then 4 gated loads of that question give the server's gate history its steady state), then -- device and
host flushed, page cache dropped -- asked for the code three ways on the same `--tiered-importance-load gated` server:
SGLang's full load (`off`), the sparse path loading everything (`full`) and the gated load; and the gated load on one
more server per `--alphas` value (`--tiered-importance-alpha`: the gate's trade of bytes against agreement) and per
`--sparse-ratios` value (`--tiered-importance-ratio`), and one with the mass gate (`--tiered-importance-gate mass`) at
the last `--mass-ratios` value per `--sparse-max-drops` bound. The SSD tier's files are evicted from the page cache
before each request (only those: `posix_fadvise`). TTFT (the first streamed token, client side), bytes the server read
from storage (/proc/<pid>/io: what reached the block device, readahead included), whether the answer holds the code,
and agreement with the full load: the answer (the first sentence of the 8-token greedy continuation, see `answer`) and
all 8 tokens; natively, at `--slow-mbps`, and at `--slow-mbps` with at most `--slow-iops` read I/Os per second
(`benchmarks/iops-limit`, the kernel's blkio IOPS throttle: network block storage limits both; a gp3-class volume
gives 125 MB/s and 3000 IOPS), where a sparse load's many short reads may cost more than their bytes.

Part `quality`: the same kind of documents (its own: the first `--quality-docs` of the essay stream, whichever
other parts run) through the engine alone (fp32): the code question after a full prefill vs gated sparse loads at
`--ratios`, by 16-token chunks of consecutive tokens (as the server loads a repacked group) and by single tokens,
and at the default ratio by chunks with each `--alphas` gate exponent; the mass gate (`--tiered-importance-gate
mass`) at each `--mass-ratios` with each `--max-drops` bound; the probe quantized as stored (4 bits,
rotated), and for comparison the 8-bit probe of the first group format at the default and the lowest ratio; accuracy,
agreement with the full load (answer, all 8 tokens, first token), first-token KL(full || gated), fraction loaded,
gate pass rate.

Writes benchmarks/results/importance-<machine class>.json (parts not run keep their last results on that class) and
.png, prints one verdict line per part.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (  # noqa: E402
    RESULTS,
    SLOW_DISK,
    PromptSource,
    auto_dtype,
    evict_from_page_cache,
    hicache_args,
    machine,
    machine_class,
    save,
    server_read_bytes,
    stream_generate,
)

from sglang_tiered.config import TieredConfig  # noqa: E402
from sglang_tiered.integration.sparse import LOG_PATTERN as SPARSE_LOAD_LINE  # noqa: E402
from sglang_tiered.server_process import ServerProcess, cached_details, metric_total  # noqa: E402


def zipf_sequence(docs: int, requests: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** s for i in range(docs)]
    return rng.choices(range(docs), weights, k=requests)


def run_workload(server: ServerProcess, prompts: list[str], docs: list[int], clients: int, store: Path) -> list[dict]:
    """Send `prompts` in order from `clients` threads (greedy, one new token), evicting the SSD tier's files (`store`)
    from the page cache before each request; one row per request: its document, TTFT and where its cached tokens came
    from."""
    rows: list[dict] = []
    lock = threading.Lock()
    jobs = iter(range(len(prompts)))

    def client() -> None:
        while True:
            with lock:
                i = next(jobs, None)
                if i is not None:
                    evict_from_page_cache(store)
            if i is None:
                return
            r = server.generate(prompts[i], max_new_tokens=1)
            with lock:
                rows.append({"doc": docs[i], "ttft_s": r["latency_s"], **cached_details(r),
                             "prompt": r["meta_info"]["prompt_tokens"], "rid": r["meta_info"].get("id")})

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def ssd_hits(rows: list[dict]) -> dict:
    """The requests of a workload run that took some of their prefix from the SSD tier (a sparse load's span
    counts): how many, and their median TTFT -- what the issue's slow-storage targets are stated for."""
    ttft = [r["ttft_s"] for r in rows if r["storage"] > 0]
    return {"requests": len(ttft), "median_s": statistics.median(ttft) if ttft else None}


PARTS = ("placement", "sparse", "quality")
GATED = ["--tiered-importance-load", "gated"]
# the defaults (LRU eviction, SGLang's load with compute-or-load) -> + gated sparse loading; then SGLang's own
ABLATION: dict[str, list[str]] = {
    "lru": [],
    "lru + gated": GATED,
    "sglang-file": [],
    # the opt-in mass gate at the setting that met the per-request targets in part sparse
    "lru + gated (mass gate)": [*GATED, "--tiered-importance-gate", "mass", "--tiered-importance-ratio", "0.3",
                                "--tiered-importance-max-drop", "0.2"],
}
CHAIN = ["lru", "lru + gated"]


# every prompt in one extend (SGLang's CPU default, 4096, would prefill the longest in pieces, which gated loading
# leaves to SGLang's own load): the same for every configuration
CHUNKED_PREFILL = 8192


def device_tokens(doc_tokens: list[int]) -> int:
    """The placement servers' device pool: the longest document and 2048 tokens more."""
    return max(doc_tokens) + 2048


def placement_args(config: str, store: str, dtype: str, device: int) -> list[str]:
    common = ["--max-total-tokens", str(device), "--dtype", dtype, "--chunked-prefill-size", str(CHUNKED_PREFILL),
              "--enable-metrics"]
    if config == "sglang-file":  # SGLang's own L3 (its torch_native CPU attention: compare its SSD tokens, not TTFT)
        return [*common, *hicache_args("file", {"file_storage_path": store}, ratio=2)]
    return [*common, "--kv-backend", "tiered", "--tiered-host-size", "2x", "--tiered-ssd-dir", store,
            "--tiered-stats-interval", "0", *ABLATION[config]]


def count_sparse_loads(rows: list[dict], lines: list[str]) -> dict:
    """Match a server's sparse-load log lines to the workload's rows by request id: SGLang reports a sparsely loaded
    span as not cached, so its `stored` tokens are added to the row's `storage` (they came from the SSD tier,
    sparsely; the row is marked `sparse`). Returns how many loads, their tokens, what they read (MiB) and their
    median read amplification (bytes read / bytes of the K and V used)."""
    loads = {}
    for line in lines:
        m = SPARSE_LOAD_LINE.search(line)
        if m:
            loads[m.group(1)] = (int(m.group(2)), float(m.group(3)), float(m.group(4)))
    for r in rows:
        if r.get("rid") in loads:
            r["storage"] += loads[r["rid"]][0]
            r["sparse"] = True
    amp = [a for _, _, a in loads.values()]
    return {"requests": len(loads), "tokens": sum(s for s, _, _ in loads.values()),
            "read_mib": sum(m for _, m, _ in loads.values()),
            "read_amplification": statistics.median(amp) if amp else None}


def unfulfilled_prefetch(metrics: str) -> dict[str, int]:
    """SGLang's count of L3 hit tokens its prefetch did not deliver to the request, by reason (nonzero ones):
    `cache_admission_shortfall` = loaded into host memory but evicted again before the request was admitted,
    `host_capacity` = no host memory for the whole hit, `deadline` = the prefetch timed out."""
    out: dict[str, int] = {}
    for m in re.finditer(r'^sglang:storage_prefetch_unfulfilled_tokens_total\{[^}]*reason="([a-z_]+)"[^}]*\} '
                         r"([0-9.e+]+)$", metrics, re.M):
        if float(m.group(2)):
            out[m.group(1)] = out.get(m.group(1), 0) + int(float(m.group(2)))
    return out


IOPS_LIMIT = Path(__file__).parent / "iops-limit"


def disks(tmp: str, slow_mbps: int, slow_iops: int) -> dict[str, list[str]]:
    """Disk label -> the wrapper that runs a server on it: the disk's own speed, reads throttled to `slow_mbps`, and
    (`slow_iops` > 0) to `slow_mbps` and `slow_iops` read I/Os per second as well."""
    slow = [str(SLOW_DISK), "--dir", tmp, str(slow_mbps), "--"]
    out = {"native": [], f"{slow_mbps} MB/s": slow}
    if slow_iops:
        out[f"{slow_mbps} MB/s, {slow_iops} IOPS"] = [*slow, str(IOPS_LIMIT), str(slow_iops), tmp, "--"]
    return out


def placement(source: PromptSource, dtype: str, docs: int, doc_tokens: list[int], requests: int, clients: int,
              slow_mbps: int) -> dict:
    texts = [source.take(doc_tokens[i % len(doc_tokens)]) for i in range(docs)]
    order = zipf_sequence(docs, requests, 1.1, seed=0)
    questions = [f"\n\nQuestion {i}: what is the main point of the text above?" for i in range(requests)]
    out: dict = {}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:  # on the disk, not tmpfs: slow-disk throttles it
        for disk, wrapper in disks(tmp, slow_mbps, slow_iops=0).items():
            runs = {}
            for config in ABLATION:
                name = f"{config}, disk {disk}"
                store = Path(f"{tmp}/{len(out)}")
                args = placement_args(config, str(store), dtype, device_tokens(doc_tokens))
                with ServerProcess(args, log_path=Path(tmp) / f"{len(out)}.log", wrapper=wrapper) as s:
                    s.generate(source.take(64), max_new_tokens=1)
                    before = server_read_bytes(s)
                    rows = run_workload(s, [texts[d] + q for d, q in zip(order, questions)], order, clients, store)
                    read_mib = (server_read_bytes(s) - before) / 2**20
                    sparse_loads = count_sparse_loads(rows, s.log_lines("tiered sparse: rid"))
                    metrics = s.get("/metrics")
                    lost = unfulfilled_prefetch(metrics)
                    repack = {name: int(metric_total(metrics, f"sglang_tiered:ssd_{name}_total"))
                              for name in ("repacked_pages", "repack_pages_kept", "repack_pages_read")}
                    repack["read_mib"] = metric_total(metrics, "sglang_tiered:ssd_repack_read_bytes_total") / 2**20
                ttft = sorted(r["ttft_s"] for r in rows)
                tiers = {k: sum(r[k] for r in rows) for k in ("device", "host", "storage")}
                tiers["computed"] = sum(r["prompt"] for r in rows) - sum(tiers.values())
                out[name] = {"median_s": statistics.median(ttft), "p90_s": ttft[int(0.9 * (len(ttft) - 1))],
                             "ssd_hits": ssd_hits(rows), "tokens": tiers, "read_mib": read_mib, "sparse": sparse_loads,
                             "prefetch_unfulfilled": lost, "repack": repack, "rows": rows}
                runs[config] = (name, store, rows)
                print(f"[placement] {name}: median {out[name]['median_s']:.3f} s, p90 {out[name]['p90_s']:.3f} s, "
                      f"tokens {tiers}, {read_mib:.1f} MiB read, sparse loads {sparse_loads}, SGLang's L3 prefetch "
                      f"tokens not used, by reason {lost}, repack {repack}", flush=True)
    return out


FACT = "The access code for the archive room is {code}. "


def answer(text: str) -> str:
    """The answer in a greedy continuation (special tokens already removed): its first sentence -- up to the first
    full stop or line break -- stripped. The question ends "The access code is", so the sentence is the answer and
    what follows it is not: " 6048. ed." and " 6048.\n\n" both answer "6048"; " a\n[1]The ..." answers "a"."""
    return re.split(r"[.\n]", text.strip(), maxsplit=1)[0].strip()

QUESTION = "\n\nQuestion: What is the access code for the archive room?\nAnswer: The access code is"
WARMUP = "\n\nQuestion: What is the text above about?\nAnswer:"
HISTORY_LOADS = TieredConfig().importance_probe_skip  # from here on the failing layers' probes are skipped


def _sparse_server(tmp: Path, name: str, wrapper: list[str], args: list[str], texts: list[str], codes: list[str],
                   modes: dict[str, str]) -> tuple[dict, list[str]]:
    """`ask_gated` with the code question on every document, `modes` (label -> `tiered_importance`)."""
    return ask_gated(tmp, name, wrapper, args, texts, [(QUESTION, [code]) for code in codes],
                     {label: {"tiered_importance": mode} for label, mode in modes.items()})


def ask_gated(tmp: Path, name: str, wrapper: list[str], args: list[str], texts: list[str],
              asks: list[tuple[str, list[str]]], modes: dict[str, dict], max_new_tokens: int = 8,
              warmup: str = WARMUP) -> tuple[dict, list[str]]:
    """One gated server on a fresh SSD directory: each document asked the `warmup` question (its pages get
    repacked); then, per gated mode, `HISTORY_LOADS` loads of the warm-up question (other requests a running
    server has served: they give that gate and ratio's history its steady state, `--tiered-importance-probe-skip`);
    then per document and
    per mode (label -> the request's custom_params), device and host flushed and the SSD files evicted from the
    page cache, the document's question `asks[i][0]`, correct when the greedy continuation holds every string of
    `asks[i][1]`. Rows per label, and the sparse-load log lines."""
    store = tmp / name
    rows: dict = {label: [] for label in modes}
    t0 = time.monotonic()

    def progress(what: str) -> None:
        print(f"[{name}] {what} ({time.monotonic() - t0:.0f} s)", flush=True)

    with ServerProcess([*args, "--tiered-ssd-dir", str(store)], log_path=tmp / f"{name}.log", wrapper=wrapper) as s:
        for i, text in enumerate(texts):
            s.generate(text + warmup, max_new_tokens=1)
            deadline = time.monotonic() + 60
            while len(s.log_lines("tiered repack:")) <= i and time.monotonic() < deadline:
                time.sleep(0.2)
        progress(f"{len(texts)} documents stored and repacked")
        for custom in (c for c in modes.values() if c.get("tiered_importance", "gated") == "gated"):
            for i in range(HISTORY_LOADS):
                s.flush_cache()
                s.request("/generate", {"text": texts[i % len(texts)] + warmup, "sampling_params": {
                    "max_new_tokens": 1, "custom_params": custom}}, timeout=600)
        progress("gate histories warmed up")
        for n, (text, (question, expected)) in enumerate(zip(texts, asks), 1):
            for label, custom in modes.items():
                s.flush_cache()
                evict_from_page_cache(store)
                before = server_read_bytes(s)
                r = stream_generate(s, {"text": text + question, "sampling_params": {
                    "max_new_tokens": max_new_tokens, "temperature": 0, "custom_params": custom}})
                rows[label].append({"ttft_s": r["ttft_s"], "latency_s": r["latency_s"],
                                    "read_bytes": server_read_bytes(s) - before, "output_ids": r["output_ids"],
                                    "answer": answer(r["text"]), "text": r["text"],
                                    "correct": all(e.lower() in r["text"].lower() for e in expected),
                                    "cached": cached_details(r)})
            progress(f"document {n}/{len(texts)} asked in {len(modes)} modes")
        return rows, s.log_lines("tiered sparse: rid")


def alpha_label(alpha: float) -> str:
    return f"gated, alpha {alpha:g}"


def ratio_label(ratio: float) -> str:
    return f"gated, ratio {ratio:g}"


def mass_label(ratio: float, max_drop: float) -> str:
    return f"gated {ratio:.2f}, chunks, mass gate {max_drop:g}"


def mass_server_label(ratio: float, max_drop: float) -> str:
    return f"gated, mass gate {max_drop:g}, ratio {ratio:g}"


def sparse(source: PromptSource, dtype: str, docs: int, tokens: int, slow_mbps: int, alphas: list[float],
           slow_iops: int = 0, ratios: tuple[float, ...] = (),
           mass: tuple[tuple[float, float], ...] = ()) -> dict:
    """SSD hits of documents with a planted fact, asked after a different first question: SGLang's full load (off),
    the sparse path loading everything (full) and the gated load, same server; the gated load
    with each gate exponent of `alphas`, each `--tiered-importance-ratio` of `ratios`, and the mass gate
    (`--tiered-importance-gate mass`) at each (ratio, bound) of `mass` (one server each). On every disk of
    `disks`."""
    rng = random.Random(1)
    texts, codes = [], []
    for _ in range(docs):
        body, code = source.take(tokens), f"{rng.randint(1000, 9999)}"
        cut = len(body) // 3
        texts.append(body[:cut] + FACT.format(code=code) + body[cut:])
        codes.append(code)
    out: dict = {}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        for n, (disk, wrapper) in enumerate(disks(tmp, slow_mbps, slow_iops).items()):
            args = ["--kv-backend", "tiered", "--max-total-tokens", str(2 * tokens + 1024), "--dtype", dtype,
                    "--tiered-stats-interval", "0", "--tiered-importance-load", "gated"]
            rows, log = _sparse_server(Path(tmp), f"gated-{n}", wrapper, args, texts, codes,
                                       {"off": "off", "full": "full", "gated": "gated"})
            variants = [(alpha_label(x), f"alpha-{x}", ["--tiered-importance-alpha", str(x)]) for x in alphas]
            variants += [(ratio_label(x), f"ratio-{x}", ["--tiered-importance-ratio", str(x)]) for x in ratios]
            variants += [(mass_server_label(x, d), f"mass-{x}-{d}", [
                "--tiered-importance-gate", "mass", "--tiered-importance-ratio", str(x),
                "--tiered-importance-max-drop", str(d)]) for x, d in mass]
            for label, name, flags in variants:
                more, _ = _sparse_server(Path(tmp), f"{name}-{n}", wrapper, [*args, *flags], texts, codes,
                                         {label: "gated"})
                rows.update(more)
            res = {}
            for mode, rs in rows.items():
                res[mode] = {"median_s": statistics.median(r["ttft_s"] for r in rs),
                             "read_mib": statistics.median(r["read_bytes"] for r in rs) / 2**20,
                             "accuracy": sum(r["correct"] for r in rs) / len(rs), "rows": rs}
            off = rows["off"]
            for mode in [m for m in rows if m != "off"]:
                same = [a["output_ids"] == b["output_ids"] for a, b in zip(rows[mode], off)]
                res[mode]["identical_to_off"] = sum(same) / len(same)
                res[mode]["answer_agreement"] = statistics.mean(
                    float(a["answer"] == b["answer"]) for a, b in zip(rows[mode], off))
                agree = [sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) / len(b["output_ids"])
                         for a, b in zip(rows[mode], off)]
                res[mode]["token_agreement"] = statistics.mean(agree)
            res["log"] = log[-docs:]
            out[disk] = res
            print(f"[sparse] disk {disk}: " + "; ".join(
                f"{m} {res[m]['median_s']:.3f} s, {res[m]['read_mib']:.1f} MiB, accuracy {res[m]['accuracy']:.2f}"
                for m in rows), flush=True)
    return out


class _MemorySpan:
    """A stored span held in memory as a repacked group serves it: 16-token units of consecutive tokens (`units`,
    None: single tokens) and a probe quantized like the group file's, with `bits` bits."""

    def __init__(self, kv, units, bits: int) -> None:
        self.kv, self.tokens, self.units, self.bits = kv, kv.shape[1], units, bits

    def probe(self, layer, heads):
        import torch

        from sglang_tiered.storage.group_file import dequantize_probe, quantize_probe

        keys = self.kv[layer, :, 0, heads].numpy()
        return torch.from_numpy(dequantize_probe(*quantize_probe(keys, self.bits), self.bits))

    def load(self, layer, idx):
        return self.kv[layer, idx]


def quality(source: PromptSource, docs: int, tokens: int, ratios: list[float], alphas: list[float],
            mass_ratios: list[float] = (), max_drops: list[float] = ()) -> dict:
    """Engine-level quality of gated loading on SmolLM2 (fp32, no server): the planted-fact documents, the code
    question answered after a full prefill vs a gated sparse load (greedy, 8 tokens; decoding attends to the loaded
    tokens only, as in the server). Which tokens a load picks does not depend on the file order of a repacked group
    (that only makes the picks' reads dense), so no first question is needed here."""
    import torch

    from sglang_tiered.engine.blend import greedy_continue
    from sglang_tiered.engine.sparse import sparse_prefill
    from sglang_tiered.engine.tuning import load_model
    from sglang_tiered.kernels.extend_attention import causal_attention
    from sglang_tiered.kernels.importance import probed_kv_heads
    from sglang_tiered.models import default_model_path
    from sglang_tiered.storage.group_file import PROBE_BITS, GroupMeta

    model = load_model(("pretrained", str(default_model_path())), torch.float32)
    tok = source.tok
    c = model.cfg

    @torch.inference_mode()
    def decode(layers_kv, logits, n, steps=8):  # attends per layer only to the given KV
        caches, out = [kv.clone() for kv in layers_kv], [int(logits.argmax())]
        for t in range(steps - 1):
            x = model.embed(torch.tensor([out[-1]]))
            for layer in range(c.layers):
                q, k, v = model.qkv(layer, x, torch.tensor([n + t]))
                caches[layer] = torch.cat([caches[layer], torch.stack([k, v], 1)])
                kv = caches[layer]
                x = model.finish_layer(layer, x, causal_attention(q, kv[:, 0], kv[:, 1], kv.shape[0] - 1))
            out.append(int(model.logits(x)[0].argmax()))
        return out

    default = TieredConfig()
    # bytes a server reads per token-layer, as a fraction of a full load: the probe of every layer plus the loaded
    # tokens' K and V, as a repacked group of bf16 KV lays them out
    def probe_share(bits: int) -> float:
        layout = GroupMeta(ns="", gid="", keys=(), page_size=64, tokens=1, layers=1, heads=c.kv_heads,
                           dim=c.head_dim, itemsize=2, perm=(0,), chunk=16, probe_crc=(), data_crc=(),
                           probe_heads=tuple(probed_kv_heads(c.heads, c.kv_heads, TieredConfig().importance_heads)),
                           probe_bits=bits)
        return layout.probe_layer_bytes / layout.data_layer_bytes

    # (name, ratio, unit, alpha, probe bits, gate, max drop)
    jaccard = (default.importance_alpha, PROBE_BITS, "jaccard", default.importance_max_drop)
    settings = [(f"gated {ratio:.2f}, {unit}", ratio, unit, *jaccard) for ratio in ratios
                for unit in ("chunks", "tokens")]
    settings += [(f"gated {default.importance_ratio:.2f}, chunks, alpha {alpha:g}", default.importance_ratio,
                  "chunks", alpha, PROBE_BITS, "jaccard", default.importance_max_drop) for alpha in alphas]
    settings += [(f"gated {ratio:.2f}, chunks, 8-bit probe", ratio, "chunks", default.importance_alpha, 8, "jaccard",
                  default.importance_max_drop) for ratio in sorted({default.importance_ratio, min(ratios)})]
    settings += [(mass_label(ratio, drop), ratio, "chunks", default.importance_alpha, PROBE_BITS, "mass", drop)
                 for ratio in mass_ratios for drop in max_drops]
    rng = random.Random(2)
    rows: dict = {"full": []}
    for _ in range(docs):
        body, code = source.take(tokens), f"{rng.randint(1000, 9999)}"
        cut = len(body) // 3
        d_ids = tok(body[:cut] + FACT.format(code=code) + body[cut:])["input_ids"]
        d_ids = d_ids[: len(d_ids) // 64 * 64]
        s = len(d_ids)
        ids = torch.tensor(d_ids + tok(QUESTION, add_special_tokens=False)["input_ids"])
        full = model.prefill(ids)
        ref = greedy_continue(model, full.kv, full.logits, 8)
        rows["full"].append({"correct": code in tok.decode(ref), "agreement": 1.0, "answer": 1.0, "identical": 1.0,
                             "first_token": 1.0, "kl": 0.0, "loaded": 1.0, "read": 1.0, "passes": 0})
        for name, ratio, unit, alpha, bits, gate, max_drop in settings:
            span = _MemorySpan(full.kv[:, :s], torch.arange(s) // 16 if unit == "chunks" else None, bits)
            r = sparse_prefill(model, ids[s:], prefix_len=0, span=span, ratio=ratio, alpha=alpha, gate=gate,
                               max_drop=max_drop)
            out = decode([torch.cat([r.kept_kv[layer], r.kv[layer]]) for layer in range(c.layers)], r.logits,
                         ids.shape[0])
            kl = torch.nn.functional.kl_div(r.logits.log_softmax(-1), full.logits.log_softmax(-1),
                                            log_target=True, reduction="sum")
            rows.setdefault(name, []).append({
                "correct": code in tok.decode(out), "agreement": sum(a == b for a, b in zip(out, ref)) / 8,
                "answer": answer(tok.decode(out, skip_special_tokens=True)) == answer(
                    tok.decode(ref, skip_special_tokens=True)), "identical": out == ref,
                "first_token": out[0] == ref[0], "kl": float(kl), "loaded": r.loaded_fraction,
                "read": probe_share(bits) + r.loaded_fraction,
                "passes": sum(g.passed for g in r.gates) / c.layers})
        print(f"[quality] document {len(rows['full'])}: code {code}, full load says {tok.decode(ref)!r}", flush=True)
    summary = {name: {k: statistics.mean(float(x[k]) for x in rs) for k in rs[0]} for name, rs in rows.items()}
    right = [i for i, x in enumerate(rows["full"]) if x["correct"]]  # documents the full load answers correctly
    for name, m in summary.items():
        m["answer_where_full_right"] = statistics.mean(float(rows[name][i]["answer"]) for i in right) if right else 0
        print(f"[quality] {name}: accuracy {m['correct']:.2f}, answer agreement {m['answer']:.2f} "
              f"({m['answer_where_full_right']:.2f} where the full load is right), identical "
              f"{m['identical']:.2f}, token agreement {m['agreement']:.2f}, first-token KL {m['kl']:.3f}, loaded "
              f"{m['loaded']:.2f} of the token-layers (reads {m['read']:.2f} of a full load's bytes), gate passes "
              f"{m['passes']:.2f} of the layers", flush=True)
    return {"summary": summary, "rows": rows, "docs": docs, "tokens": tokens}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("placement", "sparse") if p in data]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "sparse":
            disks = list(data["sparse"])
            modes = [m for m in data["sparse"][disks[0]] if m != "log"]
            width = 0.8 / len(modes)
            for i, mode in enumerate(modes):
                ax.bar([j + i * width for j in range(len(disks))], [data["sparse"][d][mode]["median_s"] for d in disks],
                       width, label=mode)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(disks))], [f"disk {d}" for d in disks])
            ax.set_ylabel("TTFT of an SSD hit, median (s)")
            ax.set_title("gated sparse loading")
            ax.set_ylim(0, 1.45 * max(data["sparse"][d][m]["median_s"] for d in disks for m in modes))
            ax.legend(fontsize=7, ncol=2, loc="upper left")
        else:
            runs = data["placement"]  # "<configuration>, disk <disk>"
            configs = list(dict.fromkeys(n.rsplit(", disk ", 1)[0] for n in runs))
            disks = list(dict.fromkeys(n.rsplit(", disk ", 1)[1] for n in runs))
            width = 0.8 / len(configs)
            for i, config in enumerate(configs):
                xs = [j + i * width for j in range(len(disks))]
                m = [runs.get(f"{config}, disk {d}", {}) for d in disks]
                ax.bar(xs, [r.get("median_s", 0) for r in m], width, label=config)
                ax.scatter(xs, [r.get("p90_s", 0) for r in m], marker="_", color="black", s=80)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(disks))], [f"disk {d}" for d in disks])
            ax.set_ylabel("TTFT median, bar; p90, dash (s)")
            ax.set_title("Zipf documents: the ablation")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def placement_effect(imp: dict, lru: dict, where: str) -> str:
    """Importance-ranked eviction against LRU, same loading: ties within 10 % of the median TTFT (the rule a
    mechanism earns its place by)."""
    x = imp["median_s"] / lru["median_s"]
    if abs(x - 1) < 0.1:
        return f"importance-ranked eviction {where} ties LRU ({x:.2f}x)"
    return f"importance-ranked eviction {where} {x:.2f}x LRU's median TTFT"


def headline(data: dict) -> str:
    """The results file's one-line verdict, from the parts it holds (each from whichever run measured it)."""
    out = []
    r, slow = data.get("placement"), f"{data.get('workload', {}).get('slow_mbps')} MB/s"
    if r:
        lru = r[f"lru, disk {slow}"]
        # a file whose gated rows ranked eviction by importance (the AMD EPYC one) names them `importance + gated`
        gated = r.get(f"lru + gated, disk {slow}") or r[f"importance + gated, disk {slow}"]
        hits = (lru["ssd_hits"]["median_s"], gated["ssd_hits"]["median_s"])
        if None not in hits:
            out.append(f"Zipf workload at {slow}: SSD hits with gated loading {hits[1]:.3f} s (median) against "
                       f"{hits[0]:.3f} s with the defaults (LRU; SGLang's load, compute-or-load) "
                       f"({hits[0] / hits[1]:.2f}x as fast), "
                       f"{lru['read_mib'] / gated['read_mib']:.2f}x fewer bytes read")
        if f"importance, disk {slow}" in r:
            out.append(placement_effect(r[f"importance, disk {slow}"], lru, "alone"))
        if f"lru + gated, disk {slow}" in r and f"importance + gated, disk {slow}" in r:
            out.append(placement_effect(r[f"importance + gated, disk {slow}"], gated, "under gated loading"))
    w = data.get("sparse_workload", {})
    s = data.get("sparse", {}).get(f"{w.get('slow_mbps')} MB/s")
    if s:
        off, gated = s["off"], s["gated"]
        out.append(f"one {w['tokens']:,}-token SSD prefix at {w['slow_mbps']} MB/s: gated "
                   f"{off['median_s'] / gated['median_s']:.2f}x sooner, "
                   f"{off['read_mib'] / gated['read_mib']:.2f}x fewer bytes than SGLang's full load, its answer in "
                   f"{gated['answer_agreement']:.2f}")
    q = data.get("quality", {}).get("summary", {}).get(f"gated {TieredConfig().importance_ratio:.2f}, chunks")
    if q:
        out.append(f"answers equal a full load's in {q['answer']:.2f} of requests (target 0.95: "
                   f"{'met' if q['answer'] >= 0.95 else 'missed'})")
    return "; ".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--quality-docs", type=int, default=24)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.2, 0.3, 0.5, 0.7])
    p.add_argument("--sparse-ratios", type=float, nargs="*", default=[0.15],
                   help="--tiered-importance-ratio values measured besides the default in part sparse (a server each)")
    p.add_argument("--alphas", type=float, nargs="*", default=[1.0],
                   help="gate exponents measured besides the default (sparse: one server each; quality: at the "
                        "default ratio)")
    p.add_argument("--mass-ratios", type=float, nargs="*", default=[0.2, 0.3],
                   help="ratios at which the mass gate (--tiered-importance-gate mass) is measured (sparse: the "
                        "last one, a server; quality: each with every --max-drops)")
    p.add_argument("--max-drops", type=float, nargs="*", default=[0.1, 0.15, 0.2],
                   help="quality: the mass gate's bounds measured (--tiered-importance-max-drop)")
    p.add_argument("--sparse-max-drops", type=float, nargs="*", default=[0.15, 0.2],
                   help="sparse: the mass gate's bounds measured at the last --mass-ratios value (a server each)")
    p.add_argument("--sparse-docs", type=int, default=6)
    p.add_argument("--sparse-tokens", type=int, default=2048)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--docs", type=int, default=12)
    p.add_argument("--doc-tokens", type=int, nargs="+", default=[2048, 3072, 4096],
                   help="placement: document lengths, cycled (the issue's workload: 2-8k)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--slow-mbps", type=int, default=100)
    p.add_argument("--slow-iops", type=int, default=3000,
                   help="part sparse also runs on a disk limited to --slow-mbps and this many read I/Os per second "
                        "(benchmarks/iops-limit; 0: not)")
    a = p.parse_args()
    dtype = a.dtype or auto_dtype()
    source = PromptSource()
    path = RESULTS / f"importance-{machine_class()}.json"
    data: dict = json.loads(path.read_text()) if path.exists() else {}  # parts not run keep this class's last results
    # where each part was measured (`runs`): parts run on different days may come from different machines
    here = {"machine": machine(), "dtype": dtype, "date": time.strftime("%Y-%m-%d", time.gmtime())}
    runs = data.setdefault("runs", {})
    runs.update({part: here for part in a.parts})
    headline_run = runs.get("placement", here)  # the file's machine and dtype: its headline's
    data["machine"], data["dtype"] = headline_run["machine"], headline_run["dtype"]
    verdicts = []
    if "placement" in a.parts:
        data["placement"] = placement(source, dtype, a.docs, a.doc_tokens, a.requests, a.clients, a.slow_mbps)
        data["workload"] = {"docs": a.docs, "doc_tokens": a.doc_tokens, "requests": a.requests, "clients": a.clients,
                            "zipf_s": 1.1, "device_tokens": device_tokens(a.doc_tokens), "host": "2x",
                            "chunked_prefill_size": CHUNKED_PREFILL, "slow_mbps": a.slow_mbps,
                            "cache_note": "the SSD tier's files evicted from the page cache before every request"}
        r = data["placement"]
        slow = f"{a.slow_mbps} MB/s"
        lru = r[f"lru, disk {slow}"]
        chain = [(n, r[f"{n}, disk {slow}"]) for n in CHAIN]
        verdicts.append(f"ablation at {slow} (median / p90 TTFT, MiB read): " + " -> ".join(
            f"{n} {m['median_s']:.3f} / {m['p90_s']:.3f} s, {m['read_mib']:.0f} MiB" for n, m in chain))
        gated = r[f"lru + gated, disk {slow}"]
        hit_s = (lru["ssd_hits"]["median_s"], gated["ssd_hits"]["median_s"])
        if None in hit_s:  # a configuration without SSD hits: no verdict, and the JSON below is still saved
            verdicts.append(f"SSD hits at {slow}: none in some configuration, see the table")
        else:
            ttft_x, bytes_x = hit_s[0] / hit_s[1], lru["read_mib"] / gated["read_mib"]
            verdicts.append(f"SSD hits at {slow}, gated (default) vs LRU + full load: median TTFT {hit_s[1]:.3f} vs "
                            f"{hit_s[0]:.3f} s = {ttft_x:.2f}x (target >= 1.5x: {'PASS' if ttft_x >= 1.5 else 'MISS'})"
                            f", {bytes_x:.2f}x fewer bytes read (target >= 2x: {'PASS' if bytes_x >= 2 else 'MISS'})")
        mass = r[f"lru + gated (mass gate), disk {slow}"]
        verdicts.append(f"mass gate (ratio 0.3, bound 0.2) on the same workload at {slow}: median "
                        f"{mass['median_s']:.3f} s ({lru['median_s'] / mass['median_s']:.2f}x lower than LRU + full "
                        f"load), {mass['read_mib']:.0f} MiB read ({lru['read_mib'] / mass['read_mib']:.2f}x fewer)")
    if "sparse" in a.parts:
        data["sparse"] = sparse(source, dtype, a.sparse_docs, a.sparse_tokens, a.slow_mbps, a.alphas, a.slow_iops,
                                a.sparse_ratios, [(a.mass_ratios[-1], d) for d in a.sparse_max_drops])
        data["sparse_workload"] = {"docs": a.sparse_docs, "tokens": a.sparse_tokens, "slow_mbps": a.slow_mbps,
                                   "slow_iops": a.slow_iops}
        r = data["sparse"][f"{a.slow_mbps} MB/s"]
        off, gated = r["off"], r["gated"]
        bytes_x = off["read_mib"] / max(gated["read_mib"], 1e-9)
        ttft_x = off["median_s"] / gated["median_s"]
        verdicts.append(f"gated sparse load at {a.slow_mbps} MB/s: {bytes_x:.2f}x fewer bytes read (target >= 2x: "
                        f"{'PASS' if bytes_x >= 2 else 'MISS'}), TTFT {gated['median_s']:.3f} vs {off['median_s']:.3f}"
                        f" s = {ttft_x:.2f}x (target >= 1.5x: {'PASS' if ttft_x >= 1.5 else 'MISS'}); accuracy "
                        f"{gated['accuracy']:.2f} vs full load {off['accuracy']:.2f}, answer agreement with the full "
                        f"load {gated['answer_agreement']:.2f} (target >= 0.95: "
                        f"{'PASS' if gated['answer_agreement'] >= 0.95 else 'MISS'}), all 8 tokens identical "
                        f"{gated['identical_to_off']:.2f}")
        for disk, d in data["sparse"].items():
            if disk != "native":
                verdicts.append(f"gated sparse load at {disk}: {d['gated']['median_s']:.3f} s vs SGLang's full "
                                f"load {d['off']['median_s']:.3f} s")
        for flags, label in [(f"--tiered-importance-alpha {x:g}", alpha_label(x)) for x in a.alphas] + [
                (f"--tiered-importance-ratio {x:g}", ratio_label(x)) for x in a.sparse_ratios] + [
                (f"--tiered-importance-gate mass --tiered-importance-ratio {a.mass_ratios[-1]:g} "
                 f"--tiered-importance-max-drop {d:g}", mass_server_label(a.mass_ratios[-1], d))
                for d in a.sparse_max_drops]:
            m = r[label]
            verdicts.append(f"gated sparse load with {flags} at {a.slow_mbps} MB/s: "
                            f"{off['read_mib'] / max(m['read_mib'], 1e-9):.2f}x fewer bytes, TTFT "
                            f"{off['median_s'] / m['median_s']:.2f}x, answer agreement {m['answer_agreement']:.2f}, "
                            f"accuracy {m['accuracy']:.2f}")
    if "quality" in a.parts:
        data["quality"] = quality(PromptSource(), a.quality_docs, a.sparse_tokens, a.ratios, a.alphas,
                                  a.mass_ratios, a.max_drops)
        q = data["quality"]["summary"]
        default = f"gated {TieredConfig().importance_ratio:.2f}, chunks"
        d = q.get(default, {})
        reach = sorted((n for n in q if n != "full" and q[n]["answer"] >= 0.95), key=lambda n: q[n]["read"])
        verdicts.append(f"gated quality (engine, {a.quality_docs} documents): full load accuracy "
                        f"{q['full']['correct']:.2f}; default ({default}): accuracy {d.get('correct', 0):.2f}, answer "
                        f"agreement {d.get('answer', 0):.2f} (target >= 0.95: "
                        f"{'PASS' if d.get('answer', 0) >= 0.95 else 'MISS'}; "
                        f"{d.get('answer_where_full_right', 0):.2f} where the full load is right), 8 tokens identical "
                        f"{d.get('identical', 0):.2f}, loading {d.get('loaded', 0):.2f} of the token-layers; "
                        + (f"cheapest setting reaching 0.95: {reach[0]} (loading {q[reach[0]]['loaded']:.2f} of the "
                           f"token-layers, reading {q[reach[0]]['read']:.2f} of a full load's bytes with the probe)"
                           if reach else "no setting reaches 0.95"))
    data["verdict"] = headline(data)
    save(path.stem, data)
    plot(data, path.with_suffix(".png"))
    for v in verdicts:
        print("VERDICT:", v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
