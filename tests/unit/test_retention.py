"""Retention pins (pure): expiry, the cap on seconds and pages, the oldest pin released first, refresh."""

from __future__ import annotations

import pytest

from sglang_tiered.policy.retention import PinRefused, Retention


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pin_holds_until_it_expires():
    clock = Clock()
    r = Retention(max_seconds=60, max_pages=10, clock=clock)
    pin, released = r.pin(["a", "b"], 30)
    assert released == [] and pin.until == 1030.0
    assert r.pinned("a") and r.pinned("b") and not r.pinned("c")
    clock.now = 1029.9
    assert r.pinned("b")
    clock.now = 1030.0
    assert not r.pinned("a") and not r.pinned("b")  # expired, before and after expire() forgets it
    assert [p.keys for p in r.expire()] == [("a", "b")] and len(r) == 0 and r.pages() == []


def test_seconds_are_capped_by_max_seconds():
    clock = Clock()
    r = Retention(max_seconds=60, max_pages=10, clock=clock)
    assert r.pin(["a"], 3600)[0].until == 1060.0


def test_beyond_max_pages_the_oldest_pins_are_released():
    clock = Clock()
    r = Retention(max_seconds=600, max_pages=4, clock=clock)
    r.pin(["a1", "a2"], 100)
    r.pin(["b1", "b2"], 100)
    pin, released = r.pin(["c1", "c2"], 100)
    assert [p.keys for p in released] == [("a1", "a2")]
    assert not r.pinned("a1") and r.pinned("b1") and r.pinned("c2") and sorted(r.pages()) == ["b1", "b2", "c1", "c2"]
    with pytest.raises(PinRefused):
        r.pin(["x1", "x2", "x3", "x4", "x5"], 10)
    assert r.pinned("b1")  # a refused pin releases nothing


def test_pins_sharing_a_prefix_count_its_pages_once_and_keep_the_later_expiry():
    clock = Clock()
    r = Retention(max_seconds=600, max_pages=3, clock=clock)
    r.pin(["p1", "p2"], 50)
    r.pin(["p1", "p2", "q3"], 100)  # the same document, another question: 3 pages, not 5
    assert len(r) == 2 and sorted(r.pages()) == ["p1", "p2", "q3"]
    clock.now += 60
    assert r.pinned("p1") and r.pinned("q3")  # the longer pin still covers the shared pages
    clock.now += 50
    assert not r.pinned("p1")


def test_pinning_the_same_prefix_again_refreshes_it_and_makes_it_the_newest():
    clock = Clock()
    r = Retention(max_seconds=600, max_pages=4, clock=clock)
    r.pin(["a1", "a2"], 100)
    r.pin(["b1", "b2"], 100)
    r.pin(["a1", "a2"], 10)  # the later expiry (100 s) is kept; a is now the newest pin
    _, released = r.pin(["c1", "c2"], 100)
    assert [p.keys for p in released] == [("b1", "b2")]
    clock.now += 99
    assert r.pinned("a1")


def test_disabled_and_bad_settings():
    assert not Retention(0, 10).enabled and not Retention(60, 0).enabled and Retention(60, 1).enabled
    with pytest.raises(ValueError):
        Retention(-1, 10)
    with pytest.raises(ValueError, match="nothing to pin"):
        Retention(60, 10).pin([], 10)
