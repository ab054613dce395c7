"""Compute-or-load through the server: is an SSD hit with `--tiered-kvpr auto` ever slower than the better of
SGLang's own load and recomputing? One pre-registered run; the baselines in the same run.

Grid (10 points): the models `smollm2` (GQA: the loader reads KV) and `smollm2-mha` (SmolLM2-135M's shape with 9 KV
heads, random weights: activations stored, the loader reads them where cheaper), stored spans of 1024 and 4096
tokens, at the disk's own speed and at 25 MB/s (the server's block reads throttled by `shared/tools/slow-disk`),
idle; plus 100 MB/s beside a busy client (long prefills back to back), 1024 tokens. At each point a document is
prefilled once (its pages reach the SSD tier); then, device and host flushed and the tier's files evicted from the
page cache before every request, the document plus a 32-token question is sent as
  * `load`: SGLang's own L3 load (`custom_params.tiered_kvpr` = "off"),
  * `recompute`: the same tokens under a fresh `cache_salt` (nothing stored matches: SGLang computes it all),
  * `auto`: the default decision (policy/kvpr.decide: SGLang's load, SGLang's forward, or the two-sided load),
  * `meet`: the two-sided load always ("force"): the decision's ablation,
in a shuffled order per round (seeded), three rounds. TTFT: client side, max_new_tokens = 1, median per point.
Reported: auto / min(load, recompute) per point with a bootstrap 95 % interval, its median over all points and over
the crossover points (load and recompute within 1.5x). Targets: median <= 1.0x over all, <= 0.8x over crossovers; no
greedy answer differing from SGLang's load (fp32, the default dtype here).

    .venv/bin/python benchmarks/meet.py [--dtype float32] [--rounds 3] [--name meet-<machine class>]

Writes benchmarks/results/NAME.json and .png and prints one verdict line.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, SLOW_DISK, PromptSource, evict_from_page_cache, machine, machine_class, save  # noqa: E402

from sglang_tiered.engine.llama import LlamaConfig  # noqa: E402
from sglang_tiered.models import random_model_dir  # noqa: E402
from sglang_tiered.server_process import (  # noqa: E402
    ServerProcess,
    cached_details,
    exit_cleanly_on_sigterm,
    metric_total,
)

PAGE = 64
QUESTION = 32
CONFIGS = ("load", "recompute", "auto", "meet")
MODES = {"load": "off", "recompute": "off", "auto": "auto", "meet": "force"}
MHA = LlamaConfig(hidden=576, layers=30, heads=9, kv_heads=9, head_dim=64, intermediate=1536, vocab=49152)
# (model, disk label, MB/s or None for the disk's own speed, busy, span lengths)
GRID = [(m, disk, mbps, busy, lengths) for m in ("smollm2", "smollm2-mha") for disk, mbps, busy, lengths in
        (("native", None, False, (1024, 4096)), ("25 MB/s", 25, False, (1024, 4096)),
         ("100 MB/s + busy", 100, True, (1024,)))]
def request(s: ServerProcess, ids: list[int], mode: str, salt: str | None = None) -> tuple[float, dict]:
    payload: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                           "custom_params": {"tiered_kvpr": mode}}}
    if salt is not None:
        payload["cache_salt"] = salt
    t0 = time.perf_counter()
    status, body = s.request("/generate", payload, timeout=900)
    if status != 200:
        raise RuntimeError(f"request failed: {body}")
    return time.perf_counter() - t0, body


class Busy:
    """A second client sending long prefills back to back, each under a fresh salt; paused while the cache is
    flushed (SGLang refuses /flush_cache while a request runs)."""

    def __init__(self, s: ServerProcess, ids: list[int]) -> None:
        self.s, self.ids = s, ids
        self.go, self.idle, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            if not self.go.wait(0.2):
                continue
            self.idle.clear()
            n += 1
            try:
                request(self.s, self.ids, "off", salt=f"busy-{n}")
            except Exception:  # noqa: BLE001 -- it only loads the CPU; the measured requests decide
                time.sleep(0.1)
            finally:
                self.idle.set()

    def pause(self) -> None:
        self.go.clear()
        self.idle.wait(900)

    def resume(self) -> None:
        self.go.set()
        time.sleep(0.2)  # its prefill is under way when the measured request arrives

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        self.thread.join(timeout=900)


def measure(s: ServerProcess, ssd: Path, ids: list[int], config: str, salt: str, busy: Busy | None) -> dict:
    """One request of `config` after flushing device and host and evicting the tier's files from the page cache."""
    if busy is not None:
        busy.pause()
    s.flush_cache()
    evict_from_page_cache(ssd)
    if busy is not None:
        busy.resume()
    mark = s.log_mark()
    ttft, body = request(s, ids, MODES[config], salt if config == "recompute" else None)
    line = next(iter(s.log_lines(f"rid {body['meta_info']['id']}", since=mark)), "")
    met = re.search(r"met at page (\d+) of (\d+)", line)
    way = re.search(r"mode=auto: (\w+)", line)
    return {"ttft_s": ttft, "output": body["output_ids"], "storage": cached_details(body).get("storage", 0),
            "met": [int(met.group(1)), int(met.group(2))] if met else None,
            "way": way.group(1) if way else ("load" if config == "auto" else None)}


