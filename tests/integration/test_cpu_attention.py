"""The prefix-aware CPU attention inside a live server: greedy tokens identical to SGLang's `torch_native` path,
cold and on a cache hit, for prompts of several lengths (the shared server against the same configuration with
`--tiered-cpu-attention torch_native`, same dtype, same prompts)."""

from __future__ import annotations

import pytest

from sglang_tiered.server_process import ServerProcess, cached_details

pytestmark = [pytest.mark.server, pytest.mark.slow]

NEW_TOKENS = 24


def run_prompts(server: ServerProcess, prompts: list[str]) -> list[tuple[list[int], dict]]:
    server.flush_cache()
    outs = []
    for text in prompts:
        for _ in range(2):  # cold, then a device hit
            r = server.generate(text, max_new_tokens=NEW_TOKENS)
            outs.append((r["output_ids"], cached_details(r)))
    return outs


@pytest.fixture(scope="module")
def prompts(essays) -> list[str]:
    return [essays[10][:300], essays[11][:1500], essays[12][:2800] + essays[13][:2000]]


def test_prefix_aware_attention_matches_torch_native(shared_server, torch_native_server, prompts):
    ours = run_prompts(shared_server, prompts)
    theirs = run_prompts(torch_native_server, prompts)
    for (our_ids, our_cache), (their_ids, their_cache) in zip(ours, theirs, strict=True):
        assert our_cache == their_cache
        assert our_ids == their_ids
    hits = [c["device"] for _, c in ours[1::2]]
    assert all(h >= 64 for h in hits), hits  # the second send of each prompt really was a cache hit
    assert [ids for ids, _ in ours[0::2]] == [ids for ids, _ in ours[1::2]]  # hit == cold
