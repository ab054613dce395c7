"""Fusion of stored chunk KV (CacheBlend) on the layer-by-layer engine: quality and speed of every mode.

Quality (real SmolLM2, `sglang_tiered.rag_questions`, chat-formatted: 6 essay chunks of 128 tokens, two holding the two
facts a question needs): per mode, answer exact match / F1 against the gold city, agreement of the greedy answer
(at most 32 tokens, ending at the end-of-turn token as the server's output does) with full prefill's, per position over
the longer of the two, the share of answers identical to full prefill's, per-layer attention deviation of the last
prompt token (||attn - attn_full|| / ||attn_full||) and the recomputed fraction of token-layers. The F1 and EM
differences to full prefill come with a paired bootstrap 95 % interval over the questions.

Fidelity (same question set, more questions, no generation): per mode, KL(full || mode) of the first answer token's
distribution, its argmax agreement, the relative KV deviation over the whole prompt, the last token's attention
deviation; blend - single and blend - reuse with paired bootstrap intervals.

Speed: TTFT (prefill + first token) of 6 chunks x 512 tokens + a question for every mode, stored KV in memory, and
`blend` with the stored KV read from the SSD tier (page cache dropped when permitted) at the fixed 15 % and at the
loading controller's ratio. Medians of repeats, same process.

    .venv/bin/python benchmarks/blend.py [--questions 32] [--fidelity-questions 128] [--repeats 5]
                                         [--dtype bfloat16] [--part both|quality|fidelity|speed]

Writes benchmarks/results/blend.json and .png; prints a one-line verdict. Targets at 15 %: >= 95 % token agreement
with full prefill (or F1 within 0.02), better than full reuse and than single-check-layer; blend TTFT <= 1/3 of full.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, auto_dtype, bootstrap, drop_page_cache, machine, save  # noqa: E402

from sglang_tiered.engine.blend import MODES, Span, blend_prefill, greedy_continue, observe  # noqa: E402
from sglang_tiered.engine.tuning import load_model  # noqa: E402
from sglang_tiered.models import default_model_path  # noqa: E402
from sglang_tiered.policy.loading import LoadingController  # noqa: E402
from sglang_tiered.rag_questions import answer_em, build, chat_parts, f1  # noqa: E402
from sglang_tiered.storage.chunk_store import ChunkStore, chunk_key  # noqa: E402
from sglang_tiered.storage.namespace import Namespace  # noqa: E402
from sglang_tiered.storage.ssd_tier import SSDTier  # noqa: E402

QUALITY_CHUNK_TOKENS = 128  # keeps a question at ~1 min (fp32, 5 modes x 32 greedy steps); speed uses 512
SPEED_CHUNK_TOKENS = 512
GEN_TOKENS = 32


def encode(tok, q, chunk_tokens: int) -> tuple[torch.Tensor, list[Span]]:
    """Chat-formatted prompt: the template's head (fresh), each chunk tokenized on its own and cut to
    `chunk_tokens` (stored), the question and the assistant turn (fresh)."""
    head, chunks, tail = chat_parts(tok, q)
    parts = [(tok(head, add_special_tokens=False).input_ids, False)]
    parts += [(tok(c, add_special_tokens=False).input_ids[:chunk_tokens], True) for c in chunks]
    parts.append((tok(tail, add_special_tokens=False).input_ids, False))
    spans, pos, ids = [], 0, []
    for toks, stored in parts:
        spans.append(Span(pos, pos + len(toks), stored))
        pos += len(toks)
        ids += toks
    return torch.tensor(ids), spans


def traced_blends(model, tok, q, modes, ratio: float) -> dict:
    """mode -> (BlendResult, {layer: attention output of the last prompt token}) for question `q`'s prompt, the
    chunks' KV computed standalone (what the chunk store would hold)."""
    ids, spans = encode(tok, q, QUALITY_CHUNK_TOKENS)
    kvs = {i: model.prefill(ids[s.start : s.end]).kv for i, s in enumerate(spans) if s.stored}
    out = {}
    for mode in modes:
        attn: dict[int, torch.Tensor] = {}
        r = blend_prefill(model, ids, spans, lambda layer, i: kvs[i][layer], mode=mode, ratio=ratio,
                 trace=lambda layer, pos, a, attn=attn: attn.__setitem__(layer, a[-1].float().clone()))
        out[mode] = (r, attn)
    return out


