"""The repacker's payload stash (pure): only expected pages are kept, within the byte budget, handed over once, and
nothing stays behind once every offer that expected a page is over."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sglang_tiered.storage.stash import PayloadStash


def segments(seed: int, n: int = 4, size: int = 64) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for _ in range(n)]


def test_an_expected_page_is_kept_byte_for_byte_and_handed_over_once():
    stash = PayloadStash(1 << 20)
    stash.expect(["a", "b"])
    assert stash.keep("a", segments(1))
    assert stash.used_bytes == 256
    assert stash.take("a") == b"".join(bytes(s) for s in segments(1))
    assert stash.take("a") is None and stash.used_bytes == 0


def test_a_page_not_expected_is_not_kept():
    stash = PayloadStash(1 << 20)
    stash.expect(["a"])
    assert not stash.keep("b", segments(2))
    assert stash.take("b") is None and stash.used_bytes == 0


def test_segments_of_any_element_format_are_kept_as_their_bytes():
    stash = PayloadStash(1 << 20)
    stash.expect(["a"])
    halves = [memoryview(np.arange(8, dtype=np.uint16).tobytes()).cast("H"), memoryview(b"xyz")]
    assert stash.keep("a", halves)
    assert stash.take("a") == np.arange(8, dtype=np.uint16).tobytes() + b"xyz"


def test_the_budget_bounds_what_is_kept_and_nothing_is_evicted_for_a_newcomer():
    stash = PayloadStash(600)  # two pages of 256 bytes, not three
    stash.expect(["a", "b", "c"])
    assert [stash.keep(k, segments(i)) for i, k in enumerate("abc")] == [True, True, False]
    assert stash.used_bytes == 512
    assert stash.take("a") is not None and stash.take("b") is not None and stash.take("c") is None
    assert stash.keep("c", segments(2)) and stash.used_bytes == 256  # room again


def test_a_page_keeps_its_copy_until_the_last_offer_expecting_it_is_over():
    stash = PayloadStash(1 << 20)
    stash.expect(["a", "b"])
    stash.expect(["b", "c"])
    assert stash.keep("a", segments(0)) and stash.keep("b", segments(1)) and stash.keep("c", segments(2))
    stash.forget(["a", "b"])  # the first offer's repack is over: "b" is still expected by the second
    assert stash.take("a") is None and stash.used_bytes == 512
    stash.forget(["b", "c"])
    assert stash.used_bytes == 0 and stash.take("b") is None and stash.take("c") is None
    assert not stash.keep("b", segments(1))  # no longer expected


def test_a_zero_budget_keeps_nothing_and_a_negative_one_is_refused():
    stash = PayloadStash(0)
    stash.expect(["a"])
    assert not stash.keep("a", segments(0))
    stash.forget(["a"])
    with pytest.raises(ValueError, match="capacity_bytes"):
        PayloadStash(-1)


def test_concurrent_keeps_of_one_page_keep_it_once_within_the_budget():
    stash = PayloadStash(1 << 20)
    keys = [f"k{i}" for i in range(50)]
    stash.expect(keys)
    results: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        got = [stash.keep(k, segments(i)) for i, k in enumerate(keys)]
        with lock:
            results.extend(got)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 50 and stash.used_bytes == 50 * 256
    stash.forget(keys)
    assert stash.used_bytes == 0
