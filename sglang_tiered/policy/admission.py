"""Admission of requests that prefill alone (a blended, sparse-loaded or compute-or-load forward computes an extend
batch of exactly one request) into SGLang's prefill batches. Pure: no SGLang.

SGLang walks its waiting queue in order and asks for each request whether it joins the prefill batch being built.
`admit` answers for one request from what the batch holds so far:
* `stop`: the batch holds a request that prefills alone, or the candidate prefills alone and the batch already has a
  request. The walk ends (as when the token budget runs out); the candidate stays queued, and is admitted alone in a
  round in which it comes first.
* `join`: SGLang's own admission decides (token budget, memory).
Passing over a solo request instead (SGLang's skip, so that the requests queued behind it batch first) was measured
against this in one run of benchmarks/rag_turns.py (Intel Xeon with AMX, bf16): later turns 1.01x [0.89, 1.24] and
first turns 0.97x [0.82, 1.08] as fast over the grid, so a solo request closes the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Verdict = Literal["join", "stop"]


def admit(batch: Sequence[bool], alone: bool) -> Verdict:
    """`batch`: for each request already in the batch, whether it prefills alone; `alone`: whether the candidate
    does."""
    if any(batch) or (alone and len(batch) > 0):
        return "stop"
    return "join"
