"""The remote tier over every store: `MemoryStore` (in process) and a real `mooncake_master` on 127.0.0.1 (started
and stopped here). Two SSD tiers in separate directories play two servers sharing the store. No SGLang."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from sglang_tiered.storage.mooncake_store import MooncakeAddress, MooncakeStore
from sglang_tiered.storage.remote import MemoryStore, RemoteError
from sglang_tiered.storage.remote_tier import RemoteTier
from sglang_tiered.storage.ssd_tier import SSDTier, check_integrity
from tests.unit.test_ssd_tier import PAGE, empty, joined, key, ns, page, page_file

RETRY = 0.2  # seconds between reconnect attempts in these tests


@pytest.fixture(scope="module")
def master(tmp_path_factory) -> Iterator:
    pytest.importorskip("mooncake.store", reason="Mooncake is installed by scripts/setup.sh")
    from sglang_tiered.mooncake_master import MooncakeMaster

    with MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as m:
        yield m


class Shared:
    """One store as two servers see it: `connect()` gives each server its own client."""

    def __init__(self, kind: str, master) -> None:
        self.kind, self.master = kind, master
        self.memory = MemoryStore()

    def connect(self):
        if self.kind == "memory":
            if self.memory.down:
                raise RemoteError("memory store is down")
            return self.memory
        address = MooncakeAddress.parse(self.master.url, self.master.metadata_url)
        return MooncakeStore(address, segment_bytes=32 << 20, object_bytes=64 << 10, local_host="127.0.0.1")

    def set_down(self, down: bool) -> None:
        if self.kind == "memory":
            self.memory.down = down
        elif down:
            self.master.stop()
        else:
            self.master.start()


# (each pair of Mooncake clients takes ~3-4 s to close, so the Mooncake runs of these tests are left to the full
# suite; the Mooncake-only tests below keep a real master in `--quick`)
@pytest.fixture(params=["memory", pytest.param("mooncake", marks=pytest.mark.slow)])
def shared(request) -> Shared:
    return Shared(request.param, request.getfixturevalue("master") if request.param == "mooncake" else None)


@pytest.fixture
def servers(tmp_path, shared) -> Iterator[tuple[RemoteTier, RemoteTier]]:
    """Two servers (same namespace, separate SSD directories) on the shared store. A unique salt per test keeps
    tests apart on the module's one Mooncake master."""
    salt = f"{tmp_path.name}-{time.monotonic_ns()}"
    made = [RemoteTier(shared.connect, SSDTier(tmp_path / name, ns(salt=salt), 1 << 20), retry_s=RETRY)
            for name in ("a", "b")]
    yield made[0], made[1]
    closing = [threading.Thread(target=r.close) for r in made]  # a Mooncake client takes ~2 s to close
    for t in closing:
        t.start()
    for t in closing:
        t.join()
    for r in made:
        r.tier.close()


def stored_on(a: RemoteTier, seeds: list[int]) -> list[str]:
    """Write pages on server `a`'s SSD and publish them; wait until they are in the store."""
    keys = [key(s) for s in seeds]
    assert all(a.tier.write_pages([(k, page(s)) for k, s in zip(keys, seeds)]))
    a.publish(keys)
    assert a.drain()
    return keys