def attention_deviation(attn: dict, ref_attn: dict) -> list[float]:
    """Per layer: ||attn - attn_full|| / ||attn_full|| of the last prompt token."""
    return [float((attn[i] - ref_attn[i]).norm() / ref_attn[i].norm()) for i in sorted(attn)]


def quality(model, tok, n_questions: int, ratio: float) -> dict:
    per_mode = {m: {"em": [], "f1": [], "agree": [], "same": [], "dev": [], "frac": [], "text": []} for m in MODES}
    stop = frozenset(t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if t is not None)
    for qi, q in enumerate(build(n_questions, chunk_chars=QUALITY_CHUNK_TOKENS * 5)):
        outs = {mode: (greedy_continue(model, r.kv, r.logits, GEN_TOKENS, stop), attn, r.recompute_fraction)
                for mode, (r, attn) in traced_blends(model, tok, q, MODES, ratio).items()}
        ref_gen, ref_attn, _ = outs["full"]
        for mode, (gen, attn, frac) in outs.items():
            text = tok.decode(gen)
            row = per_mode[mode]
            row["em"].append(float(answer_em(text, q.answer)))
            row["f1"].append(f1(text, q.answer))
            row["agree"].append(sum(a == b for a, b in zip(gen, ref_gen)) / max(len(gen), len(ref_gen)))
            row["same"].append(float(gen == ref_gen))
            row["text"].append(text)
            row["dev"].append(attention_deviation(attn, ref_attn))
            row["frac"].append(frac)
        print(f"[quality] question {qi + 1}/{n_questions} ({q.answer}): "
              + ", ".join(f"{m} f1={per_mode[m]['f1'][-1]:.2f} agree={per_mode[m]['agree'][-1]:.2f}"
                          for m in MODES), flush=True)
    out = {}
    for mode, row in per_mode.items():
        layers = len(row["dev"][0])
        out[mode] = {"exact_match": statistics.mean(row["em"]), "f1": statistics.mean(row["f1"]),
                     "token_agreement": statistics.mean(row["agree"]),
                     "identical_answers": statistics.mean(row["same"]),
                     "f1_minus_full": paired_interval(row["f1"], per_mode["full"]["f1"]),
                     "em_minus_full": paired_interval(row["em"], per_mode["full"]["em"]),
                     "answers": row["text"],
                     "recompute_fraction": statistics.mean(row["frac"]),
                     "attention_deviation_per_layer": [statistics.mean(d[i] for d in row["dev"])
                                                       for i in range(layers)]}
    return out


FIDELITY_MODES = ("reuse", "single", "blend")


def fidelity(model, tok, n_questions: int, ratio: float) -> dict:
    """Closeness to full prefill without generating (cheap, so over many questions): per question and mode, the KL
    divergence KL(full || mode) of the first answer token's distribution, whether its argmax matches, the relative KV
    deviation over all layers and tokens, and the mean attention deviation of the last prompt token. Means, and the
    paired bootstrap interval of blend - single and blend - reuse for each metric."""
    rows = {m: {"kl": [], "top1": [], "kv_dev": [], "attn_dev": []} for m in FIDELITY_MODES}
    for qi, q in enumerate(build(n_questions, chunk_chars=QUALITY_CHUNK_TOKENS * 5)):
        results = traced_blends(model, tok, q, ("full", *FIDELITY_MODES), ratio)
        ref, ref_attn = results["full"]
        ref_logp = ref.logits.float().log_softmax(-1)
        for mode in FIDELITY_MODES:
            r, attn = results[mode]
            logp = r.logits.float().log_softmax(-1)
            row = rows[mode]
            row["kl"].append(float((ref_logp.exp() * (ref_logp - logp)).sum()))
            row["top1"].append(float(int(r.logits.argmax()) == int(ref.logits.argmax())))
            row["kv_dev"].append(float((r.kv.float() - ref.kv.float()).norm() / ref.kv.float().norm()))
            row["attn_dev"].append(statistics.mean(attention_deviation(attn, ref_attn)))
        if (qi + 1) % 16 == 0:
            print(f"[fidelity] {qi + 1}/{n_questions} questions", flush=True)
    out: dict = {m: {k: statistics.mean(v) for k, v in row.items()} for m, row in rows.items()}
    for other in ("single", "reuse"):
        out[f"blend_minus_{other}"] = {k: paired_interval(rows["blend"][k], rows[other][k]) for k in rows["blend"]}
    out["questions"] = n_questions
    return out


