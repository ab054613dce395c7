"""Compute the front of a stored prefix while loading its back, through the server: is an SSD hit ever slower than
recomputing? Models (`--models`): `smollm2`, the GQA default (no activations: the loader reads KV) and
`smollm2-mha`, SmolLM2-135M's shape with 9 KV heads and random weights (activations stored: the loader reads pages
as activations where that is cheaper -- KVPR as one case of the same scheduler).

For each model, each disk speed (the disk's own, and with the server's block-device reads throttled by
`shared/tools/slow-disk` to each of `--slow-mbps`) and each stored span (`--lengths` tokens, whole pages): a
document is prefilled once (its pages reach the SSD tier); then -- device and host flushed, the SSD tier's files
evicted from the page cache before every request -- the document plus a 32-token question is sent as
  * `load`: SGLang's own L3 load of every page (`custom_params.tiered_kvpr` = "off"),
  * `recompute`: the same tokens under a fresh `cache_salt`, so nothing stored matches (SGLang computes it all),
  * `loader`: our loader reading the whole span, nothing computed (`tiered_kvpr` = 0: before the two-sided
    scheduler, the only loader; reads activations where they pay),
  * `auto`: the default -- the two-sided loader where reading the span takes longer than computing 2 pages of it,
    SGLang's load otherwise,
  * `race`: the two-sided loader always (`"force"`),
one round over all five in a shuffled order (seeded per point and round), `--repeats` rounds; then, where the
point is undecided -- auto's median within 10 % of the better of load and recompute, or above it (one request's TTFT
varies by about 10 % here, so a 1.03x target is not decided by 3 rounds) -- more rounds of auto and the baselines
that matter there, up to `--max-repeats` rounds or `--point-budget` seconds of extra rounds; medians of the
client-side time to the first token (max_new_tokens = 1), and a bootstrap 95 % interval of auto / min(load,
recompute). `--page-cache keep` leaves the SSD tier's files in the page cache (warm since their write or last
read, a production server's usual case) instead of evicting them; `--burst N` sends N prompts at once, each with its
own stored document (TTFT: their mean). `--busy` adds, at one disk speed, a second client keeping the CPU busy
with long prefills during the measurements (`--busy-native`: at the disk's own speed; `--busy-client decode`: a
short prompt's long decode instead, so the measured request arrives among decode batches). Targets (issue #26):
auto <= 1.03 x min(load, recompute) at every point, and <= 0.75 x min(load, recompute) wherever the two are within
1.5x of each other; no answer differing from `load`'s (request by request; where SGLang's load read nothing for a
request, from recompute's, with the requests whose recomputed answers differ between rounds named).
`--recheck --name NAME` measures nothing: it compares the answers kept in results/NAME.json again.

    .venv/bin/python benchmarks/meet.py [--models smollm2 smollm2-mha] [--lengths 1024 4096 8064]
        [--slow-mbps 200 100 50 25] [--busy 100] [--busy-native] [--busy-client prefill] [--name meet]

Writes benchmarks/results/meet.json and .png and prints one verdict line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
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
)

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
CONFIGS = ("load", "recompute", "loader", "auto", "race")
MODES = {"load": "off", "recompute": "off", "loader": 0, "auto": "auto", "race": "force"}
MHA = LlamaConfig(hidden=576, layers=30, heads=9, kv_heads=9, head_dim=64, intermediate=1536, vocab=49152)


def request(s: ServerProcess, ids: list[int], mode, salt: str | None = None, new_tokens: int = 1) -> tuple[float, dict]:
    payload: dict = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                     "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                                         "custom_params": {"tiered_kvpr": mode}}}
    if salt is not None:
        payload["cache_salt"] = salt
    t0 = time.perf_counter()
    status, body = s.request("/generate", payload, timeout=900)
    if status != 200:
        raise RuntimeError(f"request failed: {body}")
    return time.perf_counter() - t0, body


class Busy:
    """A second client keeping the CPU busy, each request under a fresh salt (always computed), back to back: long
    prefills of one token each (`prefill`), or a short prompt decoding `new_tokens` tokens (`decode`: the server
    runs decode batches when the measured request arrives). It pauses while the benchmark flushes the cache (SGLang
    refuses /flush_cache while a request runs) and resumes just before each measured request."""

    def __init__(self, s: ServerProcess, ids: list[int], new_tokens: int = 1) -> None:
        self.s, self.ids, self.new_tokens = s, ids, new_tokens
        self.go, self.idle, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.idle.set()
        self.label, self.fresh = None, False  # the measured request's (tokens, config), set at resume
        self.first_s: dict = {}  # label -> seconds of this client's first request after each resume (what the
        #                          measured request cost it)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            if not self.go.wait(0.2):
                continue
            self.idle.clear()
            n += 1
            label, first, self.fresh = self.label, self.fresh, False
            try:
                t0 = time.perf_counter()
                request(self.s, self.ids, "off", salt=f"busy-{n}", new_tokens=self.new_tokens)
                if first and label is not None:  # the request the measured one arrived beside
                    self.first_s.setdefault(label, []).append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 -- it only loads the CPU; the measured requests decide
                time.sleep(0.1)
            finally:
                self.idle.set()

    def pause(self) -> None:
        self.go.clear()
        self.idle.wait(900)

    def resume(self, label=None) -> None:
        self.label, self.fresh = label, True
        self.go.set()
        # prefills: its prefill is under way when the measured request arrives; decode: its short prefill (about
        # 0.2 s) is done and it decodes (at 0.2 s the measured request came right after that prefill: `auto` then
        # judged it behind prefills, not among decodes)
        time.sleep(0.2 if self.new_tokens == 1 else 1.0)

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        self.thread.join(timeout=900)


WAYS = {None: "SGLang's load", ")": "ours, compute not expected", ": behind": "ours, behind prefills",
        ": measured choice": "ours, measured choice", ": our loader alone": "ours, in the page cache"}


def way_name(logged: str | None) -> str:
    """The way `auto` took, from its load's log line: `policy/compute_choice.py`'s three where compute would gain; our
    loader alone behind other prefills, by the measured choice, or with the span in the page cache (stop 65); a bare
    `mode=auto` (before stop 50: our loader where compute was not expected to join); no line: SGLang's own load."""
    return WAYS.get(logged) or logged.removeprefix(": ")