def until(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_a_page_published_on_one_server_is_served_on_the_other(servers):
    a, b = servers
    keys = stored_on(a, [1, 2, 3])
    assert a.stats.remote_published_pages == 3 and a.stats.remote_bytes_written > 3 * PAGE
    assert b.leading_hits(keys + [key(99)]) == 3
    out = empty()
    assert b.fetch([(keys[1], out)]) == [True] and joined(out) == joined(page(2))
    assert b.drain() and b.tier.contains(keys[1]) and page_file(b.tier, keys[1]).exists()  # now a local SSD page
    again = empty()
    assert b.tier.read_pages([(keys[1], again)]) == [True] and joined(again) == joined(page(2))
    assert b.stats.remote_hit_pages == 1 and b.stats.imported_pages == 1  # (kept on B's SSD)
    assert b.fetch([(key(99), empty())]) == [False] and b.stats.remote_miss_pages == 1
    first, last = empty(), empty()  # one round trip for several pages, a miss among them
    assert b.fetch([(keys[0], first), (key(98), empty()), (keys[2], last)]) == [True, False, True]
    assert joined(first) == joined(page(1)) and joined(last) == joined(page(3))
    assert b.drain() and b.tier.contains(keys[2]) and not b.tier.contains(key(98))
    check_integrity(b.tier)


def test_publishing_twice_puts_once(servers):
    a, _ = servers
    stored_on(a, [1])
    stored_on(a, [1])
    assert a.stats.remote_published_pages == 1


def test_another_namespace_sees_nothing(tmp_path, servers, shared):
    a, _ = servers
    keys = stored_on(a, [4])
    other = ns(page_size=32, salt=a.tier.namespace.salt)  # same keys, other page size
    c = RemoteTier(shared.connect, SSDTier(tmp_path / "c", other, 1 << 20), retry_s=RETRY)
    try:
        assert c.leading_hits(keys) == 0
        assert c.fetch([(keys[0], empty())]) == [False] and not c.tier.contains(keys[0])
    finally:
        c.close()


def test_a_corrupt_object_is_a_counted_miss_and_not_kept(servers):
    a, b = servers
    k = key(5)
    assert a.tier.write_pages([(k, page(5))]) == [True]
    path = page_file(a.tier, k)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot on A's disk after the write: A publishes what the file holds
    path.write_bytes(bytes(data))
    a.publish([k])
    assert a.drain()
    assert b.leading_hits([k]) == 1
    assert b.fetch([(k, empty())]) == [False] and b.drain()
    assert b.stats.remote_corrupt_pages == 1 and b.stats.remote_hit_pages == 0 and not b.tier.contains(k)
    check_integrity(b.tier)


def test_a_foreign_object_under_our_key_is_a_counted_miss(tmp_path, servers, shared):
    """A page of another namespace stored under this namespace's object name (a bug elsewhere, a key collision):
    its header names the other namespace, so it is refused."""
    a, b = servers
    intruder = SSDTier(tmp_path / "x", ns(model="other:1", salt=a.tier.namespace.salt), 1 << 20)
    k = key(6)
    intruder.write_pages([(k, page(6))])
    store = shared.connect()
    try:
        store.put(a.object_key(k), intruder.page_blob(k))
        assert b.fetch([(k, empty())]) == [False] and b.drain()
        assert b.stats.remote_foreign_pages == 1 and not b.tier.contains(k)
    finally:
        if store is not shared.memory:
            store.close()


def test_store_down_means_misses_and_it_comes_back(servers, shared):
    """Down: lookups miss at once, publishes wait; back (a restarted Mooncake master is empty): pages written
    meanwhile are published, and everything works again."""
    a, b = servers
    keys = stored_on(a, [10, 11])
    shared.set_down(True)
    try:
        assert b.leading_hits(keys) == 0 and not b.up
        assert b.fetch([(keys[0], empty())]) == [False]
        assert b.stats.remote_errors >= 1 and b.stats.remote_up == 0
        assert a.tier.write_pages([(key(12), page(12))]) == [True]
        a.publish([key(12)])  # deferred until the store answers; kept locally meanwhile
        assert a.drain() and a.tier.contains(key(12)) and a.stats.remote_published_pages == 2
    finally:
        shared.set_down(False)
    assert until(lambda: b.up and a.up), "did not reconnect"
    assert until(lambda: b.leading_hits([key(12)]) == 1), "the page written while down was not published"
    assert a.stats.remote_dropped_pages == 0
    # works again (a restarted Mooncake master has forgotten everything before; its clients re-mount their
    # segments within seconds, and publishes that fail meanwhile are dropped and may be retried)
    later = [key(13)]
    assert a.tier.write_pages([(later[0], page(13))]) == [True]
    assert until(lambda: (a.publish(later), a.drain(), b.leading_hits(later) == 1)[-1])
    out = empty()
    assert b.fetch([(later[0], out)]) == [True] and joined(out) == joined(page(13))


def test_unreachable_at_start_runs_local_only_and_connects_later(tmp_path, shared):
    shared.set_down(True)
    r = None
    try:
        t0 = time.monotonic()
        r = RemoteTier(shared.connect, SSDTier(tmp_path / "a", ns(salt=f"late-{time.monotonic_ns()}"), 1 << 20),
                       retry_s=RETRY)
        assert time.monotonic() - t0 < 5, "startup must not wait for a dead master"
        assert not r.up and r.leading_hits([key(1)]) == 0
    finally:
        shared.set_down(False)
    try:
        assert until(lambda: r.up)
    finally:
        r.close()


class BlockingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def put(self, key: str, blob: bytes) -> None:
        self.release.wait()
        super().put(key, blob)


def test_publish_never_blocks_and_drops_beyond_the_queue(tmp_path):
    store = BlockingStore()
    r = RemoteTier(lambda: store, SSDTier(tmp_path / "a", ns(), 1 << 20), queue_pages=2, retry_s=RETRY)
    try:
        keys = [key(i) for i in range(6)]
        assert all(r.tier.write_pages([(k, page(i)) for i, k in enumerate(keys)]))
        t0 = time.monotonic()
        r.publish(keys)  # one in the worker's hands, two queued, the rest dropped
        assert time.monotonic() - t0 < 0.5
        assert until(lambda: r.stats.remote_dropped_pages >= 3)
        store.release.set()
        assert r.drain()
        assert r.stats.remote_published_pages + r.stats.remote_dropped_pages == 6
        for k in keys:  # dropped ones are published when written again
            r.publish([k])
            assert r.drain()
        assert r.stats.remote_published_pages == 6
    finally:
        store.release.set()
        r.close()


def test_a_refused_put_keeps_the_store_up_and_is_retried(tmp_path):
    """A store that answers but refuses a page (full) is not marked down -- what it holds is still found and served --
    and the page waits, published by a retry once the store takes it (nothing dropped)."""
    store = MemoryStore()
    a, b = (RemoteTier(lambda: store, SSDTier(tmp_path / name, ns(), 1 << 20), retry_s=RETRY) for name in "ab")
    try:
        first = stored_on(a, [1])
        store.refuse_puts = True
        refused = stored_on(a, [2])
        time.sleep(3 * RETRY)  # retried, refused again
        assert a.stats.remote_published_pages == 1 and a.up and a.stats.remote_up == 1 and a.stats.remote_errors >= 2
        assert b.leading_hits(first + refused) == 1
        out = empty()
        assert b.fetch([(first[0], out)]) == [True] and joined(out) == joined(page(1))
        store.refuse_puts = False
        assert until(lambda: b.leading_hits(first + refused) == 2), "the refused page was not published"
        # (the page is visible to b as soon as the put returns; a counts it just after)
        assert until(lambda: a.stats.remote_published_pages == 2) and a.stats.remote_dropped_pages == 0
    finally:
        for r in (a, b):
            r.close()
            r.tier.close()


def test_refused_pages_go_out_when_a_later_put_succeeds(tmp_path):
    """The store takes a new page before the refused one's retry is due: the refused page goes out then, instead of
    waiting for a refusal that may never come."""
    store = MemoryStore()
    retry = 1.0
    a, b = (RemoteTier(lambda: store, SSDTier(tmp_path / name, ns(), 1 << 20), retry_s=retry) for name in "ab")
    try:
        store.refuse_puts = True
        refused = stored_on(a, [1])
        assert until(lambda: a.stats.remote_errors >= 2)  # refused, and refused again by the first retry
        store.refuse_puts = False
        later = stored_on(a, [2])
        assert until(lambda: a.stats.remote_published_pages == 2, timeout=3 * retry), a.stats.remote_published_pages
        assert b.leading_hits(refused) == 1 and b.leading_hits(later) == 1
    finally:
        for r in (a, b):
            r.close()
            r.tier.close()


def test_mooncake_refuses_puts_beyond_its_room_and_still_answers(master):
    """Puts faster than Mooncake's eviction find no room: the put raises (saying so) while the store answers lookups,
    and once its eviction has run a put succeeds again -- what `RemoteTier` counts as refused, not down."""
    address = MooncakeAddress.parse(master.url, master.metadata_url)
    store = MooncakeStore(address, segment_bytes=16 << 20, object_bytes=1 << 20, local_host="127.0.0.1")
    try:
        blob, name = bytes(1 << 20), f"full-{time.monotonic_ns()}"
        with pytest.raises(RemoteError, match="no room"):
            for i in range(512):  # 512 MB at once into a pool of 16 MB (and whatever other clients still lend)
                store.put(f"{name}-{i}", blob)
        assert store.exists([f"{name}-0"]) in ([True], [False])  # answers (evicted or not), raises nothing

        def put_again() -> bool:
            try:
                store.put(f"{name}-later", blob)
                return True
            except RemoteError:
                return False
        assert until(put_again, timeout=30)
    finally:
        store.close()


def test_mooncake_batches_larger_than_the_transfer_buffer(master):
    """A batched get whose objects do not fit in the client's transfer buffer at once is split (unsplit, Mooncake
    answers b"" for the objects beyond the buffer)."""
    address = MooncakeAddress.parse(master.url, master.metadata_url)
    store = MooncakeStore(address, segment_bytes=32 << 20, object_bytes=1 << 20, buffer_objects=4,
                          local_host="127.0.0.1")
    try:
        blobs = {f"batch-{time.monotonic_ns()}-{i}": bytes([i]) * (900 << 10) for i in range(10)}
        for k, b in blobs.items():
            store.put(k, b)
        assert store.get_many(list(blobs)) == list(blobs.values())  # 9 MB through a 8 MB buffer, 2 per batch
    finally:
        store.close()
