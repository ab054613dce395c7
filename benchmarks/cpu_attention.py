"""Prefix-aware CPU attention vs SGLang's `torch_native`: server TTFT of cold prefill, device hit and SSD hit for
512-4096-token prompts (same prompts, same run; protocol in benchmarks/_harness.py), plus the attention kernels alone
(one layer of SmolLM2's shape: 9 query heads, 3 KV heads, head dim 64, bf16).

    .venv/bin/python benchmarks/cpu_attention.py [--lengths 512 1024 2048 4096] [--repeats 5]

Writes benchmarks/results/cpu_attention.json and .png; prints a one-line verdict. Targets: device hit at 2048
tokens <= 0.1x cold prefill; cold prefill no slower than torch_native.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RESULTS, PromptSource, auto_dtype, machine, plot, run_config, save  # noqa: E402

from sglang_tiered.kernels.extend_attention import extend_attention  # noqa: E402

STEPS = ("cold", "device", "device_settled", "ssd")


def server_args(attention: str, dtype: str):
    def args(store: Path, length: int) -> list[str]:
        return ["--kv-backend", "tiered", "--tiered-ssd-dir", str(store), "--tiered-host-size", "3x",
                "--tiered-stats-interval", "0", "--tiered-cpu-attention", attention, "--dtype", dtype]
    return args


def torch_native_layer(q, k, v, prefix: int) -> torch.Tensor:
    """What SGLang's torch_native backend does for one request: a full-length query, full causal attention."""
    from torch.nn.functional import scaled_dot_product_attention

    total = prefix + q.shape[0]
    full_q = torch.empty(q.shape[1], total, q.shape[2], dtype=q.dtype)
    full_q[:, prefix:] = q.transpose(0, 1)
    out = scaled_dot_product_attention(full_q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, enable_gqa=True)
    return out[0, :, prefix:].transpose(0, 1)


def kernel_times(lengths: list[int], new_tokens: int = 64, repeats: int = 7) -> dict:
    out = {}
    for total in lengths:
        prefix = total - new_tokens
        g = torch.Generator().manual_seed(total)
        q = torch.randn(new_tokens, 9, 64, generator=g).bfloat16()
        kc = torch.randn(total + 1, 3, 64, generator=g).bfloat16()
        vc = torch.randn(total + 1, 3, 64, generator=g).bfloat16()
        r2t = torch.arange(1, total + 1)[None]

        ours = functools.partial(extend_attention, q, kc, vc, r2t, [0], [prefix], [new_tokens])
        theirs = functools.partial(torch_native_layer, q, kc[r2t[0]], vc[r2t[0]], prefix)

        torch.testing.assert_close(ours().float(), theirs().float(), atol=3e-2, rtol=3e-2)
        row = {}
        for name, fn in (("prefix_aware", ours), ("torch_native", theirs)):
            fn()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            row[name] = statistics.median(ts)
        out[str(total)] = row
        print(f"[kernel] {total} tokens, {new_tokens} new: prefix_aware {row['prefix_aware'] * 1e3:.2f} ms, "
              f"torch_native {row['torch_native'] * 1e3:.2f} ms per layer", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default=None)
    p.add_argument("--kernels-only", action="store_true",
                   help="re-measure only the kernel timings and update them in the existing JSON")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: what --dtype auto picks on this machine")
    a = p.parse_args()
    dtype = a.dtype or auto_dtype()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="cpu-attention-"))
    kernels = kernel_times(a.lengths)
    if a.kernels_only:
        path = RESULTS / "cpu_attention.json"
        data = json.loads(path.read_text())
        data["kernel_per_layer_s"] = kernels
        path.write_text(json.dumps(data, indent=1))
        return 0
    prompts = PromptSource()
    results = {name: run_config(name, server_args(name, dtype), a.lengths, a.repeats, work, prompts, steps=STEPS,
                                stored=lambda store: sum(1 for _ in store.rglob("*.kvp")))
               for name in ("prefix_aware", "torch_native")}
    save("cpu_attention", {"machine": machine(), "dtype": dtype, "repeats": a.repeats, "kernel_per_layer_s": kernels,
                           "kernel_dtype": "bfloat16", "model": "SmolLM2-135M-Instruct", "results": results})
    plot(results, RESULTS / "cpu_attention.png", "TTFT: prefix-aware vs torch_native attention (median)")
    print(verdict(results))
    return 0


def verdict(results: dict) -> str:
    key = "2048" if "2048" in results["prefix_aware"] else next(iter(results["prefix_aware"]))
    ours, theirs = results["prefix_aware"][key], results["torch_native"][key]
    hit = ours["device"]["median_s"] / ours["cold"]["median_s"]
    settled = ours["device_settled"]["median_s"] / ours["cold"]["median_s"]
    cold = ours["cold"]["median_s"] / theirs["cold"]["median_s"]
    return (f"cpu_attention @{key} tokens: device hit right after the cold prefill {ours['device']['median_s']:.3f} s"
            f" = {hit:.3f}x cold (target <= 0.1x: {'PASS' if hit <= 0.1 else 'MISS'}), after write-through settled "
            f"{ours['device_settled']['median_s']:.3f} s = {settled:.3f}x ({'PASS' if settled <= 0.1 else 'MISS'}); "
            f"torch_native's hit {theirs['device']['median_s']:.3f} s; "
            f"cold {ours['cold']['median_s']:.3f} s vs torch_native "
            f"{theirs['cold']['median_s']:.3f} s = {cold:.2f}x "
            f"({'PASS' if cold <= 1.05 else 'MISS'}, 5 % noise margin)")


if __name__ == "__main__":
    sys.exit(main())