def measure_once(s: ServerProcess, ssd: Path, batch: list[list[int]], config: str, salt: str, busy: Busy | None,
                 evict: bool = True) -> dict:
    """One round of `config`: after flushing device and host and (`evict`) the SSD tier's files out of the page
    cache, the prompts of `batch` sent at once (one request each; `--burst`). One prompt: its row. Several: the mean
    TTFT as `ttft_s`, each request's row under `requests`, their answers under `answers`."""
    if busy is not None:
        busy.pause()
    s.flush_cache()
    if evict:
        evict_from_page_cache(ssd)
    if busy is not None:
        busy.resume((len(batch[0]), config))
    mark = s.log_mark()
    salts = [f"{salt}-{i}" if config == "recompute" else None for i in range(len(batch))]
    with ThreadPoolExecutor(len(batch)) as pool:
        sent = list(pool.map(lambda i: request(s, batch[i], MODES[config], salts[i]), range(len(batch))))
    lines = s.log_lines("tiered kvpr: rid", since=mark)
    rows = [answer_row(ttft, body, [line for line in lines if f"rid {body['meta_info']['id']}" in line])
            for ttft, body in sent]
    if len(rows) == 1:
        return rows[0]
    return {"ttft_s": statistics.mean(r["ttft_s"] for r in rows), "requests": rows,
            "answers": [[r["output"], r["top"]] for r in rows], "output": [r["output"] for r in rows],
            "cached": {k: min(r["cached"][k] for r in rows) for k in rows[0]["cached"]}, "top": rows[0]["top"],
            "met": rows[0]["met"], "from_activations": sum(r["from_activations"] for r in rows),
            "way": ", ".join(f"{w} x{k}" for w, k in sorted(Counter(r["way"] for r in rows).items()))}


