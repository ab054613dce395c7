"""policy/load_choice.py: which exact load of a stored span a server uses, from its own measured loads (no SGLang)."""

from __future__ import annotations

import pytest

from sglang_tiered.policy.load_choice import (
    DECODING,
    EXPLORE_EVERY,
    EXPLORE_MAX,
    IDLE,
    MIN_SAMPLES,
    OURS,
    SGLANG,
    Choice,
    LoadChoice,
    behind_prefills,
    bucket,
    period,
    prefetch_gives_up,
)

PS = 64


def feed(choice: LoadChoice, load: str, n: int, pages: int, per_token_s: float, condition: str = IDLE) -> None:
    for _ in range(n):
        choice.observe(load, pages * PS, PS, per_token_s * pages * PS, condition)


@pytest.mark.parametrize("pages, want", [(1, 0), (2, 1), (3, 1), (16, 4), (31, 4), (64, 6), (126, 6), (128, 7)])
def test_buckets_are_powers_of_two_of_pages(pages, want):
    assert bucket(pages) == want


def test_each_load_is_measured_before_the_averages_decide_sglangs_first():
    c = LoadChoice()
    assert c.choose(16, IDLE) == Choice(SGLANG, True)
    feed(c, SGLANG, MIN_SAMPLES - 1, 16, 1e-4)
    assert c.choose(16, IDLE) == Choice(SGLANG, True)
    feed(c, SGLANG, 1, 16, 1e-4)
    assert c.choose(16, IDLE) == Choice(OURS, True)
    feed(c, OURS, MIN_SAMPLES, 16, 0.8e-4)
    assert c.choose(16, IDLE) == Choice(OURS, False)  # measured, and ahead


def test_a_conclusive_sample_measures_a_load_at_once():
    """SGLang's load that gave up on a span (its request computed it) is not tried a second time to measure it."""
    c = LoadChoice()
    assert c.choose(64, IDLE) == Choice(SGLANG, True)
    r = c.observe(SGLANG, 64 * PS, PS, 12.0, IDLE, conclusive=True)
    assert r.samples == {OURS: 0, SGLANG: MIN_SAMPLES}
    assert c.choose(64, IDLE) == Choice(OURS, True)  # our loader's turn to be measured
    r = c.observe(SGLANG, 64 * PS, PS, 12.0, IDLE, conclusive=True)
    assert r.samples[SGLANG] == MIN_SAMPLES + 1  # one more sample, not MIN_SAMPLES more


def test_until_both_are_measured_an_unmeasurable_request_gets_sglangs_load():
    c = LoadChoice()
    feed(c, OURS, 5, 16, 1e-5)  # ours looks far better, but SGLang's is unmeasured
    assert c.choose(16, None) == Choice(SGLANG, False)
    feed(c, SGLANG, MIN_SAMPLES, 16, 1e-4)
    assert c.choose(16, None) == Choice(OURS, False)


def test_the_lower_average_wins_and_a_tie_is_sglangs():
    c = LoadChoice()
    feed(c, OURS, 2, 64, 2e-4)
    feed(c, SGLANG, 2, 64, 1e-4)
    assert c.choose(100, IDLE).load == SGLANG  # (100 pages: the same bucket as 64)
    d = LoadChoice()
    feed(d, OURS, 2, 64, 1e-4)
    feed(d, SGLANG, 2, 64, 1e-4)
    assert d.choose(64, None).load == SGLANG


def test_the_load_behind_is_retried_every_period_of_its_gap():
    c = LoadChoice()
    feed(c, OURS, 2, 16, 1e-4)
    feed(c, SGLANG, 2, 16, 2e-4)  # 2x slower: a retry every 64 measurable decisions
    p = period(2.0)
    assert p == 4 * EXPLORE_EVERY
    got = [c.choose(16, IDLE) for _ in range(2 * p)]
    retries = [i for i, x in enumerate(got) if x.exploring]
    assert retries == [p - 1, 2 * p - 1]
    assert all(got[i].load == SGLANG for i in retries) and all(x.load == OURS for x in got if not x.exploring)
    for _ in range(3 * EXPLORE_EVERY):  # unmeasurable decisions never retry
        assert c.choose(16, None) == Choice(OURS, False)


