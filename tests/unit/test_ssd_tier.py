"""SSD tier, page format, namespaces and eviction: real files in a temp directory, no SGLang."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import (
    PAGE_SUFFIX,
    CorruptPage,
    ForeignPage,
    read_page,
    write_page,
)
from sglang_tiered.storage.ssd_tier import NAMESPACE_FILE, ROOT_FILES, SSDTier, check_integrity
from tests.dirsize import sample_bytes

PAGE = 4096  # payload bytes per test page, split in segments like a layer_first host page
NS_FILE = 1024  # a bound of the namespace description's size (NAMESPACE.json), which counts against the capacity


def ns(**kw) -> Namespace:
    base = dict(model="m:abc", dtype="torch.bfloat16", page_size=64, layout="layer_first", layer_num=2, kv_heads=1,
                head_dim=8)
    base.update(kw)
    return Namespace(**base)


def page(seed: int, nseg: int = 4) -> list[memoryview]:
    rnd = random.Random(seed)
    return [memoryview(bytearray(rnd.randbytes(PAGE // nseg))) for _ in range(nseg)]


def empty(nseg: int = 4) -> list[memoryview]:
    return [memoryview(bytearray(PAGE // nseg)) for _ in range(nseg)]


def key(i: int) -> str:
    return f"{i:064x}"


def joined(segs) -> bytes:
    return b"".join(bytes(s) for s in segs)


def page_file(tier: SSDTier, k: str) -> Path:
    return tier.dir / k[:2] / f"{k}{PAGE_SUFFIX}"


# ------------------------------------------------------------------ keys and namespaces
def test_namespace_id_is_stable_and_covers_every_field():
    a = ns()
    assert a.id == ns().id and len(a.id) == 16
    variants = [ns(model="other:123"), ns(dtype="torch.float16"), ns(page_size=32), ns(layout="page_first"),
                ns(layer_num=3), ns(kv_heads=2), ns(head_dim=16), ns(tp_rank=1, tp_size=2), ns(tp_size=2),
                ns(pp_rank=1, pp_size=2), ns(salt="tenant-b")]
    ids = {v.id for v in variants}
    assert a.id not in ids and len(ids) == len(variants)


def test_page_bytes():
    assert ns(layer_num=30, kv_heads=3, head_dim=64).page_bytes(2) == 30 * 2 * 64 * 3 * 64 * 2  # 64 tokens of SmolLM2


# ------------------------------------------------------------------ page format
def test_page_round_trip(tmp_path):
    src, dst = page(1), empty()
    write_page(str(tmp_path / "p"), "ns1", "k1", src)
    assert read_page(str(tmp_path / "p"), "ns1", "k1", dst) == PAGE
    assert joined(dst) == joined(src)


def test_checksum_mismatch_is_corrupt(tmp_path):
    path = tmp_path / "p"
    write_page(str(path), "ns1", "k1", page(1))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPage, match="checksum"):
        read_page(str(path), "ns1", "k1", empty())


def test_each_segment_is_verified(tmp_path):
    path = tmp_path / "p"
    write_page(str(path), "ns1", "k1", page(5))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # corrupt the last segment only
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPage, match="segment 3 checksum"):
        read_page(str(path), "ns1", "k1", empty())


def test_pages_with_one_whole_payload_checksum_still_read(tmp_path):
    """Pages written before per-segment checksums (one crc32 over the payload) are served whole."""
    import struct
    import zlib

    import msgpack

    segs = page(6)
    payload = joined(segs)
    meta = msgpack.packb({"ns": "ns1", "key": "k1", "nbytes": len(payload), "crc32": zlib.crc32(payload)})
    path = tmp_path / "old"
    path.write_bytes(struct.pack("<8sII", b"SGTKV\x00\x01\x00", len(meta), zlib.crc32(meta)) + meta + payload)
    out = empty()
    assert read_page(str(path), "ns1", "k1", out) == PAGE and joined(out) == payload
    data = bytearray(path.read_bytes())
    data[-9] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPage, match="payload checksum"):
        read_page(str(path), "ns1", "k1", empty())


@pytest.mark.parametrize("cut", [3, 20, 500, 4000])
def test_truncated_page_is_corrupt(tmp_path, cut):
    path = tmp_path / "p"
    write_page(str(path), "ns1", "k1", page(1))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut])
    with pytest.raises(CorruptPage):
        read_page(str(path), "ns1", "k1", empty())


def test_foreign_namespace_key_or_size(tmp_path):
    path = tmp_path / "p"
    write_page(str(path), "ns1", "k1", page(1))
    with pytest.raises(ForeignPage):
        read_page(str(path), "ns2", "k1", empty())
    with pytest.raises(ForeignPage):
        read_page(str(path), "ns1", "k2", empty())
    with pytest.raises(ForeignPage):
        read_page(str(path), "ns1", "k1", [memoryview(bytearray(PAGE // 2))])


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def disk_full(fd, bufs, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", disk_full)
    with pytest.raises(OSError):
        write_page(str(tmp_path / "p"), "ns1", "k1", page(1))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ tier
def test_tier_round_trip_and_stats(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    assert tier.write_pages([(key(i), page(i)) for i in range(3)]) == [True] * 3
    assert tier.leading_hits([key(0), key(1), key(9), key(2)]) == 2
    out = [(key(i), empty()) for i in range(3)]
    assert tier.read_pages(out) == [True] * 3
    assert all(joined(segs) == joined(page(i)) for i, (_, segs) in enumerate(out))
    assert tier.read_pages([(key(7), empty())]) == [False]
    assert tier.write_pages([(key(0), page(0))]) == [True]  # already stored
    s = tier.stats.snapshot()
    assert (s["written_pages"], s["hit_pages"], s["miss_pages"], s["dedup_pages"]) == (3, 3, 1, 1)
    assert s["bytes_read"] == 3 * PAGE and s["stored_pages"] == 3
    check_integrity(tier)


def test_torn_write_is_invisible_and_cleaned_on_restart(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    tier.write_pages([(key(1), page(1))])
    # a crash mid-write leaves only a temporary file behind
    tmp = page_file(tier, key(2)).with_name(f"{key(2)}{PAGE_SUFFIX}.123.456.tmp")
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"partial")
    assert not tier.contains(key(2))
    tier2 = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    assert not tmp.exists() and not tier2.contains(key(2)) and tier2.contains(key(1))
    check_integrity(tier2)


def test_corrupt_page_is_a_counted_miss_and_removed(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    tier.write_pages([(key(1), page(1))])
    f = page_file(tier, key(1))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert tier.read_pages([(key(1), empty())]) == [False]
    assert tier.stats.snapshot()["corrupt_pages"] == 1
    assert not f.exists() and not tier.contains(key(1))
    check_integrity(tier)


def test_foreign_page_under_our_name_is_never_served(tmp_path):
    """A page file copied in from another configuration's directory: same key, other namespace."""
    other = SSDTier(tmp_path, ns(dtype="torch.float16"), capacity_bytes=10 * PAGE)
    other.write_pages([(key(1), page(1))])
    mine = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    assert not mine.contains(key(1))  # separate directories
    dst = page_file(mine, key(1))
    dst.parent.mkdir(exist_ok=True)
    dst.write_bytes(page_file(other, key(1)).read_bytes())
    mine = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)  # restart: the file is indexed by name ...
    assert mine.read_pages([(key(1), empty())]) == [False]  # ... but its header says otherwise
    assert mine.stats.snapshot()["foreign_pages"] == 1 and not dst.exists()