def answer_row(ttft: float, body: dict, lines: list[str]) -> dict:
    """One request's row: its TTFT, answer and top log-probabilities, where its tokens came from, and from its load's
    log line (`lines`: the server's lines for its rid) the meet point and the way `auto` took."""
    line = (lines or [""])[-1]
    met = re.search(r"met at page (\d+) of (\d+)", line)
    x = re.search(r"\((\d+) from activations", line)
    way = re.search(r"mode=auto(: two-sided|: the loader alone|: SGLang's forward|\)|: behind|: measured choice"
                    r"|: our loader alone)", line)
    top = (body["meta_info"].get("output_top_logprobs") or [[]])[0] or []
    return {"ttft_s": ttft, "output": body["output_ids"], "cached": cached_details(body),
            "top": [[int(tok), float(lp)] for lp, tok, *_ in top],
            "met": [int(met.group(1)), int(met.group(2))] if met else None,
            "from_activations": int(x.group(1)) if x else 0,
            "way": way_name(way.group(1) if way else None)}


def ratio(rows: dict) -> float:
    """auto's median TTFT over the smaller of SGLang's load's and recompute's."""
    med = {c: statistics.median(x["ttft_s"] for x in rows[c]) for c in ("load", "recompute", "auto")}
    return med["auto"] / min(med["load"], med["recompute"])


def ratio_interval(rows: dict, draws: int = 2000) -> list[float]:
    """Bootstrap 95 % interval of `ratio` (each configuration's rows resampled on their own)."""
    rng = random.Random(0)
    out = sorted(ratio({c: rng.choices(rows[c], k=len(rows[c])) for c in ("load", "recompute", "auto")})
                 for _ in range(draws))
    return [round(out[int(0.025 * draws)], 3), round(out[int(0.975 * draws) - 1], 3)]


def focus(rows: dict) -> list[str]:
    """The configurations worth more rounds at a point: where auto's median is within 10 % of the better of SGLang's
    load and recompute, or above it (the 1.03x target is undecided at a few rounds: one request's TTFT varies by
    about 10 % here), auto and whichever of the two baselines is within 1.5x of the better (the crossover's
    other side); none where auto is clearly ahead."""
    med = {c: statistics.median(x["ttft_s"] for x in rs) for c, rs in rows.items()}
    best = min(med["load"], med["recompute"])
    if med["auto"] < 0.9 * best:
        return []
    return ["auto"] + [c for c in ("load", "recompute") if med[c] <= 1.5 * best]


def compare(rows: dict, n: int) -> dict:
    """Answers of our loaders against SGLang's load -- or, where SGLang's load read nothing (its prefetch gave up on
    a slow disk and it computed the span), against that computed answer; request by request in a burst (each
    request's reference: SGLang's load in a round where it read that request's whole span, else recompute's first
    round). A differing answer is counted, and its margin recorded: the reference's log-probability of its own token
    minus that of the differing token (None when the differing token is not in the reference's top 2): a small margin
    is a near-tie that rounding can flip. `differing_requests`: the requests (by position in the burst) where one
    differed; `recompute_unsteady`: those whose recomputed answers themselves differ between rounds (in bf16 a
    near-tie flips with the batch a request is computed in)."""
    size = len(answers(rows["load"][0]))
    loads = [next((answers(x)[i] for x in rows["load"] if requests(x)[i]["cached"]["storage"] >= n), None)
             for i in range(size)]
    reference = [ref or answers(rows["recompute"][0])[i] for i, ref in enumerate(loads)]
    margins, differing = [], set()
    for x in (x for c in ("loader", "auto", "race") for x in rows[c]):
        for i, ((out, _), (ref_out, ref_top)) in enumerate(zip(answers(x), reference)):
            if out != ref_out:
                lp = dict(ref_top)  # token -> log-probability
                margins.append(round(lp[ref_out[0]] - lp[out[0]], 4) if out[0] in lp and ref_out[0] in lp else None)
                differing.add(i)
    loaded = sum(ref is not None for ref in loads)
    unsteady = [i for i in range(size) if len({str(answers(x)[i][0]) for x in rows["recompute"]}) > 1]
    return {"reference": "load" if loaded == size else "recompute (SGLang's load read nothing)" if not loaded else
            f"load for {loaded} of {size} requests, recompute for the rest (SGLang's load read nothing for them)",
            "answers_differing": len(margins), "differing_margins": margins, "differing_requests": sorted(differing),
            "recompute_unsteady": unsteady}


