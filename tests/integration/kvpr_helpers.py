"""What the partial-recompute (KVPR) server tests share: the multi-head-attention model they serve (random weights),
its page size, a greedy request with an optional per-request mode, and the loader's counters."""

from __future__ import annotations

import time

from sglang_tiered.engine.llama import LlamaConfig
from sglang_tiered.server_process import ServerProcess, metric_total

MHA = LlamaConfig(hidden=576, layers=6, heads=9, kv_heads=9, head_dim=64, intermediate=1536, vocab=49152)
PAGE = 64


def ask(s: ServerProcess, prompt: str | list[int], mode=None, logprobs: bool = False) -> dict:
    """10 greedy tokens of a text or of token ids; `mode` sets the request's `tiered_kvpr` custom parameter;
    `logprobs`: also the output tokens' log-probabilities (`token_logprobs`)."""
    params: dict = {"max_new_tokens": 10, "temperature": 0}
    if mode is not None:
        params["custom_params"] = {"tiered_kvpr": mode}
    request = {"input_ids" if isinstance(prompt, list) else "text": prompt, "sampling_params": params}
    if logprobs:
        request["return_logprob"] = True
    status, body = s.request("/generate", request)
    assert status == 200, body
    return body


def token_logprobs(out: dict) -> list[float]:
    """The output tokens' log-probabilities of a reply to `ask(..., logprobs=True)`."""
    return [row[0] for row in out["meta_info"]["output_token_logprobs"]]


def counter(s: ServerProcess, name: str) -> float:
    return metric_total(s.get("/metrics"), f"sglang_tiered:kvpr_{name}_total")


def wait_for_activations(s: ServerProcess, pages: int) -> None:
    """Until `pages` activation pages reached the SSD tier (written after the KV, asynchronously); at most 60 s."""
    deadline = time.monotonic() + 60
    while counter(s, "activation_pages_written") < pages and time.monotonic() < deadline:
        time.sleep(0.3)
    assert counter(s, "activation_pages_written") >= pages
