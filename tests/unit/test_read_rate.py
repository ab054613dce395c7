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
