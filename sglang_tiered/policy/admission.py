"""Admission of requests that prefill alone (a blended, sparse-loaded or compute-or-load forward computes an extend
batch of exactly one request) into SGLang's prefill batches. Pure: no SGLang.

SGLang walks its waiting queue in order and asks for each request whether it joins the prefill batch being built.
`admit` answers for one request from what the batch holds so far:
* `stop`: the batch holds a request that prefills alone; nothing joins it (the walk ends, as when the token budget
  runs out).
* `skip`: the request stays queued for a later round and the walk goes on, so the requests queued behind it may
  still join (SGLang's own way of passing over a LoRA or pooling-mode request it cannot batch). A request that
  prefills alone is skipped when the batch already has a request, and once when it is first in line: an ordinary
  request (a follow-up turn's short extend over cached KV) then never waits behind a solo forward queued ahead of
  it, and the solo request waits at most one round for them (FCFS order keeps it first in line until admitted).
* `join`: SGLang's own admission decides (token budget, memory).
With `pass_over=False` (an ablation: `SGLANG_TIERED_ADMISSION=close`) a request that prefills alone is never skipped:
it closes the batch if the batch has a request, and joins an empty one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Verdict = Literal["join", "skip", "stop"]


def admit(batch: Sequence[bool], alone: bool, yielded: bool, pass_over: bool = True) -> Verdict:
    """`batch`: for each request already in the batch, whether it prefills alone; `alone`: whether the candidate
    does; `yielded`: whether the candidate has been skipped before (the caller records every `skip`)."""
    if any(batch):
        return "stop"
    if not alone:
        return "join"
    if not pass_over:
        return "stop" if batch else "join"
    if batch or not yielded:
        return "skip"
    return "join"