def written_pages(s: ServerProcess) -> float:
    return metric_total(s.get("/metrics"), "sglang_tiered:ssd_written_pages_total")


def wait_for(check, timeout: float = 120.0, what: str = "") -> None:
    """Polls `check` until it holds or `timeout` seconds pass; a timeout is printed (`what` names it), and the run
    goes on with what it has."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.3)
    if not check():
        print(f"[meet] waited {timeout:.0f} s for {what or 'a condition'}; going on without it", flush=True)


def run_server(model: str, disk: str, mbps: int | None, busy: bool, lengths: tuple[int, ...], rounds: int,
               dtype: str, src: PromptSource, tmp: Path) -> dict:
    """One server at one disk speed: every length's point."""
    tag = f"{model}-{disk.replace(' ', '').replace('/', '')}"
    ssd = tmp / f"ssd-{tag}"
    wrapper = [] if mbps is None else [str(SLOW_DISK), "--dir", str(tmp), str(mbps), "--"]
    longest = max(lengths) + 2 * PAGE
    args = ["--kv-backend", "tiered", "--max-total-tokens", str(3 * longest), "--dtype", dtype,
            "--tiered-ssd-dir", str(ssd), "--tiered-stats-interval", "0", "--chunked-prefill-size", str(longest),
            "--enable-metrics"]
    checkpoint = {"model_path": str(random_model_dir(tmp / "mha-model", MHA, seed=1))} if model != "smollm2" else {}
    out: dict = {}
    with ServerProcess(args, log_path=tmp / f"{tag}.log", wrapper=wrapper, **checkpoint) as s:
        question = src.tok(src.take(QUESTION + 8))["input_ids"][:QUESTION]
        docs = {n: src.tok(src.take(n + 16))["input_ids"][:n] for n in lengths}
        for n, doc in docs.items():  # stored: its pages (and activations) written through
            before = written_pages(s)
            request(s, doc + question[::-1], "off")
            wait_for(lambda before=before, n=n: written_pages(s) >= before + n // PAGE, what="the pages' writes")
        def measured() -> bool:  # the compute profile (at the warmup request) and the read probe it started
            profile = s.log_lines("tiered kvpr: profile") or s.log_lines("measuring the compute profile failed")
            return bool(profile) and bool(s.log_lines("tiered kvpr: SSD read bandwidth")
                                          or s.log_lines("cannot measure the SSD read bandwidth"))

        wait_for(measured, what="the compute profile and the read probe")
        time.sleep(3)  # the activations' writes drain
        noise = Busy(s, src.tok(src.take(2048))["input_ids"]) if busy else None
        try:
            for n, doc in docs.items():
                rows: dict = {c: [] for c in CONFIGS}
                for r in range(rounds):
                    order = list(CONFIGS)
                    random.Random(f"{tag}-{n}-{r}").shuffle(order)
                    for c in order:
                        before = written_pages(s)
                        rows[c].append(measure(s, ssd, doc + question, c, f"fresh-{tag}-{n}-{r}", noise))
                        if c == "recompute":  # its pages are new (a fresh salt): their write-through ends first
                            wait_for(lambda before=before, n=n: written_pages(s) >= before + n // PAGE,
                                     what="the pages' writes")
                point = {c: {"ttft_s": statistics.median(x["ttft_s"] for x in rs), "rows": rs}
                         for c, rs in rows.items()}
                reference = next((x["output"] for x in rows["load"] if x["storage"] >= n - PAGE),
                                 rows["recompute"][0]["output"])
                point["differing"] = sum(x["output"] != reference for c in ("auto", "meet") for x in rows[c])
                point["auto_over_min_ci"] = interval(rows)
                out[str(n)] = point
                print(f"[meet] {model} {disk} {n}: " + ", ".join(f"{c} {point[c]['ttft_s']:.3f}s" for c in CONFIGS)
                      + f"; auto / min {ratio(rows):.2f} {point['auto_over_min_ci']}; auto's ways "
                      f"{[x['way'] for x in rows['auto']]}", flush=True)
        finally:
            if noise is not None:
                noise.close()
        out["profile"] = s.log_lines("tiered kvpr: profile")[-1:]
    shutil.rmtree(ssd, ignore_errors=True)
    return out


def ratio(rows: dict) -> float:
    med = {c: statistics.median(x["ttft_s"] for x in rows[c]) for c in ("load", "recompute", "auto")}
    return med["auto"] / min(med["load"], med["recompute"])


def interval(rows: dict, draws: int = 2000) -> list[float]:
    """Bootstrap 95 % interval of `ratio` (each configuration's rows resampled on their own)."""
    rng = random.Random(0)
    out = sorted(ratio({c: rng.choices(rows[c], k=len(rows[c])) for c in ("load", "recompute", "auto")})
                 for _ in range(draws))
    return [round(out[int(0.025 * draws)], 3), round(out[int(0.975 * draws) - 1], 3)]


def points(results: dict):
    for where, lengths in results.items():
        for n, p in lengths.items():
            if n != "profile":
                yield f"{where}/{n}", p


def summary(results: dict, dtype: str, rounds: int) -> dict:
    table, every, crossover = [], [], []
    for where, p in points(results):
        load, rec, auto, meet = (p[c]["ttft_s"] for c in CONFIGS)
        best = min(load, rec)
        cross = max(load, rec) <= 1.5 * best
        every.append(auto / best)
        if cross:
            crossover.append(auto / best)
        table.append({"point": where, "load_s": round(load, 3), "recompute_s": round(rec, 3),
                      "auto_s": round(auto, 3), "meet_s": round(meet, 3), "auto_over_min": round(auto / best, 3),
                      "ci": p["auto_over_min_ci"], "meet_over_min": round(meet / best, 3), "crossover": cross,
                      "differing": p["differing"]})
    med = statistics.median(every) if every else float("nan")
    med_x = statistics.median(crossover) if crossover else None
    differing = sum(row["differing"] for row in table)
    meet_med = statistics.median(row["meet_over_min"] for row in table) if table else float("nan")
    verdict = (f"auto / min(load, recompute): median {med:.2f}x over {len(every)} points (target <= 1.0), "
               + (f"{med_x:.2f}x over {len(crossover)} crossovers (target <= 0.8)" if med_x is not None
                  else "no crossover point")
               + f"; always meeting (the ablation): median {meet_med:.2f}x; {differing} answers differing")
    return {"machine": machine(), "dtype": dtype, "rounds": rounds, "table": table, "results": results,
            "verdict": verdict}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["table"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    xs = range(len(rows))
    for key, style in (("load_s", "s--"), ("recompute_s", "^--"), ("auto_s", "o-"), ("meet_s", "x:")):
        ax.plot(xs, [r[key] for r in rows], style, label=key.removesuffix("_s"))
    ax.set_xticks(list(xs), [r["point"] for r in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("TTFT, median (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"compute-or-load through the server ({data['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default=None, help="results as benchmarks/results/NAME.json (default meet-<class>)")
    a = ap.parse_args()
    exit_cleanly_on_sigterm()
    name = a.name or f"meet-{machine_class()}"
    src, results = PromptSource(), {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meet-bench-") as tmp:
        for model, disk, mbps, busy, lengths in GRID:
            results[f"{model}/{disk}"] = run_server(model, disk, mbps, busy, lengths, a.rounds, a.dtype, src,
                                                    Path(tmp))
            save(name, summary(results, a.dtype, a.rounds))  # what is measured survives a crash
            print(f"[meet] {time.monotonic() - t0:.0f} s so far", flush=True)
    data = summary(results, a.dtype, a.rounds)
    save(name, data)
    plot(data, RESULTS / f"{name}.png")
    print("verdict:", data["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
