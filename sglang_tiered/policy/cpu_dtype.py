"""The prefill dtype of a CPU-only server, chosen by measurement on this machine (`--dtype auto`).

CPUs differ by a factor of several in what each dtype costs: with AVX-512 BF16 or AMX a bf16 matmul is faster
than fp32 on some CPUs (measured 2.5x on an AMD EPYC), not on others (an Intel Xeon with AVX-512 BF16 but no AMX:
fp32 1.7x faster), while on an AVX2-only CPU torch emulates bf16 and the same matmul is about 5x slower than fp32. A
fixed rule picks wrong on one of them, so `choose_dtype` times the served model's own linear layers -- one decoder
layer's projections and MLP over `tokens` rows -- in every candidate dtype, interleaved over several rounds, and
picks the fastest (each dtype's best round: interference only ever adds time). A dtype within `tie` of the fastest
and smaller than it wins the tie: half the bytes per KV page means twice the tokens per pool and half the SSD
traffic.

The choice is part of every stored page's namespace, so a restart that chose differently would find the whole SSD
tier foreign. A choice is therefore made once per machine and model (`signature`) and kept (`DtypeChoice.record` /
`from_record`, in a file the caller keeps beside the KV it stores): a restart on the same machine reuses it.

Candidates: float32 and bfloat16 (a bf16 or fp32 checkpoint runs in both without overflow); float16 only for a
checkpoint stored in float16 (a bf16-trained model can overflow in fp16). The measurement takes about 0.1 s at
startup; torch only, no SGLang.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" | "bfloat16" | "float16"
    seconds: dict[str, float] = field(default_factory=dict)  # median time of the probe per candidate
    capability: str = ""  # torch.backends.cpu.get_cpu_capability()
    flags: tuple[str, ...] = ()  # the CPU flags (of CPU_FLAGS) this machine has
    measured_at: str = ""  # when it was measured (UTC, ISO 8601)

    @property
    def speedup(self) -> float:
        """Slowest candidate's time over the chosen one's."""
        return max(self.seconds.values()) / self.seconds[self.dtype]

    def describe(self) -> str:
        times = ", ".join(f"{d} {s * 1000:.1f} ms" for d, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        return (f"{self.dtype} (CPU capability {self.capability or '?'}, flags {','.join(self.flags) or 'none'}; "
                f"one layer's linears: {times}; {self.speedup:.2f}x the slowest)")


    def record(self) -> dict:
        """A JSON-able record of the choice (see `from_record`)."""
        return {"dtype": self.dtype, "seconds": self.seconds, "capability": self.capability,
                "flags": list(self.flags), "measured_at": self.measured_at}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> DtypeChoice:
        """The choice a `record` describes; ValueError if it is not one."""
        try:
            dtype, seconds = str(rec["dtype"]), {str(k): float(v) for k, v in rec["seconds"].items()}
            choice = cls(dtype, seconds, str(rec.get("capability", "")), tuple(rec.get("flags", ())),
                         str(rec.get("measured_at", "")))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a dtype record: {exc}") from None
        if dtype not in BYTES or dtype not in seconds:
            raise ValueError(f"not a dtype record: dtype {dtype!r}")
        return choice


def signature(model: str) -> str:
    """What a choice depends on: this CPU (torch's capability, the CPU flags, the model name), torch's version and
    the model (`model`: its fingerprint)."""
    return "|".join([torch.backends.cpu.get_cpu_capability(), ",".join(cpu_flags()), cpu_model(),
                     f"torch {torch.__version__}", model])


def cpu_model() -> str:
    """/proc/cpuinfo's model name ("" where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> tuple[str, ...]:
    """The CPU_FLAGS present in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in CPU_FLAGS if flag in have)
    except OSError:
        pass
    return ()


def candidates(checkpoint_dtype: str | None) -> list[str]:
    """Dtypes worth timing for a checkpoint stored in `checkpoint_dtype` (config.json's torch_dtype / dtype)."""
    out = ["bfloat16", "float32"]
    if checkpoint_dtype == "float16":
        out.append("float16")
    return out


def layer_shapes(cfg: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(out_features, in_features) of one Llama-style decoder layer's linears, from a Hugging Face config dict."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    inter = cfg["intermediate_size"]
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
            (hidden, inter)]


def time_linears(shapes: Sequence[tuple[int, int]], dtypes: Sequence[str], tokens: int,
                 rounds: int) -> dict[str, float]:
    """Seconds of one pass over `shapes` with `tokens` rows, per dtype: the best of `rounds` rounds that time every
    dtype in turn (interleaved: a slow moment of the machine costs every dtype alike), after two warm-up passes."""
    g = torch.Generator().manual_seed(0)
    data = {}
    for d in dtypes:
        dtype = getattr(torch, d)
        data[d] = ([torch.randn(o, i, generator=g).to(dtype) for o, i in shapes],
                   [torch.randn(tokens, i, generator=g).to(dtype) for _, i in shapes])
    best = {d: float("inf") for d in dtypes}
    for r in range(rounds + 2):
        for d in dtypes:
            weights, inputs = data[d]
            t0 = time.perf_counter()
            for x, w in zip(inputs, weights):
                F.linear(x, w)
            if r >= 2:
                best[d] = min(best[d], time.perf_counter() - t0)
    return best


def choose_dtype(cfg: Mapping[str, Any], *, tokens: int = 128, rounds: int = 7, tie: float = 0.10) -> DtypeChoice:
    """Time every candidate on the model's layer shapes and pick the fastest (see the module docstring)."""
    seconds = time_linears(layer_shapes(cfg), candidates(cfg.get("torch_dtype") or cfg.get("dtype")), tokens, rounds)
    fastest = min(seconds, key=seconds.get)
    close = [d for d, s in seconds.items() if s <= seconds[fastest] * (1 + tie)]
    chosen = min(close, key=lambda d: (BYTES[d], seconds[d]))
    return DtypeChoice(chosen, seconds, torch.backends.cpu.get_cpu_capability(), cpu_flags(),
                       datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
