"""Does `--dtype auto` pick the faster dtype of this CPU? Cold TTFT of a server with `--dtype auto` against servers
forced to bfloat16 and float32, same prompts, same run -- natively, and with the CPU restricted to AVX2
(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: no AVX-512 BF16 / AMX kernels, as on an AVX2-only machine;
both variables are torch's and oneDNN's own switches, they only remove instructions).

Per (machine mode, dtype, length): a server, one warm-up, then `--repeats` prompts never seen before (disjoint
slices of the essays), greedy, max_new_tokens=1 (client-side latency = TTFT).

    .venv/bin/python benchmarks/cpu_dtype.py [--lengths 1024 2048] [--repeats 3] [--modes native avx2]

Writes benchmarks/results/cpu_dtype.json and .png and prints a one-line verdict: in each mode, auto's TTFT is within
10 % of the faster forced dtype's.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, PromptSource, machine, save  # noqa: E402

from sglang_tiered.server_process import ServerProcess  # noqa: E402

MODES = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
DTYPES = ("auto", "bfloat16", "float32")


def run(modes: list[str], lengths: list[int], repeats: int) -> dict:
    source = PromptSource()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            out[mode] = {}
            for dtype in DTYPES:
                args = ["--kv-backend", "tiered", "--max-total-tokens", str(max(lengths) * (repeats + 2) + 1024),
                        "--tiered-ssd-dir", f"{tmp}/{mode}-{dtype}", "--tiered-stats-interval", "0",
                        "--dtype", dtype]
                log = Path(tmp) / f"{mode}-{dtype}.log"
                rows: dict = {}
                with ServerProcess(args, log_path=log, env=MODES[mode]) as s:
                    s.generate(source.take(64), max_new_tokens=1)
                    for n in lengths:
                        times = [s.generate(source.take(n), max_new_tokens=1, timeout=1800)["latency_s"]
                                 for _ in range(repeats)]
                        rows[str(n)] = {"median_s": statistics.median(times), "times_s": times}
                        print(f"[{mode}] --dtype {dtype:<8} {n} tokens: {statistics.median(times):.3f} s", flush=True)
                    chosen = [ln for ln in s.log_lines("--dtype auto on this CPU:")]
                if chosen:
                    rows["chosen"] = re.search(r"on this CPU: (\w+)", chosen[0]).group(1)
                    rows["log"] = chosen[0].split("sglang-tiered: ", 1)[-1]
                out[mode][dtype] = rows
    return out


def plot(results: dict, lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    width = 0.8 / len(DTYPES)
    for ax, (mode, by_dtype) in zip(axes[0], results.items()):
        for i, dtype in enumerate(DTYPES):
            label = f"auto ({by_dtype['auto'].get('chosen', '?')})" if dtype == "auto" else dtype
            ax.bar([j + i * width for j in range(len(lengths))],
                   [by_dtype[dtype][str(n)]["median_s"] for n in lengths], width, label=label)
        ax.set_xticks([j + width for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
        ax.set_title(f"CPU: {mode}")
        ax.set_ylabel("cold TTFT, median (s)")
        ax.legend(fontsize=8)
    fig.suptitle("--dtype auto vs forced dtypes (SmolLM2-135M, CPU server)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    a = p.parse_args()
    results = run(a.modes, a.lengths, a.repeats)
    verdicts = []
    for by_dtype in results.values():
        for n in a.lengths:
            auto = by_dtype["auto"][str(n)]["median_s"]
            best = min(by_dtype[d][str(n)]["median_s"] for d in ("bfloat16", "float32"))
            verdicts.append(auto <= 1.10 * best)
            by_dtype["auto"][str(n)]["vs_best"] = auto / best
    save("cpu_dtype", {"machine": machine(), "repeats": a.repeats, "lengths": a.lengths, "modes": MODES,
                       "results": results})
    plot(results, a.lengths, RESULTS / "cpu_dtype.png")
    summary = "; ".join(
        f"{mode}: auto chose {r['auto'].get('chosen')}, "
        + ", ".join(f"{n} tok {r['auto'][str(n)]['vs_best']:.2f}x the faster forced dtype" for n in a.lengths)
        for mode, r in results.items())
    print(f"VERDICT: {'PASS' if all(verdicts) else 'FAIL'}: --dtype auto within 10 % of the faster dtype "
          f"everywhere ({summary})")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
