"""The prefix-aware CPU attention inside a live server: greedy tokens identical to SGLang's `torch_native` path,
cold and on a cache hit, for prompts of several lengths (one server per attention choice, same prompts)."""

from __future__ import annotations

import pytest

from sglang_tiered.server_process import ServerProcess, cached_details

NEW_TOKENS = 24


def run_prompts(tmp_path, choice: str, prompts: list[str]) -> list[tuple[list[int], dict]]:
    args = ["--kv-backend", "tiered", "--max-total-tokens", "4096", "--tiered-ssd-dir", str(tmp_path / choice),
            "--tiered-cpu-attention", choice, "--tiered-stats-interval", "0"]
    outs = []
    with ServerProcess(args, log_path=tmp_path / f"{choice}.log") as server:
        for text in prompts:
            for _ in range(2):  # cold, then a device hit
                r = server.generate(text, max_new_tokens=NEW_TOKENS)
                outs.append((r["output_ids"], cached_details(r)))
    return outs


@pytest.fixture(scope="module")
def prompts(essays) -> list[str]:
    return [essays[10][:300], essays[11][:1500], essays[12][:2800] + essays[13][:2000]]


def test_prefix_aware_attention_matches_torch_native(tmp_path_factory, prompts):
    tmp = tmp_path_factory.mktemp("attn")
    ours = run_prompts(tmp, "prefix_aware", prompts)
    theirs = run_prompts(tmp, "torch_native", prompts)
    for (our_ids, our_cache), (their_ids, their_cache) in zip(ours, theirs, strict=True):
        assert our_cache == their_cache
        assert our_ids == their_ids
    hits = [c["device"] for _, c in ours[1::2]]
    assert all(h >= 64 for h in hits), hits  # the second send of each prompt really was a cache hit
    assert [ids for ids, _ in ours[0::2]] == [ids for ids, _ in ours[1::2]]  # hit == cold
