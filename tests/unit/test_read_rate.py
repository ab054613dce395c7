"""policy/read_rate.py: the read rate decisions use follows the loads' own reads, both ways (no SGLang)."""

from __future__ import annotations

import pytest

from sglang_tiered.policy.read_rate import MIN_BYTES, WEIGHT, ReadRate

MB = 1e6


def test_the_probe_is_the_first_sample_not_a_floor():
    r = ReadRate(82 * MB)  # a probe that ran beside other writes
    for _ in range(10):
        assert r.observe(MIN_BYTES, MIN_BYTES / (500 * MB))
    assert r.samples == 10
    assert 480 * MB < r.bps < 500 * MB  # follows the loads upward: 1 - 0.7**10 of the way


def test_a_disk_that_slows_down_is_seen():
    r = ReadRate(500 * MB)
    assert r.observe(MIN_BYTES, MIN_BYTES / (100 * MB))
    assert r.bps == pytest.approx(WEIGHT * 100 * MB + (1 - WEIGHT) * 500 * MB)


def test_small_loads_are_summed_until_they_say_something():
    r = ReadRate(100 * MB)
    quarter = MIN_BYTES // 4
    for _ in range(3):
        assert not r.observe(quarter, quarter / (400 * MB))
    assert r.bps == 100 * MB and r.samples == 0
    assert r.observe(quarter, quarter / (200 * MB))  # the sum: 4 quarters in 3/400 + 1/200 of the seconds
    rate = MIN_BYTES / (3 * quarter / (400 * MB) + quarter / (200 * MB))
    assert rate == pytest.approx(320 * MB)
    assert r.bps == pytest.approx(WEIGHT * rate + (1 - WEIGHT) * 100 * MB)


@pytest.mark.parametrize("nbytes, seconds", [(0, 1.0), (MIN_BYTES, 0.0), (-1, 1.0), (MIN_BYTES, -0.5)])
def test_empty_or_untimed_reads_change_nothing(nbytes, seconds):
    r = ReadRate(100 * MB)
    assert not r.observe(nbytes, seconds)
    assert r.bps == 100 * MB and r.samples == 0


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError):
        ReadRate(0.0)


def test_spread_reads_only_pull_the_rate_down():
    """Reads with recomputes between them went through a throttle faster than it sustains: an upper bound only."""
    r = ReadRate(110 * MB)  # back-to-back KV reads behind a 100 MB/s throttle
    for _ in range(5):
        assert not r.observe(MIN_BYTES, MIN_BYTES / (700 * MB), spread=True)  # activation loads, bursts after gaps
    assert r.bps == 110 * MB and r.samples == 0
    assert r.observe(MIN_BYTES, MIN_BYTES / (50 * MB), spread=True)  # the disk slowed down: seen through them too
    assert r.bps == pytest.approx(WEIGHT * 50 * MB + (1 - WEIGHT) * 110 * MB)
    assert r.samples == 1


def test_spread_and_back_to_back_reads_are_summed_apart():
    r = ReadRate(100 * MB)
    half = MIN_BYTES // 2
    assert not r.observe(half, half / (700 * MB), spread=True)
    assert not r.observe(half, half / (200 * MB))  # not summed with the spread half: still below MIN_BYTES
    assert r.bps == 100 * MB
    assert r.observe(half, half / (200 * MB))  # the back-to-back sum folds in, upward
    assert r.bps == pytest.approx(WEIGHT * 200 * MB + (1 - WEIGHT) * 100 * MB)
    assert not r.observe(half, half / (700 * MB), spread=True)  # the spread sum: 700 MB/s, above the estimate
    assert r.samples == 1
    assert not r.observe(half, half / (50 * MB), spread=True)  # dropped with it, not carried into the next sum
    assert r.bps == pytest.approx(WEIGHT * 200 * MB + (1 - WEIGHT) * 100 * MB)
