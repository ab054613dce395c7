"""Reads begun at admission (`engine/early_reads.py`), without SGLang: a load's pages from its last down to the
lowest asked, within one budget shared by every load, handed over (the page in flight as a future) or dropped, a
miss raised when the page is waited for, loads outliving their hold dropped."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_tiered.engine.early_reads import EarlyReader
from sglang_tiered.engine.meet import MemoryPages
from sglang_tiered.engine.span_miss import SpanMiss

PS = 4


def span(pages: int, **kw) -> MemoryPages:
    return MemoryPages(torch.arange(pages * PS * 2.0).reshape(1, pages * PS, 2, 1, 1), PS, **kw)


def settle(reader: EarlyReader, job, pages: int, timeout: float = 5.0) -> None:
    """Until `job` has `pages` pages read (or the reader is stuck: fail)."""
    deadline = time.monotonic() + timeout
    while sum(f.done() for f in job.pages.values()) < pages:
        assert time.monotonic() < deadline, f"{len(job.pages)} pages begun, {pages} expected"
        time.sleep(0.005)


def test_a_load_is_read_from_its_last_page_down_to_the_lowest_asked():
    reader, source = EarlyReader(1 << 20, 60.0), span(6)
    job = reader.start(source, 2, 8)
    settle(reader, job, 4)
    time.sleep(0.05)  # (nothing more comes)
    pages = reader.take(job)
    assert source.reads == [5, 4, 3, 2] and sorted(pages) == [2, 3, 4, 5]
    assert torch.equal(pages[4].result().kv, source.kv[:, 4 * PS : 5 * PS])
    assert reader.held == 0 and not reader.jobs


def test_the_budget_bounds_the_pages_held_and_a_take_makes_room_for_the_next_load():
    reader = EarlyReader(3 * 8, 60.0)  # three pages of 8 bytes
    first, second = span(5), span(5)
    a = reader.start(first, 0, 8)
    settle(reader, a, 3)
    b = reader.start(second, 0, 8)
    time.sleep(0.05)
    assert first.reads == [4, 3, 2] and second.reads == [] and reader.held == 24  # full: both wait
    assert sorted(reader.take(a)) == [2, 3, 4]
    settle(reader, b, 3)
    assert second.reads == [4, 3, 2] and reader.held == 24
    reader.drop(b)
    assert reader.held == 0 and b.pages == {}


def test_the_page_in_flight_is_handed_over_as_a_future_and_no_page_begins_after_the_take():
    reader, source = EarlyReader(1 << 20, 60.0), span(4, delay_s=0.2)
    job = reader.start(source, 0, 8)
    deadline = time.monotonic() + 5
    while 3 not in job.pages:  # until page 3's read is under way (it takes 0.2 s)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    pages = reader.take(job)
    assert list(pages) == [3] and not pages[3].done()
    assert torch.equal(pages[3].result(timeout=5).kv, source.kv[:, 3 * PS :])
    time.sleep(0.3)
    assert source.reads == [3]


def test_a_miss_is_raised_when_the_page_is_waited_for_and_ends_the_loads_early_reads():
    reader, source = EarlyReader(1 << 20, 60.0), span(4, fail=frozenset({2}))
    job = reader.start(source, 0, 8)
    deadline = time.monotonic() + 5
    while not (2 in job.pages and job.pages[2].done()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.05)
    pages = reader.take(job)
    assert sorted(pages) == [2, 3] and source.reads == [3]  # page 1 never begun
    with pytest.raises(SpanMiss, match="page 2"):
        pages[2].result()


def test_a_load_outliving_its_hold_is_dropped_at_the_next_start():
    now, told = [0.0], []
    reader = EarlyReader(1 << 20, 10.0, clock=lambda: now[0], on_expired=told.append)
    job = reader.start(span(2), 0, 8)
    settle(reader, job, 2)
    now[0] = 5.0
    reader.drop(reader.start(span(1), 0, 8))  # within the hold: nothing expires, nobody is told
    assert told == []
    now[0] = 11.0
    other = reader.start(span(1), 0, 8)
    assert job not in reader.jobs and job.pages == {} and told == [1]
    settle(reader, other, 1)
    assert reader.held == 8


def test_nothing_to_read_or_a_page_over_the_budget_starts_nothing():
    reader = EarlyReader(16, 60.0)
    assert reader.start(span(3), 3, 8) is None
    assert reader.start(span(3), 0, 17) is None
    assert not reader.jobs and reader._thread is None  # (no thread started either)


def test_unread_bytes_count_the_pages_of_queued_loads_not_begun():
    reader = EarlyReader(2 * 8, 60.0)  # two pages of 8 bytes: the rest wait for room
    a, b = reader.start(span(5), 1, 8), reader.start(span(3), 0, 8)
    settle(reader, a, 2)
    time.sleep(0.05)
    assert reader.unread_bytes() == (2 + 3) * 8  # a: pages 2 and 1 left (4 and 3 read); b: all three
    reader.take(a)
    assert reader.unread_bytes() <= 3 * 8  # b's pages, some begun now that there is room
    reader.drop(b)
    assert reader.unread_bytes() == 0