def test_vanished_file_is_a_lost_miss(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    tier.write_pages([(key(1), page(1))])
    page_file(tier, key(1)).unlink()
    assert tier.read_pages([(key(1), empty())]) == [False]
    assert tier.stats.snapshot()["lost_pages"] == 1
    check_integrity(tier)


def test_capacity_is_never_exceeded_and_lru_is_evicted(tmp_path):
    per_file = PAGE + 200  # header included, upper bound
    tier = SSDTier(tmp_path, ns(), capacity_bytes=3 * per_file + NS_FILE)
    for i in range(3):  # one at a time: a batch is written in parallel and finishes in any order
        tier.write_pages([(key(i), page(i))])
    assert tier.read_pages([(key(0), empty())]) == [True]  # 0 is now most recent; 1 is the LRU page
    tier.write_pages([(key(3), page(3))])
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    for i in range(4, 40):
        assert tier.write_pages([(key(i), page(i))]) == [True]
        assert tier.used_bytes <= tier.capacity_bytes
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())  # every file, not just pages
        assert disk == tier.used_bytes <= tier.capacity_bytes
    assert len(tier) == 3 and tier.stats.snapshot()["evicted_pages"] == 37
    check_integrity(tier)


def test_page_larger_than_capacity_is_rejected_without_evicting(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=PAGE // 2 + NS_FILE)
    small = [memoryview(bytearray(b"x" * 100))]
    assert tier.write_pages([(key(0), small)]) == [True]
    assert tier.write_pages([(key(1), page(1))]) == [False]
    s = tier.stats.snapshot()
    assert s["rejected_pages"] == 1 and s["evicted_pages"] == 0 and tier.contains(key(0)) and len(tier) == 1


def test_disk_error_on_write_is_counted_not_raised(tmp_path, monkeypatch):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    before = tier.used_bytes  # the namespace description

    def disk_full(fd, bufs, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", disk_full)
    assert tier.write_pages([(key(1), page(1))]) == [False]
    monkeypatch.undo()
    assert tier.stats.snapshot()["io_errors"] == 1 and tier.used_bytes == before and not tier.contains(key(1))
    assert tier.write_pages([(key(1), page(1))]) == [True]  # space is back, writes resume
    check_integrity(tier)


def test_index_recovered_after_restart(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=100 * PAGE)
    tier.write_pages([(key(i), page(i)) for i in range(5)])
    used = tier.used_bytes
    tier.close()
    again = SSDTier(tmp_path, ns(), capacity_bytes=100 * PAGE)
    assert len(again) == 5 and again.used_bytes == used
    out = [(key(i), empty()) for i in range(5)]
    assert again.read_pages(out) == [True] * 5
    assert all(joined(s) == joined(page(i)) for i, (_, s) in enumerate(out))


def test_restart_with_smaller_capacity_keeps_most_recent(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=100 * PAGE)
    tier.write_pages([(key(i), page(i)) for i in range(5)])
    for i in range(5):
        os.utime(page_file(tier, key(i)), (2_000_000 + i, 2_000_000 + i))  # key(4) most recent
    small = SSDTier(tmp_path, ns(), capacity_bytes=2 * (PAGE + 200) + NS_FILE)
    assert [small.contains(key(i)) for i in range(5)] == [False, False, False, True, True]
    assert sum(1 for _ in small.dir.rglob(f"*{PAGE_SUFFIX}")) == 2


def test_concurrent_readers_and_writers(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=20 * (PAGE + 200) + NS_FILE, io_threads=4)
    errors: list[str] = []

    def writer(base: int) -> None:
        for i in range(base, base + 40):
            tier.write_pages([(key(i % 60), page(i % 60))])

    def reader() -> None:
        for i in range(200):
            k = i % 60
            segs = empty()
            if tier.read_pages([(key(k), segs)])[0] and joined(segs) != joined(page(k)):
                errors.append(f"page {k} served wrong bytes")

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 20, 40)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = tier.stats.snapshot()
    assert s["corrupt_pages"] == 0 and s["foreign_pages"] == 0
    check_integrity(tier)
    assert tier.used_bytes <= tier.capacity_bytes


# ------------------------------------------------------------------ one budget for every file under the directory
def disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_every_kind_of_file_shares_one_capacity_and_one_lru(tmp_path):
    per_file = PAGE + 200
    tier = SSDTier(tmp_path, ns(), capacity_bytes=4 * per_file + NS_FILE)
    tier.write_pages([(key(0), page(0))])
    tier.write_pages([(key(0) + ".x", page(10, nseg=2))], kind="activation")
    tier.write_pages([("c." + "ab" * 16, page(11, nseg=2))], kind="chunk")
    tier.write_pages([(key(1), page(1))])
    assert tier.bytes_by_kind()["chunk"] > 0 and tier.bytes_by_kind()["activation"] > 0
    tier.write_pages([(key(2), page(2))])  # over: page 0 goes, and its activation with it
    assert not tier.contains(key(0)) and not tier.contains(key(0) + ".x") and tier.contains("c." + "ab" * 16)
    tier.write_pages([(key(3), page(3))])  # fits
    tier.write_pages([(key(4), page(4))])  # the chunk is next in recency
    assert not tier.contains("c." + "ab" * 16) and [tier.contains(key(i)) for i in (1, 2, 3, 4)] == [True] * 4
    assert disk_bytes(tmp_path) == tier.used_bytes <= tier.capacity_bytes
    check_integrity(tier)


def test_files_of_other_namespaces_count_and_go_first(tmp_path):
    other = SSDTier(tmp_path, ns(dtype="torch.float16"), capacity_bytes=100 * PAGE)
    other.write_pages([(key(i), page(i)) for i in range(3)])
    (tmp_path / "chunks").mkdir()  # an older layout's directory
    (tmp_path / "chunks" / "stale.kvp").write_bytes(b"s" * PAGE)
    for age, f in enumerate([other.dir / NAMESPACE_FILE, *(page_file(other, key(i)) for i in range(3))]):
        os.utime(f, (2_000_000 + age, 2_000_000 + age))  # file system clocks tie within milliseconds
    capacity = 4 * (PAGE + 200) + NS_FILE
    mine = SSDTier(tmp_path, ns(), capacity_bytes=capacity, scan_foreign=True)
    assert disk_bytes(tmp_path) == mine.used_bytes <= capacity
    assert mine.bytes_by_kind()["foreign"] == disk_bytes(tmp_path) - disk_bytes(mine.dir) > 3 * PAGE
    mine.write_pages([(key(0), page(0))])
    assert not (other.dir / NAMESPACE_FILE).exists()  # the oldest foreign file went first
    for i in range(1, 4):
        mine.write_pages([(key(i), page(i))])
        assert disk_bytes(tmp_path) == mine.used_bytes <= capacity
    assert mine.bytes_by_kind()["foreign"] == 0 and all(mine.contains(key(i)) for i in range(4))
    check_integrity(mine)


def test_another_rank_of_the_same_server_is_not_foreign(tmp_path):
    rank1 = SSDTier(tmp_path, ns(tp_rank=1, tp_size=2), capacity_bytes=10 * PAGE)
    rank1.write_pages([(key(1), page(1))])
    rank0 = SSDTier(tmp_path, ns(tp_rank=0, tp_size=2), capacity_bytes=10 * PAGE, scan_foreign=True)
    assert rank0.bytes_by_kind()["foreign"] == 0 and rank1.contains(key(1))


def test_the_servers_root_files_count_as_meta_not_foreign(tmp_path):
    """The compute-or-load profile and the launcher's dtype choice sit at the root: counted, never evicted as
    another server's files."""
    for i, name in enumerate(ROOT_FILES):
        (tmp_path / name).write_bytes(b"{}" * (50 + i))
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE, scan_foreign=True)
    kinds = tier.bytes_by_kind()
    assert kinds["foreign"] == 0
    assert kinds["meta"] == disk_bytes(tmp_path) == tier.used_bytes  # theirs and NAMESPACE.json