def test_a_load_that_slows_down_loses_its_lead():
    c = LoadChoice()
    feed(c, OURS, 2, 16, 1e-4)
    feed(c, SGLANG, 2, 16, 2e-4)
    assert c.choose(16, None).load == OURS
    rates = None
    for _ in range(4):  # the disk under ours slows to 4e-4 s per token: 1e-4 -> 1.9e-4 -> 2.53e-4 ...
        c.observe(OURS, 16 * PS, PS, 4e-4 * 16 * PS)
        rates = c.choose(16, None)
    assert rates.load == SGLANG


def test_the_moving_average_weighs_a_new_sample_03():
    c = LoadChoice()
    c.observe(OURS, 640, PS, 0.064)  # 1e-4 s per token
    r = c.observe(OURS, 640, PS, 0.128)  # 2e-4
    assert r.per_token_s[OURS] == pytest.approx(1.3e-4) and r.samples == {OURS: 2, SGLANG: 0}


def test_sizes_are_measured_apart():
    c = LoadChoice()
    feed(c, OURS, 2, 16, 1e-4)
    feed(c, SGLANG, 2, 16, 2e-4)
    assert c.choose(16, None).load == OURS
    assert c.choose(64, None).load == SGLANG  # nothing measured at 64-127 pages


def test_conditions_are_measured_apart_and_an_unmeasurable_request_follows_the_idle_samples():
    """At idle SGLang's load is ahead (the MHA model at the disk's speed); among decodes ours is (SmolLM2 with a
    decoding client: SGLang's load 0.18-0.30 s slower). Each condition explores and decides on its own samples."""
    c = LoadChoice()
    feed(c, SGLANG, 2, 16, 1e-4)
    feed(c, OURS, 2, 16, 2e-4)
    assert c.choose(16, IDLE) == Choice(SGLANG, False)
    assert c.choose(16, DECODING) == Choice(SGLANG, True)  # nothing timed among decodes: SGLang's load first
    feed(c, SGLANG, 2, 16, 3e-4, DECODING)
    assert c.choose(16, DECODING) == Choice(OURS, True)
    feed(c, OURS, 2, 16, 2e-4, DECODING)
    assert c.choose(16, DECODING) == Choice(OURS, False)
    assert c.choose(16, IDLE) == Choice(SGLANG, False)  # the idle samples are untouched
    assert c.choose(16, None) == Choice(SGLANG, False)  # unmeasurable: the idle samples decide
    assert c.slower_s(16 * PS, PS) == pytest.approx(16 * PS * 1e-4)  # behind prefills: the idle gap
    d = LoadChoice()  # never idle: the gap among decodes
    feed(d, SGLANG, 2, 16, 3e-4, DECODING)
    feed(d, OURS, 2, 16, 2e-4, DECODING)
    feed(d, OURS, 2, 16, 9e-4)  # (ours alone at idle: not both measured there)
    assert d.slower_s(16 * PS, PS) == pytest.approx(-16 * PS * 1e-4)


def test_retries_are_counted_per_condition():
    c = LoadChoice()
    for when in (IDLE, DECODING):
        feed(c, OURS, 2, 16, 1e-4, when)
        feed(c, SGLANG, 2, 16, 2e-4, when)
    p = period(2.0)
    for _ in range(p - 1):  # one short of a retry at idle ...
        assert c.choose(16, IDLE) == Choice(OURS, False)
    for _ in range(p - 1):  # ... and among decodes: neither condition's decisions count for the other
        assert c.choose(16, DECODING) == Choice(OURS, False)
    assert c.choose(16, IDLE) == Choice(SGLANG, True)
    assert c.choose(16, DECODING) == Choice(SGLANG, True)


@pytest.mark.parametrize("load, tokens, seconds, when", [("mine", 640, 0.1, IDLE), (OURS, 10, 0.1, IDLE),
                                                         (SGLANG, 640, 0.0, IDLE), (OURS, 640, 0.1, "busy")])
def test_a_bad_sample_is_refused(load, tokens, seconds, when):
    with pytest.raises(ValueError):
        LoadChoice().observe(load, tokens, PS, seconds, when)


@pytest.mark.parametrize("gap, want", [(1.0, EXPLORE_EVERY), (1.25, 25), (2.0, 64), (3.0, 144), (8.0, EXPLORE_MAX),
                                       (40.0, EXPLORE_MAX)])
