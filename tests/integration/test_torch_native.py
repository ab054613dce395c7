"""The shared server against one of the same configuration with SGLang's `torch_native` CPU attention and
`--tiered-blend off`, in the dtype the shared server chose (one server for the module):

1. the prefix-aware CPU attention: greedy tokens identical to `torch_native`'s, cold and on a cache hit, for prompts
   of several lengths (where this CPU's attention rounds a call's rows otherwise by the call's length -- an Intel
   Xeon with AMX -- identical up to a near-tie of the reference, `assert_same_greedy`);
2. `--tiered-blend off` leaves the chunk separator in the text.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sglang_tiered.server_process import ServerProcess, cached_details
from tests.integration.helpers import SEP, chosen_dtype, tiered_args
from tests.rounding import LOGPROB_TOL, attention_rows_alone

pytestmark = [pytest.mark.server, pytest.mark.slow]

NEW_TOKENS = 24
MARKED = "Alice works at the Amber Museum." + SEP + "The Amber Museum is in Lisbon." + SEP + "Where does Alice work?"


@pytest.fixture(scope="module")
def torch_native_server(tmp_path_factory, shared_server) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("torch-native")
    args = tiered_args(tmp / "ssd", "--tiered-cpu-attention", "torch_native", "--tiered-blend", "off",
                       "--enable-metrics", "--dtype", chosen_dtype(shared_server))
    with ServerProcess(args, log_path=tmp / "torch_native.log") as server:
        server.ssd = tmp / "ssd"
        yield server


def greedy(server: ServerProcess, prompt: str | list[int], max_new_tokens: int = NEW_TOKENS) -> dict:
    """A greedy /generate of a text or of token ids, with the top two logprobs at every output position."""
    body = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
    status, out = server.request("/generate", {**body, "return_logprob": True, "top_logprobs_num": 2,
                                               "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                   "temperature": 0}}, timeout=300)
    assert status == 200, out
    return out


def assert_same_greedy(ours: dict, theirs: dict, dtype: str, what: str) -> None:
    """`ours` answers greedily as `theirs` (the reference) does. Where this CPU's attention rounds a call's rows
    alone (tests/rounding.py), the tokens are identical. Elsewhere two attention paths round the same sums in
    different orders: the tokens are identical up to the first position where the reference chose between its top two
    within twice the tolerance of a rounding, and there ours took the reference's second; every top-1 logprob before
    it within the tolerance (a wrong mask or offset moves them by whole units)."""
    a, b = ours["output_ids"], theirs["output_ids"]
    if attention_rows_alone(getattr(torch, dtype)):
        assert a == b, (what, "this CPU rounds attention rows alone: identical tokens expected")
        return
    tol = LOGPROB_TOL[dtype]
    top_a, top_b = ours["meta_info"]["output_top_logprobs"], theirs["meta_info"]["output_top_logprobs"]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            (first, _, _), (second, token, _) = top_b[i][:2]
            assert first - second <= 2 * tol and x == token, (what, i, top_a[i], top_b[i])
            return
        assert abs(top_a[i][0][0] - top_b[i][0][0]) <= tol, (what, i, top_a[i], top_b[i])


def run_prompts(server: ServerProcess, prompts: list[str]) -> list[dict]:
    server.flush_cache()
    return [greedy(server, text) for text in prompts for _ in range(2)]  # cold, then a device hit


def test_prefix_aware_attention_matches_torch_native(shared_server, torch_native_server, essays):
    dtype = chosen_dtype(shared_server)
    prompts = [essays[10][:300], essays[11][:1500], essays[12][:2800] + essays[13][:2000]]
    ours = run_prompts(shared_server, prompts)
    theirs = run_prompts(torch_native_server, prompts)
    for i, (our, their) in enumerate(zip(ours, theirs, strict=True)):
        assert cached_details(our) == cached_details(their)
        assert_same_greedy(our, their, dtype, f"prompt {i // 2}, {'hit' if i % 2 else 'cold'}")
    hits = [cached_details(r)["device"] for r in ours[1::2]]
    assert all(h >= 64 for h in hits), hits  # the second send of each prompt really was a cache hit
    for i, (cold, hit) in enumerate(zip(ours[0::2], ours[1::2])):
        assert_same_greedy(hit, cold, dtype, f"prompt {i}: hit against cold")


def test_off_leaves_the_separator_alone(shared_server, torch_native_server):
    """The separator is text under `--tiered-blend off`, so the prompt is longer than the same prompt with the
    separators removed (the shared server blends)."""
    off = torch_native_server.generate(MARKED, max_new_tokens=1)
    split = shared_server.generate(MARKED, max_new_tokens=1)
    assert off["meta_info"]["prompt_tokens"] > split["meta_info"]["prompt_tokens"]