def paired_interval(xs: list[float], ref: list[float], draws: int = 10000) -> dict:
    """Mean of xs - ref over the questions and its paired bootstrap 95 % interval (seeded)."""
    d = [x - r for x, r in zip(xs, ref)]
    low, high = bootstrap(d, draws)
    return {"mean": statistics.mean(d), "low": low, "high": high}


def speed(model, tok, repeats: int, ratio: float) -> dict:
    q = build(1, seed=7)[0]
    ids, spans = encode(tok, q, SPEED_CHUNK_TOKENS)
    cfg = model.cfg
    ns = Namespace(model="smollm2-bench", dtype=str(model.dtype), page_size=0, layout="chunk-kv", layer_num=cfg.layers,
                   kv_heads=cfg.kv_heads, head_dim=cfg.head_dim)
    tmp = tempfile.TemporaryDirectory(prefix="blend-bench-")
    ssd = SSDTier(Path(tmp.name), ns, 1 << 33)
    mem = ChunkStore(layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=model.dtype,
                     memory_bytes=1 << 33)
    disk = ChunkStore(layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=model.dtype,
                      memory_bytes=0, ssd=ssd)
    keys = {}
    for i, s in enumerate(spans):
        if s.stored:
            keys[i] = chunk_key(ids[s.start : s.end].tolist())
            kv = model.prefill(ids[s.start : s.end]).kv
            mem.put(keys[i], kv)
            disk.put(keys[i], kv)
    disk.flush()

    def loader(store):
        return lambda layer, i: store.layer(keys[i], layer, spans[i].length)

    controller = LoadingController(floor=ratio)
    bytes_per_token_layer = 2 * cfg.kv_heads * cfg.head_dim * model.dtype.itemsize
    reused = sum(s.length for s in spans if s.stored)

    def run(mode, store, r, cold=False):
        times = []
        for _ in range(repeats):
            if cold:
                drop_page_cache()
            t0 = time.perf_counter()
            res = blend_prefill(model, ids, spans, loader(store), mode=mode, ratio=r)
            int(res.logits.argmax())  # the first token
            times.append(time.perf_counter() - t0)
            if mode == "blend":
                observe(controller, res, reused, bytes_per_token_layer, times[-1])
        return {"median_s": statistics.median(times), "samples_s": times, "ratio": r,
                "recompute_fraction": res.recompute_fraction, "load_wait_s": res.load_wait_s}

    blend_prefill(model, ids[:600], [Span(0, 600, False)], loader(mem), mode="full")  # warm-up
    out = {m: run(m, mem, ratio) for m in MODES}
    out["blend_ssd"] = run("blend", disk, ratio, cold=True)
    chosen = controller.ratio(reused, bytes_per_token_layer)
    out["blend_ssd_controller"] = run("blend", disk, chosen, cold=True)
    out["tokens"] = int(ids.shape[0])
    out["page_cache_dropped"] = drop_page_cache()
    out["controller"] = controller.describe()
    ssd.close()
    tmp.cleanup()
    for m in [*MODES, "blend_ssd", "blend_ssd_controller"]:
        print(f"[speed] {m}: {out[m]['median_s']:.3f} s (ratio {out[m]['ratio']:.3f})", flush=True)
    return out


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    if "quality" in data:
        qd = data["quality"]
        ax = axes[0]
        xs = range(len(MODES))
        ax.bar([x - 0.2 for x in xs], [qd[m]["token_agreement"] for m in MODES], 0.4, label="token agreement")
        ax.bar([x + 0.2 for x in xs], [qd[m]["f1"] for m in MODES], 0.4, label="answer F1")
        ax.set_xticks(list(xs), MODES)
        ax.set_title("quality vs full prefill")
        ax.legend(fontsize=8)
        for m in MODES:
            axes[1].plot(qd[m]["attention_deviation_per_layer"], label=m)
        axes[1].set_xlabel("layer")
        axes[1].set_ylabel("attention deviation (last token)")
        axes[1].set_yscale("symlog", linthresh=1e-3)
        axes[1].legend(fontsize=8)
    if "speed" in data:
        sd = data["speed"]
        names = [m for m in [*MODES, "blend_ssd", "blend_ssd_controller"] if m in sd]
        axes[2].bar(names, [sd[m]["median_s"] for m in names])
        axes[2].set_ylabel("TTFT, median (s)")
        axes[2].set_title(f"{sd['tokens']} tokens")
        axes[2].tick_params(axis="x", rotation=30)
    if "fidelity" in data:
        fd = data["fidelity"]
        axes[3].bar(FIDELITY_MODES, [fd[m]["kl"] for m in FIDELITY_MODES])
        axes[3].set_ylabel("first-token KL(full || mode), nats")
        axes[3].set_title(f"fidelity, {fd['questions']} questions")
    fig.tight_layout()
    fig.savefig(RESULTS / "blend.png", dpi=110)


