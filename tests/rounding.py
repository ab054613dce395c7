"""Does this CPU's torch round a row of a batched computation the same whatever else is in the batch?

That is the condition under which a part of a prompt computed alone (the two-sided load's front, `engine/meet.py`)
can equal SGLang's prefill of the whole prompt bit for bit. Measured (torch 2.13, 2 threads):
  * AMD EPYC with AVX-512 BF16, no AMX: yes, in fp32 and bf16 (the bit-for-bit tests pass there);
  * Intel Xeon with AMX: no. Linear layers (oneDNN / MKL pick kernels by the batch's shape): in fp32 a 1536 -> 576
    projection rounds 64-192 rows otherwise than 3000; in bf16 most row counts differ. Flash attention in bf16: a call
    of 14-63 queries rounds otherwise than a longer one.
Tests that compare our computed pages with SGLang's own bit for bit ask these probes first: where rows round alone
they assert equality, elsewhere closeness (and, in fp32, the same greedy tokens), and say which in the message.
"""

from __future__ import annotations

import functools

import torch

from sglang_tiered.kernels.extend_attention import _sdpa, causal_attention

ROWS = 1400  # the batch a part is compared against
SMOLLM2 = (576, 3 * 64, 1536)  # the embedded model's hidden size, KV width and intermediate size
PARTS = (1, 8, 16, 24, 32, 40, 48, 56, 60, 64, 100, 192, 256, 320, 512, 1024)  # row counts of the parts tried
SEEDS = 3  # data sets tried by the attention probe (a kernel's difference shows only in some elements)

# |log-prob difference| between two roundings of one computation, where rows do not round alone (measured on Intel
# Xeons with AMX: KV pages computed apart, fp32 up to 5e-6, bf16 up to 0.17; prefix-aware attention against
# torch_native, bf16 up to 0.12 -- one to two bf16 steps of a logit between 16 and 32, 0.125 each)
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05}


@functools.cache
def linear_rows_alone(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> bool:
    """True if `x[a:b] @ W.T` equals rows a..b of `x @ W.T` bit for bit for every weight shape (in, out) in `shapes`
    and every part of PARTS rows, at the start, in the middle and at the end of the batch."""
    g = torch.Generator().manual_seed(0)
    for fan_in, fan_out in shapes:
        w = (torch.randn(fan_out, fan_in, generator=g) * fan_in**-0.5).to(dtype)
        x = torch.randn(ROWS, fan_in, generator=g).to(dtype)
        whole = torch.nn.functional.linear(x, w)
        for n in PARTS:
            for a in (0, (ROWS - n) // 2, ROWS - n):
                if not torch.equal(torch.nn.functional.linear(x[a : a + n], w), whole[a : a + n]):
                    return False
    return True


@functools.cache
def attention_rows_alone(dtype: torch.dtype, heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> bool:
    """True if a call of the last n queries (masked as causal) over the same keys gives those queries the bits that
    one causal call over all ROWS gives them, for every n in PARTS (SEEDS data sets)."""
    for seed in range(SEEDS):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(ROWS, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        whole = causal_attention(q, k, v, 0)
        for n in PARTS:
            mask = torch.arange(ROWS)[None, :] <= torch.arange(ROWS - n, ROWS)[:, None]
            if not torch.equal(_sdpa(q[ROWS - n :], k, v, mask, False, None), whole[ROWS - n :]):
                return False
    return True


def model_shapes(hidden: int, kv_dim: int, intermediate: int) -> tuple[tuple[int, int], ...]:
    """The (in, out) shapes of a Llama layer's projections: q, k/v, o, gate/up, down."""
    return ((hidden, hidden), (hidden, kv_dim), (hidden, intermediate), (intermediate, hidden))


def rows_alone(dtype: torch.dtype, hidden: int, kv_dim: int, intermediate: int) -> bool:
    """Both probes, at a model's shapes."""
    return linear_rows_alone(dtype, model_shapes(hidden, kv_dim, intermediate)) and attention_rows_alone(dtype)