def mets(rows: list[dict]) -> list:
    """The meet points of a configuration's rows (a burst's: a list per row)."""
    return [[r["met"] for r in x["requests"]] if "requests" in x else x["met"] for x in rows]


def requests(row: dict) -> list[dict]:
    """Each request's row of a measured row (one, or a burst's)."""
    return row.get("requests") or [row]


def answers(row: dict) -> list:
    """[answer, top log-probabilities] of each request of a measured row (one, or a burst's)."""
    return row.get("answers") or [[row["output"], row["top"]]]


def wait_for_pages(s: ServerProcess, pages: int, since: float) -> None:
    """Until the SSD tier's written-pages counter is `pages` above `since` (the write-through of a prefill that
    stored new pages has ended: the next measurement should not share the disk and the CPU with it); at most 120 s."""
    deadline = time.monotonic() + 120
    while written_pages(s) < since + pages and time.monotonic() < deadline:
        time.sleep(0.2)


def written_pages(s: ServerProcess) -> float:
    return metric_total(s.get("/metrics"), "sglang_tiered:ssd_written_pages_total")


def activation_pages(s: ServerProcess) -> float:
    return metric_total(s.get("/metrics"), "sglang_tiered:kvpr_activation_pages_written_total")


def wait_for_activations(s: ServerProcess, pages: int, since: float) -> None:
    """Until the activation pages written to the SSD tier are `pages` above `since` (written asynchronously after the
    KV; `since` read before the request: they may all be written by the time its KV is); at most 120 s."""
    deadline = time.monotonic() + 120
    while activation_pages(s) < since + pages and time.monotonic() < deadline:
        time.sleep(0.3)