def test_meta_files_count_and_a_write_without_room_is_refused(tmp_path):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=2 * (PAGE + 200) + NS_FILE)
    tier.write_pages([(key(0), page(0))])
    assert tier.meta.write("stats/x.json", b"{}" * 100)
    assert (tmp_path / "stats" / "x.json").read_bytes() == b"{}" * 100
    assert tier.meta.reserve(f"{tier.ns_id}/appended.log", 2 * PAGE)  # evicts page 0 for the log's room
    assert not tier.contains(key(0))
    assert not tier.meta.reserve(f"{tier.ns_id}/appended.log", 10 * PAGE)
    tier.meta.settle(f"{tier.ns_id}/appended.log", 0)
    with tier.meta.scratch("probe", PAGE) as path:
        path.write_bytes(b"p" * PAGE)
        assert disk_bytes(tmp_path) <= tier.used_bytes
    assert not path.exists()
    with tier.meta.scratch("probe", 100 * PAGE) as path:
        assert path is None
    assert disk_bytes(tmp_path) <= tier.used_bytes <= tier.capacity_bytes
    check_integrity(tier)


def test_files_are_private_to_the_server(tmp_path):
    tier = SSDTier(tmp_path / "ssd", ns(), capacity_bytes=10 * PAGE)
    tier.write_pages([(key(1), page(1))])
    tier.write_pages([("c." + "cd" * 16, page(2))], kind="chunk")
    tier.meta.write("stats/s.json", b"{}")
    for p in (tmp_path / "ssd").rglob("*"):
        mode = p.stat().st_mode & 0o777
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p} has mode {oct(mode)}"


