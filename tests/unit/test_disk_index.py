"""The SSD directory's budget (`DiskIndex`): exact keys and victims of every decision, no files."""

from __future__ import annotations

import random

import pytest

from sglang_tiered.storage.disk_index import KINDS, DiskIndex, Victim


def stored(index: DiskIndex, key: str, size: int, kind: str = "page", **kw) -> tuple[Victim, ...]:
    """reserve + commit; returns the victims."""
    res = index.reserve(key, size, kind, **kw)
    assert res.admitted, f"{key} refused"
    assert index.used <= index.capacity
    assert index.commit(key, size) == ()
    index.check()
    return res.victims


def keys(victims) -> list[str]:
    return [v.key for v in victims]


def test_least_recently_used_goes_first_and_a_touch_saves_it():
    index = DiskIndex(300)
    for k in "abc":
        stored(index, k, 100)
    index.touch("a")
    assert keys(stored(index, "d", 100)) == ["b"]
    assert keys(stored(index, "e", 150)) == ["c", "a"]
    assert [index.contains(k) for k in "abcde"] == [False, False, False, True, True]
    assert index.used == 250


def test_reservations_in_flight_count_and_are_never_victims():
    index = DiskIndex(300)
    stored(index, "a", 100)
    res = index.reserve("b", 100, "page")  # being written
    assert res.admitted and index.used == 200
    res = index.reserve("c", 150, "page")
    assert res.admitted and keys(res.victims) == ["a"] and index.used == 250  # b is not a candidate
    assert not index.reserve("d", 100, "page").admitted  # only reservations left
    assert index.commit("b", 90) == () and index.used == 240  # the actual size replaces the bound
    index.check()


def test_a_commit_larger_than_its_reservation_evicts_the_difference_at_once():
    index = DiskIndex(300)
    stored(index, "a", 100)
    stored(index, "b", 100)
    assert index.reserve("g.1", 100, "group").admitted
    assert keys(index.commit("g.1", 150)) == ["a"] and index.used == 250
    index.check()


def test_a_write_that_cannot_fit_evicts_nothing():
    index = DiskIndex(300, pinned=lambda k: k == "a")
    stored(index, "a", 100)
    stored(index, "b", 100)
    res = index.reserve("c", 250, "page")  # b alone frees 100 of the 150 needed; a is pinned
    assert not res.admitted and res.victims == () and index.contains("b")
    assert not index.reserve("x", 301, "page").admitted  # larger than the capacity
    index.check()


def test_stored_or_in_flight_keys_are_not_reserved_twice():
    index = DiskIndex(1000)
    stored(index, "a", 100)
    assert index.reserve("a", 100, "page").stored
    assert index.reserve("b", 100, "page").admitted
    assert index.reserve("b", 100, "page").stored  # being written
    index.abort("b")
    assert index.used == 100 and not index.contains("b")
    index.check()


def test_an_activation_leaves_with_its_page_and_on_its_own():
    index = DiskIndex(400)
    stored(index, "p1.x", 50, "activation", parent="p1")  # may arrive before its page
    stored(index, "p1", 100)
    stored(index, "p2", 100)
    stored(index, "p2.x", 50, "activation", parent="p2")
    index.touch("p1.x")  # recency of the activation does not keep its page
    assert keys(stored(index, "p3", 200)) == ["p1", "p1.x"]
    assert keys(index.remove("p2")) == ["p2", "p2.x"]
    assert index.bytes_by_kind()["activation"] == 0
    stored(index, "p4.x", 50, "activation", parent="p4")  # its page never came
    stored(index, "p5", 100)
    assert keys(stored(index, "p6", 100)) == ["p3"]
    index.touch("p5")
    assert keys(stored(index, "p7", 200)) == ["p4.x"]  # a candidate of its own


def test_meta_is_counted_never_evicted_and_grows_by_resize():
    index = DiskIndex(300)
    stored(index, "m:log", 50, "meta")
    stored(index, "a", 100)
    stored(index, "b", 100)
    res = index.resize("m:log", 120)
    assert res.admitted and keys(res.victims) == ["a"]
    assert not index.resize("m:log", 301).admitted and index.size("m:log") == 120
    assert index.resize("m:log", 10).admitted and index.used == 110
    with pytest.raises(ValueError, match="only meta"):
        index.resize("b", 1)
    res = index.reserve("c", 200, "page")
    assert res.admitted and keys(res.victims) == ["b"]  # the log stays whatever its age
    index.commit("c", 200)
    index.check()


