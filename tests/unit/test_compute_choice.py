"""The two-sided load, the loader alone or SGLang's forward (policy/compute_choice.py), on the estimates of
policy/kvpr.py, with servers' numbers (the MHA model's 1024 tokens, Intel with AMX, bf16, stops 47-48: one server per
disk speed)."""

from __future__ import annotations

import pytest

from sglang_tiered.policy.compute_choice import ALONE, COMPUTE, MEET, RECENT, Choice, Estimates
from sglang_tiered.policy.kvpr import Profile, Shape, alone_page_s, chunk_page_s, decide, forward_s, meet_s
from sglang_tiered.policy.load_choice import period

PS, LAYERS = 64, 30
MHA = Shape(LAYERS, 576 * 2, 2 * 9 * 64 * 2)
SPAN, NEW = 16, 32  # pages stored, tokens asked after them


def estimates(prof: Profile) -> tuple[float, float]:
    """(the two-sided forward, SGLang's forward) as `KVPR.plan` estimates them for the 1024-token span."""
    d = decide(MHA, prof, SPAN, PS, stored_activations=True, forced=False)
    assert d.take and d.activations and d.compute_joins
    meet = meet_s(SPAN, d.read_s, chunk_page_s(prof, LAYERS, PS)) + forward_s(prof, LAYERS, NEW, SPAN * PS)
    return meet, forward_s(prof, LAYERS, SPAN * PS + NEW)


def server(read_mbps: float, recompute_us: float, chunk_ms: float, span_us: float) -> Profile:
    return Profile(read_mbps * 1e6, recompute_us * 1e-6, 60e-6, 2.26e-6, chunk_s=chunk_ms * 1e-3, span_s=span_us * 1e-6)


def test_estimates_follow_the_profile():
    prof = server(26, 3.30, 61.5, 12.98)
    assert forward_s(prof, LAYERS, 1056) == pytest.approx(0.0615 + 1056 * LAYERS * 12.98e-6)
    assert forward_s(prof, LAYERS, 32, 1024) == pytest.approx(0.0615 + 32 * LAYERS * 12.98e-6 + 1024 * LAYERS * 2.26e-6)
    assert meet_s(16, 0.09, 0.04) == pytest.approx(16 / (1 / 0.04 + 1 / 0.09))
    # the loader alone: a KV page's read; activations, a page every max(read, recompute) on two threads, the
    # recompute term the loads' own measured cost once one is in
    assert alone_page_s(MHA, prof, PS, False) == pytest.approx(LAYERS * PS * MHA.kv_bytes / 26e6)
    assert alone_page_s(MHA, prof, PS, True) == pytest.approx(LAYERS * PS * max(MHA.x_bytes / 26e6, 3.30e-6))
    fast = Profile(200e6, 8.2e-6, 60e-6, 2.26e-6, x_load_s=10e-6)
    assert alone_page_s(MHA, fast, PS, True) == pytest.approx(LAYERS * PS * 10e-6)  # recompute-bound at 200 MB/s


def test_each_server_picks_what_it_measured_faster():
    # 25 MB/s: SGLang's forward of the prompt took 0.60 s, the two-sided loads 0.67-0.85 s (stop 47's miss)
    slow = Estimates()
    meet, compute = estimates(server(26, 3.30, 61.5, 12.98))
    assert compute < meet  # so says the profile (as at 50 MB/s below, where that is wrong)
    assert slow.choose(SPAN, True, meet, compute) == Choice(MEET, False, None, None)  # nothing measured
    slow.observe(slow.key(COMPUTE, SPAN), 0.60, compute)
    assert slow.choose(SPAN, True, meet, compute).how == MEET  # the meet's factor is not measured yet
    for took in (0.67, 0.85, 0.76):
        slow.observe(slow.key(MEET, SPAN, True), took, meet)
    c = slow.choose(SPAN, True, meet, compute)
    assert c.how == COMPUTE and not c.exploring and c.compute_s == pytest.approx(0.60) and c.meet_s > 0.7
    # a span of another size class, or KV loads, have their own factors
    assert slow.choose(64, True, meet * 4, compute * 4).how == MEET
    assert slow.choose(SPAN, False, meet, compute).how == MEET

    # 50 MB/s, another server: SGLang's forward took 0.72 s, the loads 0.53-0.62 s
    fast = Estimates()
    meet, compute = estimates(server(48, 3.90, 55.0, 10.97))
    assert compute < meet  # the profile alone would leave it to SGLang's forward, 1.35x slower here
    fast.observe(fast.key(COMPUTE, SPAN), 0.72, compute)
    for took in (0.616, 0.535, 0.532):
        fast.observe(fast.key(MEET, SPAN, True), took, meet)
    c = fast.choose(SPAN, True, meet, compute)
    assert c.how == MEET and not c.exploring and c.meet_s < 0.6 < c.compute_s


