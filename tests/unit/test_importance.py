"""Importance scoring from sampled heads, the gate arithmetic and the importance table (no SGLang)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from sglang_tiered.kernels.importance import sampled_heads, topk_sets, window_scores
from sglang_tiered.policy.importance import (
    GateHistory,
    ema,
    gate_threshold,
    important_mask,
    jaccard,
    mean_pairwise_jaccard,
)
from sglang_tiered.storage.importance_table import LOG_NAME, ImportanceTable


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


def test_important_mask_and_ema():
    assert important_mask([0.1, 0.9, 0.5, 0.7], 0.5) == [False, True, False, True]
    assert important_mask([0.2, 0.2, 0.2], 0.34) == [True, True, False]  # ceil(1.02) = 2, ties: earlier first
    assert important_mask([], 0.5) == []
    assert ema(-1.0, 1.0, 0.3) == 1.0  # the first observation is taken as is
    assert math.isclose(ema(1.0, 0.0, 0.3), 0.7)


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


def test_importance_table_moving_average_reuses_and_persistence(tmp_path):
    t = ImportanceTable(4, alpha=0.5, directory=tmp_path)
    t.observe(KEYS[:2], [True, False, True, False] + [False] * 4)
    assert t.important_tokens(KEYS[:1]) == 2.0 and t.important_tokens(KEYS[1:2]) == 0.0
    t.observe(KEYS[:1], [False, False, True, True])
    assert t.get(KEYS[0]).tokens.tolist() == [0.5, 0.0, 1.0, 0.5]
    t.reuse(KEYS[:1])
    t.reuse(KEYS[:1])
    assert t.reuses(KEYS) == 2 and t.important_tokens([KEYS[2]]) == 0.0  # unknown pages count 0
    t.close()

    again = ImportanceTable(4, alpha=0.5, directory=tmp_path)  # a restart replays the log
    assert again.get(KEYS[0]).tokens.tolist() == [0.5, 0.0, 1.0, 0.5] and again.reuses(KEYS[:1]) == 2
    assert again.coverage() == {"pages": 2, "observed_pages": 2, "reuses": 2}
    again.close()


def test_a_torn_or_corrupt_log_keeps_what_came_before(tmp_path):
    t = ImportanceTable(4, directory=tmp_path)
    t.observe(KEYS[:1], [True] * 4)
    t.observe(KEYS[1:2], [True] * 4)
    t.close()
    log = tmp_path / LOG_NAME
    data = bytearray(log.read_bytes())
    size = len(data) // 2
    data[size + 40] ^= 0xFF  # corrupt the second record
    log.write_bytes(bytes(data) + b"\x01\x02\x03")  # and a torn tail
    again = ImportanceTable(4, directory=tmp_path)
    assert again.get(KEYS[0]) is not None and again.get(KEYS[1]) is None
    assert os.path.getsize(log) == size  # rewritten without the bad records before anything is appended
    again.observe(KEYS[2:], [False] * 4)
    again.close()
    assert ImportanceTable(4, directory=tmp_path).get(KEYS[2]) is not None


def test_the_log_is_compacted(tmp_path):
    t = ImportanceTable(2, directory=tmp_path)
    for _ in range(1100):
        t.reuse(KEYS[:1])
    t.close()
    assert os.path.getsize(tmp_path / LOG_NAME) < 200 * (2 * 2 + 44)
    assert ImportanceTable(2, directory=tmp_path).reuses(KEYS[:1]) == 1100


MORE = [f"{i:064x}" for i in range(100, 110)]


def test_the_log_grows_only_as_far_as_the_ssd_tier_allots(tmp_path):
    """Every append asks for its bytes first (the SSD tier's one budget); a refused record is not written, counted,
    and the table still learns in memory."""
    allotted: list[int] = []
    budget = 3 * (44 + 2 * 4)  # three records of a 4-token page

    def allot(total: int) -> bool:
        allotted.append(total)
        return total <= budget

    t = ImportanceTable(4, directory=tmp_path, allot=allot, settle=lambda n: None)
    for key in MORE[:3]:
        t.observe([key], [True] * 4)
    assert t.dropped == 0 and allotted == [52, 104, 156]
    t.observe(MORE[3:4], [True] * 4)
    assert t.dropped == 1 and os.path.getsize(tmp_path / LOG_NAME) == budget
    assert t.important_tokens(MORE[3:4]) == 4.0  # learned, just not persisted
    t.close()


def test_the_table_is_capped_least_recently_updated_first(tmp_path):
    t = ImportanceTable(4, max_pages=2)
    t.observe(MORE[:2], [True] * 8)
    t.reuse(MORE[0:1])  # the first page is now the most recently updated
    assert t.coverage() == {"pages": 2, "observed_pages": 2, "reuses": 1}
    t.observe(MORE[2:3], [False] * 4)  # a third page: the least recently updated (the second) goes
    assert t.get(MORE[1]) is None and len(t) == 2 and t.get(MORE[0]) is not None and t.get(MORE[2]) is not None
    assert t.coverage() == {"pages": 2, "observed_pages": 2, "reuses": 1}