def test_foreign_files_go_before_everything_of_ours():
    index = DiskIndex(500)
    index.load("old", 100, "page")
    index.load("f:other/1", 100, "foreign")
    index.load("f:other/2", 100, "foreign")
    index.load("new", 100, "page")
    assert keys(stored(index, "x", 250)) == ["f:other/1", "f:other/2"]
    assert keys(stored(index, "y", 100)) == ["old"]


def test_a_group_is_one_entry_its_members_resolve_to_it():
    index = DiskIndex(1000)
    for k in ("p1", "p2", "p3"):
        stored(index, k, 100)
    stored(index, "p2.x", 30, "activation", parent="p2")
    res = index.reserve("g.1", 250, "group", keep=["p1", "p2"])
    assert res.admitted and res.victims == ()
    gone = index.commit_group("g.1", 220, ["p1", "p2"])
    assert keys(gone) == ["p1", "p2", "p2.x"]  # the members' files, and what depends on them
    assert index.contains("p1") and index.holder("p2") == "g.1" and index.group_of("p3") is None
    assert index.stored_pages() == 3 and index.used == 320
    index.touch("p3")
    index.touch("p1")  # touches the group
    assert keys(stored(index, "big", 700)) == ["p3"]
    assert keys(stored(index, "big2", 300)) == ["g.1"] and not index.contains("p1")
    index.check()


def test_a_pinned_group_or_page_stays_until_the_pin_says_no():
    pins = {"p1"}
    index = DiskIndex(300, pinned=lambda k: k in pins)
    stored(index, "p1", 100)
    stored(index, "p2", 100)
    assert keys(stored(index, "p3", 100)) == []
    assert keys(stored(index, "p4", 100)) == ["p2"]
    assert index.pinned_bytes() == 100
    pins.clear()  # expired
    assert keys(stored(index, "p5", 100)) == ["p1"]


def test_clear_removes_ours_with_dependents_but_not_meta_or_foreign():
    index = DiskIndex(1000)
    index.load("f:x", 10, "foreign")
    stored(index, "m:ns", 10, "meta")
    stored(index, "a", 100)
    stored(index, "a.x", 10, "activation", parent="a")
    stored(index, "c.1", 100, "chunk")
    assert sorted(keys(index.clear())) == ["a", "a.x", "c.1"]
    assert index.contains("f:x") and index.contains("m:ns")


def test_shrink_after_a_restart_with_a_smaller_capacity_keeps_the_most_recent_and_the_pinned():
    index = DiskIndex(250, pinned=lambda k: k == "old")
    for k in ("old", "a", "b", "c"):
        index.load(k, 100, "page")
    assert keys(index.shrink()) == ["a", "b"]


def test_bytes_by_kind_and_every_kind_is_known():
    index = DiskIndex(10_000)
    for i, kind in enumerate(k for k in KINDS if k != "foreign"):
        stored(index, f"k{i}", 10 * (i + 1), kind, **({"parent": "k0"} if kind == "activation" else {}))
    index.load("f:z", 7, "foreign")
    by = index.bytes_by_kind()
    assert by == {"page": 10, "activation": 20, "chunk": 30, "group": 40, "meta": 50, "foreign": 7, "in_flight": 0}
    with pytest.raises(ValueError, match="unknown entry kind"):
        index.reserve("q", 1, "log")


def test_random_operations_keep_every_invariant_and_the_bound():
    rng = random.Random(7)
    pins: set[str] = set()
    index = DiskIndex(5000, pinned=lambda k: k in pins)
    for step in range(3000):
        op = rng.random()
        key = f"p{rng.randrange(60)}"
        if op < 0.5:
            kind = rng.choice(["page", "chunk", "activation"])
            res = index.reserve(key + (".x" if kind == "activation" else ""), rng.randint(1, 900), kind,
                                parent=key if kind == "activation" else None)
            if res.admitted:
                k = key + (".x" if kind == "activation" else "")
                size = index.bytes_by_kind()["in_flight"]
                if rng.random() < 0.9:
                    index.commit(k, rng.randint(1, size))
                else:
                    index.abort(k)
        elif op < 0.6:
            index.remove(key)
        elif op < 0.7:
            index.touch(key)
        elif op < 0.75:
            pins.symmetric_difference_update({key})
        elif op < 0.8:
            members = [f"p{i}" for i in range(rng.randrange(60), 60) if index.kind(f"p{i}") == "page"][:3]
            res = index.reserve(f"g.{step}", 500, "group", keep=members)
            if res.admitted:
                assert not set(keys(res.victims)) & set(members)
                index.commit_group(f"g.{step}", rng.randint(100, 500), members)
        index.check()
        assert index.used <= index.capacity or index.pinned_bytes() > 0
