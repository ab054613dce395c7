"""What the compute-or-load server tests share: the multi-head-attention model they serve (random weights),
its page size, a greedy request with an optional per-request mode, and the loader's counters."""

from __future__ import annotations

import time

from sglang_tiered.engine.llama import LlamaConfig
from sglang_tiered.server_process import ServerProcess, metric_total
from tests.rounding import LOGPROB_TOL

MHA = LlamaConfig(hidden=576, layers=6, heads=9, kv_heads=9, head_dim=64, intermediate=1536, vocab=49152)
PAGE = 64


def greedy(mode=None) -> dict:
    """Sampling parameters of 10 greedy tokens; `mode` sets the request's `tiered_kvpr` custom parameter."""
    params: dict = {"max_new_tokens": 10, "temperature": 0}
    if mode is not None:
        params["custom_params"] = {"tiered_kvpr": mode}
    return params


def ask(s: ServerProcess, prompt: str | list[int], mode=None, logprobs: bool = False) -> dict:
    """10 greedy tokens of a text or of token ids (`greedy(mode)`); `logprobs`: also the output tokens'
    log-probabilities (`token_logprobs`)."""
    request = {"input_ids" if isinstance(prompt, list) else "text": prompt, "sampling_params": greedy(mode)}
    if logprobs:
        request["return_logprob"] = True
    status, body = s.request("/generate", request)
    assert status == 200, body
    return body


def token_logprobs(out: dict) -> list[float]:
    """The output tokens' log-probabilities of a reply to `ask(..., logprobs=True)`."""
    return [row[0] for row in out["meta_info"]["output_token_logprobs"]]


def assert_as_sglangs_load(out: dict, native: dict, dtype: str, exact: bool, what) -> None:
    """Our load's reply `out` gives what SGLang's own load gave (`native`; both from `ask(..., logprobs=True)`): the
    same greedy tokens, and the same log-probabilities bit for bit where `exact` -- this CPU rounds a row of a batch
    alone (`tests/rounding.py`), so pages computed apart round as SGLang's prefill of the whole prompt. Elsewhere
    the computed pages differ from SGLang's by the kernels' rounding: log-probabilities within LOGPROB_TOL[dtype]."""
    got, want = token_logprobs(out), token_logprobs(native)
    assert out["output_ids"] == native["output_ids"], (what, got, want)
    if exact:
        assert got == want, (what, "bit for bit", got, want)
    else:
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= LOGPROB_TOL[dtype], (what, f"rows not rounded alone here: {worst:.3g} apart", got, want)


def counter(s: ServerProcess, name: str) -> float:
    return metric_total(s.get("/metrics"), f"sglang_tiered:kvpr_{name}_total")


def wait_for_activations(s: ServerProcess, pages: int) -> None:
    """Until `pages` activation pages reached the SSD tier (written after the KV, asynchronously); at most 60 s."""
    deadline = time.monotonic() + 60
    while counter(s, "activation_pages_written") < pages and time.monotonic() < deadline:
        time.sleep(0.3)
    assert counter(s, "activation_pages_written") >= pages