def test_the_retry_period_grows_with_the_square_of_the_gap(gap, want):
    assert period(gap) == want


def test_a_retry_costs_at_most_a_64th_of_the_ahead_loads_time_for_gaps_up_to_17():
    gaps = [1 + i / 100 for i in range(1601)]  # 1.00 .. 17.00
    worst = max((g - 1) / period(g) for g in gaps)
    assert worst <= 1 / (4 * EXPLORE_EVERY) + 1e-9
    assert (20 - 1) / period(20) > 1 / (4 * EXPLORE_EVERY)  # beyond, EXPLORE_MAX bounds how stale it gets instead


def test_a_near_tie_is_retried_about_every_explore_every_decisions():
    c = LoadChoice()
    feed(c, OURS, 2, 64, 1.0e-4)
    feed(c, SGLANG, 2, 64, 1.1e-4)  # 1.1x: ceil(16 x 1.21) = 20
    got = [c.choose(64, IDLE) for _ in range(20)]
    assert [i for i, x in enumerate(got) if x.exploring] == [19] and got[19].load == SGLANG


def test_slower_s_is_the_measured_gap_over_the_span_and_none_until_both_are_measured():
    c = LoadChoice()
    assert c.slower_s(32 * PS, PS) is None
    feed(c, OURS, MIN_SAMPLES, 32, 3e-4)
    assert c.slower_s(32 * PS, PS) is None  # SGLang's load not measured yet
    feed(c, SGLANG, MIN_SAMPLES, 32, 1e-4)
    assert c.slower_s(40 * PS, PS) == pytest.approx(40 * PS * 2e-4)  # (40 pages: the bucket of 32)
    assert c.slower_s(16 * PS, PS) is None  # another size, unmeasured
    feed(c, OURS, 20, 32, 0.5e-4)  # our loader became faster: a negative gap
    assert c.slower_s(32 * PS, PS) < 0


@pytest.mark.parametrize("prefill_s, slower_s, want", [
    (2.5, None, True),  # unmeasured: taken as equal, any prefill forward ahead decides
    (2.5, -0.3, True),  # our loader faster anyway
    (2.5, 2.4, True),  # slower at idle, but by less than the forward SGLang's load would wait for
    (2.5, 2.6, False),  # slower by more than that forward
    (0.0, None, False),  # no prefill forward timed yet
    (0.0, -0.3, False),
])
def test_behind_prefills_weighs_the_forward_sglangs_load_would_wait_for_against_our_loaders_measured_gap(
        prefill_s, slower_s, want):
    assert behind_prefills(prefill_s, slower_s) is want


def test_sglangs_prefetch_gives_up_where_the_read_outlasts_its_deadline():
    """The MHA model's 4,096-token KV, 283 MB: 2.83 s at 100 MB/s against SGLang's 2.0 s deadline (1 s + 0.25 s per
    1k tokens); 1.42 s at 200 MB/s."""
    assert prefetch_gives_up(283_000_000, 100e6, 2.0)
    assert not prefetch_gives_up(283_000_000, 200e6, 2.0)
    assert not prefetch_gives_up(200_000_000, 100e6, 2.0)  # exactly at the deadline: it does not give up


def test_a_load_predicted_to_give_up_is_not_tried_while_unsampled():
    c = LoadChoice()
    assert c.choose(64, IDLE, sglang_gives_up=True) == Choice(OURS, True, predicted=True)  # ours measured instead
    feed(c, OURS, MIN_SAMPLES, 64, 2e-4)
    assert c.choose(64, IDLE, sglang_gives_up=True) == Choice(OURS, False, predicted=True)
    assert c.choose(64, None, sglang_gives_up=True) == Choice(OURS, False, predicted=True)  # unmeasurable too
    assert c.choose(64, IDLE) == Choice(SGLANG, True)  # the disk got faster: SGLang's load is tried as usual
    feed(c, SGLANG, 1, 64, 1e-4)
    assert c.choose(64, IDLE, sglang_gives_up=True) == Choice(SGLANG, True)  # sampled: the samples decide
    assert c.choose(16, IDLE, sglang_gives_up=True) == Choice(OURS, True, predicted=True)  # another size: its own
