"""Importance scoring from sampled heads and the gate arithmetic (no SGLang)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tiered.kernels.importance import sampled_heads, topk_sets, window_scores
from sglang_tiered.policy.importance import (
    GateHistory,
    gate_threshold,
    jaccard,
    mean_pairwise_jaccard,
)


def test_sampled_heads_spread_over_kv_groups():
    assert sampled_heads(9, 3, 3) == [0, 3, 6]  # SmolLM2: one per KV head, not the first three (all KV head 0)
    assert sampled_heads(9, 3, 4) == [0, 1, 3, 6]
    assert sampled_heads(8, 8, 3) == [0, 1, 2]  # MHA: every head is its own group
    assert sampled_heads(32, 8, 8) == [0, 4, 8, 12, 16, 20, 24, 28]
    with pytest.raises(ValueError):
        sampled_heads(9, 3, 0)


def test_window_scores_equal_summed_softmax_rows_with_causal_visibility():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    pos = torch.tensor([6, 7, 8, 9])
    heads = [0, 3, 5]
    got = window_scores(q, k, pos, heads)
    want = torch.zeros(10)
    for i in range(4):
        for h in heads:
            s = (q[i, h] @ k[: pos[i] + 1, h // 3].T) / math.sqrt(8)
            want[: pos[i] + 1] += s.softmax(-1)
    assert torch.allclose(got, want, atol=1e-5)
    assert math.isclose(got.sum().item(), 4 * 3, rel_tol=1e-5)  # every row hands out one unit
    assert got[0] > 0 and got.shape == (10,)


def test_topk_sets():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.8, 0.1, 0.2, 0.3]])
    assert topk_sets(scores, 2) == [{1, 3}, {0, 3}]


def test_jaccard_gate_arithmetic():
    assert jaccard({1, 2, 3}, {2, 3, 4}) == 0.5
    assert jaccard(set(), set()) == 1.0
    assert math.isclose(mean_pairwise_jaccard([{1, 2}, {1, 2}, {3, 4}]), (1 + 0 + 0) / 3)
    # the reference table of the design notes (alpha 0.6)
    for frac, t in ((0.05, 0.111), (0.10, 0.171), (0.20, 0.268), (0.50, 0.517)):
        assert math.isclose(gate_threshold(int(frac * 1000), 1000), t, abs_tol=1e-3)
    assert gate_threshold(10, 10) == 1.0
    with pytest.raises(ValueError):
        gate_threshold(0, 10)


KEYS = [f"{i:064x}" for i in range(1, 4)]


def test_gate_history_skips_a_layer_after_a_streak_of_failures_and_explores_again():
    h = GateHistory(streak=2, explore=4)
    assert h.skip() == frozenset()  # load 1: nothing known
    h.record({0: False, 1: True, 2: False})
    assert h.skip() == frozenset()  # load 2: one failure is not a streak
    h.record({0: False, 1: False, 2: True})  # layer 2 passed: its streak starts over
    assert h.skip() == {0}  # load 3
    h.record({1: False, 2: False})  # layer 0 skipped: unmeasured, stays skipped
    assert h.skip() == frozenset()  # load 4: every 4th load measures every layer
    h.record({0: True, 1: False, 2: False})  # layer 0 passes again
    assert h.skip() == {1, 2}  # load 5
    never = GateHistory(streak=0)
    never.record({0: False})
    assert [never.skip() for _ in range(3)] == [frozenset()] * 3
    with pytest.raises(ValueError):
        GateHistory(streak=-1)