def test_the_directory_never_exceeds_the_capacity_under_concurrent_writers(tmp_path):
    """Sampled while 4 threads write pages, activations and chunks into a tier 6 pages large."""
    tier = SSDTier(tmp_path, ns(), capacity_bytes=6 * (PAGE + 200) + NS_FILE, io_threads=4)
    stop = threading.Event()
    seen: list[int] = []

    def sample() -> None:
        while not stop.is_set():
            seen.append(sample_bytes(tmp_path))

    def writer(base: int) -> None:
        for i in range(base, base + 60):
            kind = ("page", "activation", "chunk")[i % 3]
            k = key(i) if kind == "page" else key(i - 1) + ".x" if kind == "activation" else f"c.{i:032x}"
            tier.write_pages([(k, page(i, nseg=2 if kind != "page" else 4))], kind=kind)

    watcher = threading.Thread(target=sample)
    watcher.start()
    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 100, 200, 300)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert seen and max(seen) <= tier.capacity_bytes
    assert tier.stats.snapshot()["evicted_pages"] > 0
    check_integrity(tier)


def test_a_meta_file_that_cannot_be_written_is_counted_and_gives_its_room_back(tmp_path, monkeypatch):
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10 * PAGE)
    assert tier.meta.write("stats/s.json", b"x" * 100)
    before = tier.used_bytes

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    assert not tier.meta.write("stats/s.json", b"y" * 300)  # a rewrite: the old file stays
    assert not tier.meta.write("stats/new.json", b"z" * 50)  # a new file: nothing stays
    monkeypatch.undo()
    assert tier.stats.snapshot()["io_errors"] == 2 and tier.used_bytes == before
    assert (tmp_path / "stats" / "s.json").read_bytes() == b"x" * 100 and not (tmp_path / "stats" / "new.json").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert tier.meta.write("stats/new.json", b"z" * 50)  # room is back, writes resume
    assert disk_bytes(tmp_path) == tier.used_bytes
    check_integrity(tier)