def test_a_span_left_to_sglangs_forward_is_met_again_every_period():
    e = Estimates()
    e.observe(e.key(COMPUTE, SPAN), 0.5, 1.0)  # factor 0.5
    e.observe(e.key(MEET, SPAN, True), 0.8, 1.0)  # factor 0.8: the meet 1.6x slower
    n = period(0.8 / 0.5)
    hows = [e.choose(SPAN, True, 1.0, 1.0) for _ in range(2 * n)]
    assert [c.how for c in hows].count(MEET) == 2 and hows[n - 1].how == MEET and hows[n - 1].exploring
    assert all(c.how == COMPUTE for i, c in enumerate(hows) if i not in (n - 1, 2 * n - 1))
    # the retry's sample moves the meet's factor: a disk that got faster is seen
    e.observe(e.key(MEET, SPAN, True), 0.1, 1.0)
    e.observe(e.key(MEET, SPAN, True), 0.1, 1.0)
    e.observe(e.key(MEET, SPAN, True), 0.1, 1.0)
    assert e.choose(SPAN, True, 1.0, 1.0).how == MEET


def test_a_sample_must_be_a_time():
    e = Estimates()
    with pytest.raises(ValueError):
        e.observe(e.key(COMPUTE, 4), 0.0, 1.0)
    with pytest.raises(ValueError):
        e.observe(e.key(COMPUTE, 4), 1.0, 0.0)
    assert e.factor(e.key(COMPUTE, 4)) is None


def test_one_slow_forward_does_not_linger():
    """The factor is the median of the last RECENT samples: a slow first forward (1.71 s where later ones took about
    1.0 s: the MHA model at 10 MB/s) counts for one of them, and is gone after RECENT more."""
    e = Estimates()
    k = e.key(COMPUTE, SPAN)
    assert e.observe(k, 1.71, 1.0) == pytest.approx(1.71)
    assert e.observe(k, 0.98, 1.0) == pytest.approx((1.71 + 0.98) / 2)
    assert e.observe(k, 1.02, 1.0) == pytest.approx(1.02)
    for took in (3.0,) + (1.0,) * (RECENT - 1):
        e.observe(k, took, 1.0)
    assert e.factor(k) == pytest.approx(1.0)  # the first gone, the later slow one one of five


def test_the_loader_alone_is_tried_where_its_estimate_is_lower_and_kept_where_measured_faster():
    """Stop 48's miss (the MHA model's 1024 tokens at 200 MB/s): compute joined and the two met in 0.46-0.62 s
    (estimated 0.48-0.51 s), the loader alone on two threads took 0.35-0.51 s. Numbers of that server."""
    e = Estimates()
    meet, compute, alone = 0.49, 0.60, 0.36  # the profile's estimates (SGLang's forward: 1.0 s measured)
    assert e.choose(SPAN, True, meet, compute, alone) == Choice(MEET, False)  # nothing measured: the meet
    e.observe(e.key(MEET, SPAN, True), 0.53, meet)
    e.observe(e.key(COMPUTE, SPAN), 1.0, compute)
    c = e.choose(SPAN, True, meet, compute, alone)  # the loader alone not timed, estimated below the meet: tried
    assert (c.how, c.exploring, c.alone_s) == (ALONE, True, None) and c.meet_s == pytest.approx(0.53)
    assert c.describe() == "the loader alone, first try (two-sided 0.530s, SGLang's forward 1.000s estimated)"
    for took in (0.40, 0.45, 0.38):
        e.observe(e.key(ALONE, SPAN, True), took, alone)
    hows = [e.choose(SPAN, True, meet, compute, alone) for _ in range(2 * period(0.53 / 0.40))]
    n = period(0.53 / 0.40)
    assert [c.how for c in hows] == ([ALONE] * (n - 1) + [MEET]) * 2  # the meet timed again every period
    assert hows[0].describe() == "the loader alone (two-sided 0.530s, the loader alone 0.400s, SGLang's forward " \
                                 "1.000s estimated)"
    assert hows[n - 1].exploring and hows[n - 1].describe().startswith("two-sided, timed again (")
    # KV loads, or another span size, have their own factors; no alone estimate: not a way
    assert e.choose(SPAN, False, meet, compute, alone).how == MEET
    assert e.choose(SPAN, True, meet, compute).how == MEET


def test_the_loader_alone_is_not_tried_where_the_profile_puts_it_above_the_best_way():
    """At 25 MB/s the same span reads in 1.4 s as activations alone; the meet took 0.9 s: never tried."""
    e = Estimates()
    e.observe(e.key(MEET, SPAN, True), 0.9, 0.8)
    e.observe(e.key(COMPUTE, SPAN), 1.2, 0.6)
    assert all(e.choose(SPAN, True, 0.8, 0.6, 1.5).how == MEET for _ in range(100))
    # where SGLang's forward is the best, both of our loader's measured ways are timed again, each at its period
    e.observe(e.key(ALONE, SPAN, True), 1.6, 1.5)
    e.observe(e.key(COMPUTE, SPAN), 0.5, 0.6)
    e.observe(e.key(COMPUTE, SPAN), 0.5, 0.6)  # median 0.5 / 0.6: SGLang's forward 0.5 s
    hows = [e.choose(SPAN, True, 0.8, 0.6, 1.5).how for _ in range(period(1.6 / 0.5))]
    assert hows.count(MEET) == len(hows) // period(0.9 / 0.5) and hows[-1] == ALONE
    assert hows.count(COMPUTE) == len(hows) - hows.count(MEET) - 1