def verdict(data: dict, ratio: float) -> str:
    parts = []
    if "quality" in data:
        q = data["quality"]
        b, single, reuse = q["blend"], q["single"], q["reuse"]
        d = b.get("f1_minus_full", {"mean": b["f1"] - q["full"]["f1"], "low": float("nan"), "high": float("nan")})
        dev = {m: sum(q[m]["attention_deviation_per_layer"]) for m in ("blend", "single", "reuse")}
        checks = {
            # the bar: >= 95 % agreement, or F1 within 0.02 of full prefill (read as: not lower by more)
            "agreement>=0.95 or F1>=full-0.02": b["token_agreement"] >= 0.95 or d["mean"] >= -0.02,
            "better than full reuse": b["token_agreement"] > reuse["token_agreement"] and dev["blend"] < dev["reuse"],
            "better than single check layer": b["token_agreement"] > single["token_agreement"]
            or (b["token_agreement"] == single["token_agreement"] and dev["blend"] < dev["single"]),
        }
        fid = data.get("fidelity")
        if fid:  # many questions, paired: blend's KL and KV deviation both below single's, interval below 0
            vs = fid["blend_minus_single"]
            checks["better than single check layer"] = vs["kl"]["high"] < 0 and vs["kv_dev"]["high"] < 0
        verdicts = ", ".join(f"{k} {'MET' if v else 'MISSED'}" for k, v in checks.items())
        parts.append(f"quality {'MET' if all(checks.values()) else 'MISSED'} ({verdicts}): blend agreement "
                     f"{b['token_agreement']:.3f} (single {single['token_agreement']:.3f}, reuse "
                     f"{reuse['token_agreement']:.3f}), F1 blend - full {d['mean']:+.3f} "
                     f"[{d['low']:+.3f}, {d['high']:+.3f}]"
                     + (f", first-token KL blend {fid['blend']['kl']:.4f} vs single {fid['single']['kl']:.4f} "
                        f"(difference [{vs['kl']['low']:+.4f}, {vs['kl']['high']:+.4f}], {fid['questions']} "
                        f"questions)" if fid else ""))
    if "speed" in data:
        s = data["speed"]
        x = s["full"]["median_s"] / s["blend"]["median_s"]
        parts.append(f"speed {'MET' if x >= 3 else 'MISSED'}: blend {x:.2f}x faster than full prefill "
                     f"({s['blend']['median_s']:.2f} vs {s['full']['median_s']:.2f} s; prefix caching "
                     f"{s['prefix']['median_s']:.2f} s)")
    return f"blend @ {ratio:.0%}: " + "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--fidelity-questions", type=int, default=128, help="questions for the no-generation metrics")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: what --dtype auto picks on this machine")
    p.add_argument("--quality-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--part", default="both", choices=["quality", "fidelity", "speed", "both"],
                   help="quality = generation + fidelity; both = everything")
    a = p.parse_args()
    a.dtype = a.dtype or auto_dtype()
    from transformers import AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path))
    data: dict = {"machine": machine(), "ratio": a.ratio, "chunks": 6, "quality_chunk_tokens": QUALITY_CHUNK_TOKENS,
                  "speed_chunk_tokens": SPEED_CHUNK_TOKENS,
                  "model": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads()}
    if a.part in ("quality", "fidelity", "both"):
        model = load_model(("pretrained", str(path)), getattr(torch, a.quality_dtype))
        if a.part != "fidelity":
            data["quality"] = quality(model, tok, a.questions, a.ratio)
            data["quality_dtype"], data["questions"] = a.quality_dtype, a.questions
        data["fidelity"] = {**fidelity(model, tok, a.fidelity_questions, a.ratio), "dtype": a.quality_dtype}
    if a.part in ("speed", "both"):
        model = load_model(("pretrained", str(path)), getattr(torch, a.dtype))
        data["speed"] = speed(model, tok, a.repeats, a.ratio)
        data["speed_dtype"], data["repeats"] = a.dtype, a.repeats
    previous = RESULTS / "blend.json"
    if a.part != "both" and previous.exists():  # keep the other part's last results
        data = {**json.loads(previous.read_text()), **data}
    save("blend", data)
    plot(data)
    print(verdict(data, a.ratio))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