def run_disk(model: str, disk: str, mbps: int | None, lengths: list[int], repeats: int, max_repeats: int,
             point_budget: float, dtype: str, src: PromptSource, tmp: Path, busy: str | None,
             logs: Path | None = None, kvpr_choice: str = "measured", evict: bool = True, burst: int = 1) -> dict:
    """One server at one disk speed, every length; `busy`: None, or the second client's kind (see Busy); `evict`:
    False keeps the SSD tier's files in the page cache (written or read before: a production server's usual case);
    `burst`: documents stored per length, sent at once in each measurement."""
    tag = (model + "-" + disk.replace(" MB/s", "mbps").replace(" ", "-") + (f"-busy-{busy}" if busy else "")
           + ("" if evict else "-warm") + (f"-burst{burst}" if burst > 1 else ""))
    ssd = tmp / f"ssd-{tag}"
    wrapper = [] if mbps is None else [str(SLOW_DISK), "--dir", str(tmp), str(mbps), "--"]
    longest = max(lengths) + 2 * PAGE
    args = ["--kv-backend", "tiered", "--max-total-tokens", str((burst + 2) * longest), "--dtype", dtype,
            "--tiered-ssd-dir", str(ssd), "--tiered-stats-interval", "0", "--chunked-prefill-size", str(longest),
            "--enable-metrics", "--tiered-kvpr-choice", kvpr_choice]
    mha = model == "smollm2-mha"
    checkpoint = {"model_path": str(random_model_dir(tmp / "mha-model", MHA, seed=1))} if mha else {}
    out: dict = {}
    with ServerProcess(args, log_path=tmp / f"{tag}.log", wrapper=wrapper, **checkpoint) as s:
        docs = {n: [src.tok(src.take(n + 16))["input_ids"][:n] for _ in range(burst)] for n in lengths}
        question = src.tok(src.take(QUESTION + 8))["input_ids"][:QUESTION]
        # store the documents' pages (and, on the MHA model, their activations)
        for n, doc in ((n, doc) for n, some in docs.items() for doc in some):
            before, x_before = written_pages(s), activation_pages(s)
            request(s, doc + question[::-1], "off")
            wait_for_pages(s, n // PAGE, before)
            if mha:
                wait_for_activations(s, n // PAGE, x_before)
        deadline = time.monotonic() + 120  # the profile measured (at the server's first idle moment)
        while not s.log_lines("tiered kvpr: profile") and time.monotonic() < deadline:
            request(s, question, "off")
            time.sleep(1)
        time.sleep(3)
        noise = None
        if busy == "prefill":
            noise = Busy(s, src.tok(src.take(2048))["input_ids"])
        elif busy == "decode":
            noise = Busy(s, src.tok(src.take(128))["input_ids"][:64], new_tokens=256)
        try:
            for n, some in docs.items():
                batch = [doc + question for doc in some]
                rows: dict = {c: [] for c in CONFIGS}
                t_extra = None  # when the extra rounds began
                for r in range(max_repeats):
                    order = list(CONFIGS) if r < repeats else focus(rows)
                    t_extra = t_extra or (time.monotonic() if r >= repeats else None)
                    if r >= repeats and (not order or time.monotonic() - t_extra > point_budget):
                        break
                    random.Random(f"{tag}-{n}-{r}").shuffle(order)
                    for c in order:
                        before = written_pages(s)
                        rows[c].append(measure_once(s, ssd, batch, c, f"fresh-{tag}-{n}-{r}", noise, evict))
                        if c == "recompute":  # its pages are new (a fresh salt): their write-through ends first
                            wait_for_pages(s, burst * n // PAGE, before)
                point = {c: {"ttft_s": statistics.median(x["ttft_s"] for x in rs), "rows": rs} for c, rs in
                         rows.items()}
                point.update(compare(rows, n))
                if noise is not None:  # the second client's request beside each configuration's, median (s)
                    point["busy_client_s"] = {c: statistics.median(v) for c in CONFIGS
                                              if (v := noise.first_s.get((len(batch[0]), c)))}
                point["auto_over_min_ci"] = ratio_interval(rows)
                out[str(n)] = point
                print(f"[meet] {model} {disk}{' busy ' + busy if busy else ''} {n} tokens: " +
                      ", ".join(f"{c} {point[c]['ttft_s']:.3f}s ({len(rows[c])})" for c in CONFIGS) +
                      f"; auto / min {ratio(rows):.3f} {point['auto_over_min_ci']}"
                      f"; race met at {mets(rows['race'])}, auto at {mets(rows['auto'])}"
                      f"; auto's ways {dict(Counter(x['way'] for x in rows['auto']))}" +
                      (f"; the busy client beside each {point['busy_client_s']}" if noise is not None else ""),
                      flush=True)
        finally:
            if noise is not None:
                noise.close()
        out["profile"] = (s.log_lines("tiered kvpr: profile") + s.log_lines("tiered kvpr: SSD read bandwidth"))[-2:]
    shutil.rmtree(ssd, ignore_errors=True)  # gigabytes per run (every recompute stores new pages): not kept
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp / f"{tag}.log", logs / f"{tag}.log")
    return out


def points(results: dict):
    """(model, disk, span tokens, point) over every measured point."""
    for model, disks in results.items():
        for disk, lengths in disks.items():
            for n, p in lengths.items():
                if n != "profile":
                    yield model, disk, n, p


def verdicts(results: dict) -> dict:
    checks: dict = {"auto <= 1.03 x min(load, recompute)": [], "auto <= 0.75 x min where within 1.5x": [],
                    "no answer differing from load": []}
    for model, disk, n, p in points(results):
        where = f"{model}/{disk}/{n}"
        load, rec, auto = p["load"]["ttft_s"], p["recompute"]["ttft_s"], p["auto"]["ttft_s"]
        best = min(load, rec)
        checks["auto <= 1.03 x min(load, recompute)"].append((where, auto <= 1.03 * best, auto / best))
        if max(load, rec) <= 1.5 * best:
            checks["auto <= 0.75 x min where within 1.5x"].append((where, auto <= 0.75 * best, auto / best))
        checks["no answer differing from load"].append((where, p["answers_differing"] == 0, p["answers_differing"]))
    return checks


def results_ci(results: dict, where: str) -> list[float] | None:
    """The bootstrap interval of auto / min at the point `where` ("model/disk/tokens")."""
    model, rest = where.split("/", 1)
    disk, n = rest.rsplit("/", 1)  # (a disk's name may hold a "/": "200 MB/s")
    return results[model][disk][n].get("auto_over_min_ci")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    lengths = sorted({int(n) for _, _, n, _ in points(results)})
    fig, axes = plt.subplots(len(models), len(lengths), figsize=(5 * len(lengths), 3.6 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        disks = list(results[model])
        for ax, n in zip(row, lengths):
            for c, style in zip(CONFIGS, ("s--", "^--", "d:", "o-", "x:")):
                ys = [results[model][d][str(n)][c]["ttft_s"] if str(n) in results[model][d] else None for d in disks]
                ax.plot(range(len(disks)), ys, style, label=c)
            ax.set_xticks(range(len(disks)), disks, rotation=30, fontsize=7)
            ax.set_title(f"{model}: {n}-token stored span + {QUESTION} new tokens", fontsize=9)
            ax.set_ylabel("TTFT, median (s)")
            ax.set_ylim(bottom=0)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summary(results: dict, a: argparse.Namespace, dtype: str, partial: bool = False) -> dict:
    """The results file: every point, the targets' checks and the verdict line ("partial: " while running)."""
    checks = verdicts(results)
    data = {"machine": machine(), "dtype": dtype, "models": {"smollm2-mha": MHA.__dict__}, "repeats": a.repeats,
            "max_repeats": a.max_repeats, "point_budget_s": a.point_budget, "kvpr_choice": a.kvpr_choice,
            "question": QUESTION, "results": results, "checks": {k: [list(x) for x in v] for k, v in checks.items()}}
    met = {k: sum(ok for _, ok, _ in v) for k, v in checks.items()}
    data["verdict"] = ("partial: " if partial else "") + "; ".join(f"{k}: {met[k]}/{len(v)}" for k, v in
                                                                  checks.items())
    ties = [f"{model}/{disk}/{n} vs {p['reference'].split(' (')[0]}: margins {p['differing_margins']} at requests "
            f"{p.get('differing_requests')}" + (f", recompute's own answers differing between its rounds at "
                                                f"{p['recompute_unsteady']}" if p.get("recompute_unsteady") else "")
            for model, disk, n, p in points(results) if p["answers_differing"]]
    if ties:
        data["verdict"] += " (differing: " + "; ".join(ties) + ")"
    misses = [f"{where} {r:.2f}x {results_ci(results, where)}" for where, ok, r in
              checks["auto <= 1.03 x min(load, recompute)"] if not ok]
    if misses:
        data["verdict"] += " (1.03x misses, with 95 % intervals: " + "; ".join(misses) + ")"
    return data


def recheck(name: str) -> int:
    """Each point of results file `name` compared again (`compare`: the rows it keeps), its checks and verdict
    rewritten; its machine, dtype and measurements kept."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    for _, _, n, p in points(data["results"]):
        p.update(compare({c: p[c]["rows"] for c in CONFIGS}, int(n)))
    a = argparse.Namespace(repeats=data["repeats"], max_repeats=data["max_repeats"],
                           point_budget=data["point_budget_s"], kvpr_choice=data["kvpr_choice"])
    checked = {**summary(data["results"], a, data["dtype"]), "machine": data["machine"]}
    save(name, checked)
    print("verdict:", checked["verdict"])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["smollm2", "smollm2-mha"], default=["smollm2", "smollm2-mha"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 8064],
                    help="stored span lengths (8064: the longest whole-page span + the question under SmolLM2's 8192)")
    ap.add_argument("--slow-mbps", nargs="*", type=int, default=[200, 100, 50, 25])
    ap.add_argument("--skip-native", action="store_true")
    ap.add_argument("--busy", nargs="*", type=int, default=[100], help="disk speeds measured again with a busy CPU")
    ap.add_argument("--busy-native", action="store_true", help="also the disk's own speed with a busy CPU")
    ap.add_argument("--busy-client", choices=["prefill", "decode"], default="prefill",
                    help="what the second client of --busy does: long prefills (the default) or a short prompt's "
                    "long decode")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of all five configurations at every point")
    ap.add_argument("--max-repeats", type=int, default=15, help="rounds at most, the ones after --repeats only of "
                    "the configurations that decide an undecided point (see focus())")
    ap.add_argument("--point-budget", type=float, default=60.0, help="seconds a point's extra rounds may take")
    ap.add_argument("--logs", type=Path, default=None, help="keep a copy of every server's log here")
    ap.add_argument("--dtype", default=None, help="default: what --dtype auto picks on this machine")
    ap.add_argument("--kvpr-choice", default="measured", choices=["rule", "measured"],
                    help="the servers' --tiered-kvpr-choice: which load `auto` gives a span compute would not join")
    ap.add_argument("--page-cache", choices=["evict", "keep"], default="evict",
                    help="evict the SSD tier's files from the page cache before every request (the default: every "
                    "read from the disk), or keep them there (spans warm since their write or last read)")
    ap.add_argument("--burst", type=int, default=1, help="prompts sent at once in each measurement, each with its "
                    "own stored document (several requests arriving during one prefill); TTFT: their mean")
    ap.add_argument("--name", default="meet", help="results as benchmarks/results/NAME.json and .png (a partial "
                    "re-run under another name keeps the full run's)")
    ap.add_argument("--recheck", action="store_true", help="measure nothing: check the answers kept in "
                    "benchmarks/results/NAME.json again with this script's comparison, and rewrite its checks")
    a = ap.parse_args()
    if a.recheck:
        return recheck(a.name)
    exit_cleanly_on_sigterm()
    dtype = a.dtype or auto_dtype()
    src = PromptSource()
    results: dict = {}
    runs = ([] if a.skip_native else [("native", None, None)]) + [(f"{m} MB/s", m, None) for m in a.slow_mbps]
    runs += [(f"{m} MB/s", m, a.busy_client) for m in a.busy]
    runs += [("native", None, a.busy_client)] if a.busy_native else []
    labels = {None: "", "prefill": " + busy CPU", "decode": " + a decoding client"}
    setting = (" + page cache kept" if a.page_cache == "keep" else "") + (f" + burst of {a.burst}" if a.burst > 1
                                                                           else "")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meet-bench-") as tmp:
        for model in a.models:
            results[model] = {}
            for disk, mbps, busy in runs:
                results[model][disk + labels[busy] + setting] = run_disk(
                    model, disk, mbps, a.lengths, a.repeats, a.max_repeats, a.point_budget, dtype, src, Path(tmp),
                    busy, a.logs, a.kvpr_choice, a.page_cache == "evict", a.burst)
                save(a.name, summary(results, a, dtype, partial=True))  # what is measured survives a crash
                print(f"[meet] {time.monotonic() - t0:.0f} s so far", flush=True)
    data = summary(results, a, dtype)
    save(a.name, data)
    plot(results, RESULTS / f"{a.name}.png")
    print("verdict:", data["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
