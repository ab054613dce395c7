"""The SSD tier: every file one server rank keeps under `--tiered-ssd-dir`, one budget (`DiskIndex`) over them.

Split by concern over the index and its lock: this module reads and writes page and activation files; group files
are `tier_groups.py`'s, meta and scratch files `tier_meta.py`'s, the recovery scan at startup `tier_scan.py`'s, where
each kind of entry lives `tier_layout.py`'s.

Files (under `<root>/<namespace id>/` unless said otherwise), by the index's kinds:
* page: `<key[:2]>/<key>.kvp`; activation: `<key[:2]>/<key>.x.kvp` (`activations.py`); chunk: `chunks/<hash>.kvp`
  (one segment per layer, `chunk_store.py`); group: `groups/<gid>.kvg` (`group_file.py`);
* meta: `NAMESPACE.json`, `<root>/stats/<namespace id>.json`, the root's own files (`ROOT_FILES`:
  the compute-or-load profile, the launcher's `--dtype auto` choice, the server's claim on the directory), probe
  files (`tier.meta`: `write`, `reserve`, `scratch`);
* foreign (`scan_foreign=True`, rank 0): any other file under the root that is not another rank's of this server.

Contracts
* Every byte this tier writes under the root is reserved in the index first (temporary files included), and
  victims' files are deleted under the same lock that chose them, before anyone can reserve their room: the files
  under the root (of this rank, or of the whole root with `scan_foreign`) never exceed `capacity_bytes`. Files are
  created 0600, directories 0700.
* `contains`/`leading_hits` answer from the index; they never touch the disk.
* `read_pages`/`write_pages` do blocking file I/O on a bounded thread pool (`io_threads`); call them from a
  background thread (SGLang's prefetch and backup threads do), never from the scheduler loop.
* A page is served only if its file is complete, its header names this namespace and key, its size matches, and its
  payload checksum matches. Anything else is a miss; the file is removed and counted (corrupt / foreign / lost).
* The index is rebuilt from the directory on start, in recency order taken from file mtimes (a read hit bumps the
  mtime).
* Only this process writes to its namespace directory (namespaces include the TP/PP rank).
* Groups: members stay addressable by their page keys (`contains`, `read_pages`: token-identical through the group's
  map); a group is accounted, touched and evicted as one unit.
* Retention: `pinned(key)` (a page key) keeps pinned pages, and groups holding one, from eviction until it says no.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, TypeVar

from sglang_tiered.storage import activations, group_file, tier_scan
from sglang_tiered.storage.disk_index import DiskIndex, Victim
from sglang_tiered.storage.files import make_dir, unlink_quiet
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import (
    CorruptPage,
    ForeignPage,
    PageReader,
    header_bound,
    read_page,
    write_file,
    write_page,
)
from sglang_tiered.storage.stash import PayloadStash
from sglang_tiered.storage.stats import TierStats
from sglang_tiered.storage.tier_groups import TierGroups
from sglang_tiered.storage.tier_layout import (  # noqa: F401 -- the tier's names, imported from here too
    CHUNK_PREFIX,
    DTYPE_FILE,
    FOREIGN_PREFIX,
    GROUP_PREFIX,
    META_PREFIX,
    NAMESPACE_FILE,
    ROOT_FILES,
    entry_path,
    page_path,
)
from sglang_tiered.storage.tier_meta import TierMeta

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A page request: its key and the buffers that hold (write) or receive (read) its payload, in order.
PageIO = tuple[str, Sequence[memoryview]]


class SSDTier:
    def __init__(
        self,
        root: str | os.PathLike,
        namespace: Namespace,
        capacity_bytes: int,
        *,
        io_threads: int = 4,
        before_write: Optional[Callable[[], object]] = None,
        pinned: Callable[[str], bool] = lambda key: False,
        scan_foreign: bool = False,
    ) -> None:
        """`before_write` runs in the I/O thread before each page write (e.g. `ForegroundGate.wait_idle`).
        `scan_foreign`: also count (and evict first) the root's files that belong to no rank of this server."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.namespace = namespace
        self.ns_id = namespace.id
        self.dir = self.root / self.ns_id
        self.capacity_bytes = int(capacity_bytes)
        self.stats = TierStats()
        self._before_write = before_write
        self.stash: Optional[PayloadStash] = None  # payloads kept for the repacker (`attach_stash`)
        self._index = DiskIndex(self.capacity_bytes, pinned=pinned)
        self._groups: dict[str, group_file.GroupMeta] = {}  # gid -> meta of a committed group
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="tiered-ssd-io")
        self.meta = TierMeta(self)  # meta and scratch files (tier_meta.py)
        self.groups = TierGroups(self)  # group files (tier_groups.py)
        make_dir(self.dir)
        self._rebuild_index(scan_foreign)
        self.meta.write(f"{self.ns_id}/{NAMESPACE_FILE}",
                        json.dumps(self.namespace.describe(), indent=2, sort_keys=True).encode(), replace=False)

    # ----------------------------------------------------------------- queries (index only)
    def contains(self, key: str) -> bool:
        with self._lock:
            return self._index.contains(key)

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` that are stored."""
        with self._lock:
            return self._index.leading_hits(keys)

    def group_of(self, key: str) -> Optional[group_file.GroupMeta]:
        """The committed group holding page `key`, or None (a plain page, or not stored)."""
        with self._lock:
            entry = self._index.group_of(key)
            return self._groups.get(entry[len(GROUP_PREFIX):]) if entry is not None else None

    @property
    def used_bytes(self) -> int:
        """Bytes of every file this tier keeps (and of writes in flight)."""
        with self._lock:
            return self._index.used

    def bytes_by_kind(self) -> dict[str, int]:
        with self._lock:
            return self._index.bytes_by_kind()

    def pinned_bytes(self) -> int:
        """Bytes of entries held by unexpired retention pins."""
        with self._lock:
            return self._index.pinned_bytes()

    def __len__(self) -> int:
        """Stored KV pages (plain or in groups)."""
        with self._lock:
            return self._index.stored_pages()

    # ----------------------------------------------------------------- data movement
    def read_pages(self, pages: Sequence[PageIO]) -> list[bool]:
        """Fill each page's buffers from disk. result[i] is False for a miss of any kind."""
        with self._lock:
            by_group: dict[str, list[int]] = {}
            for i, (key, _) in enumerate(pages):
                gid = self._index.group_of(key)
                if gid is not None:
                    by_group.setdefault(gid[len(GROUP_PREFIX):], []).append(i)
        if not by_group:
            return self._map(self._read_one, pages)
        grouped = {i for idx in by_group.values() for i in idx}
        out = [False] * len(pages)
        plain = [i for i in range(len(pages)) if i not in grouped]
        for i, ok in zip(plain, self._map(self._read_one, [pages[i] for i in plain])):
            out[i] = ok
        for gid, idx in by_group.items():
            for i, ok in zip(idx, self.groups.read_pages(gid, [pages[i] for i in idx])):
                out[i] = ok
        return out

    def open_page(self, key: str, segment_bytes: Sequence[int]) -> Optional[PageReader]:
        """A reader of the stored plain page (or chunk) `key` (random access to its segments, e.g. one layer), or
        None for a miss of any kind (counted and handled like `read_pages`; a page inside a group is a miss here).
        A segment that then fails its checksum raises CorruptPage from `PageReader.read`: hand it to
        `drop_corrupt`."""
        reader = self._serve(key, lambda path: PageReader(str(path), self.ns_id, key, segment_bytes))
        if reader is not None:
            self.stats.add(hit_pages=1)
        return reader

    def _serve(self, key: str, action: Callable[[Path], T]) -> Optional[T]:
        """`action(path)` on the stored file `key`; a miss of any kind gives None, counted (a lost file is
        forgotten, a corrupt or foreign one removed); a hit touches the entry."""
        with self._lock:
            known = self._index.kind(key) is not None
        if not known:
            self.stats.add(miss_pages=1)
            return None
        path = self._path(key)
        try:
            out = action(path)
        except FileNotFoundError:
            self._forget(key)
            self.stats.add(lost_pages=1, miss_pages=1)
            return None
        except (CorruptPage, ForeignPage) as exc:
            self.drop_corrupt(key, exc)
            return None
        except OSError as exc:
            logger.warning("tiered ssd: read error on %s: %s", key, exc)
            self.stats.add(io_errors=1, miss_pages=1)
            return None
        with self._lock:
            self._index.touch(key)
        _bump_mtime(path)
        return out

    def drop_corrupt(self, key: str, exc: Exception) -> None:
        """Remove file `key` found corrupt or foreign by a reader (counted)."""
        foreign = isinstance(exc, ForeignPage)
        logger.warning("tiered ssd: %s page %s (%s): removed, recomputing", "foreign" if foreign else "corrupt", key,
                       exc)
        self._forget(key)
        self.stats.add(miss_pages=1, **{"foreign_pages" if foreign else "corrupt_pages": 1})

    def write_pages(self, pages: Sequence[PageIO], kind: str = "page") -> list[bool]:
        """Persist each page (`kind` "page", "activation" -- key `activations.activation_key(page key)`, admitted
        with that page -- or "chunk"). result[i] is True if it is stored (now or already)."""
        return self._map(lambda page: self._write_one(page, kind), pages)

    def page_blob(self, key: str) -> Optional[bytes]:
        """The stored file of plain page `key` (header and payload, what `keep_page` takes), or None (not stored,
        inside a group, or unreadable). Not checked here: whoever reads it checks it."""
        with self._lock:
            if self._index.kind(key) != "page":
                return None
        try:
            return self._path(key).read_bytes()
        except OSError:
            return None

    def keep_page(self, key: str, blob: bytes) -> bool:
        """Store `blob`, a page file obtained elsewhere (another server's `page_blob`, already checked with
        `page_file.read_blob`), as page `key` if it fits. True when stored (now or already). Like every page, it is
        checked again when read."""
        if self._before_write is not None:
            self._before_write()
        written = self._store_file(key, "page", len(blob), lambda path: write_file(str(path), [memoryview(blob)]),
                                   count_dedup=False)
        if written:
            self.stats.add(imported_pages=1, bytes_written=written)
        return written is not None

    def run_io(self, fn: Callable, items: Sequence) -> list:
        """`fn` over `items` on the tier's I/O threads (in the caller's thread for one item), results in order."""
        return self._map(fn, items)

    def _map(self, fn: Callable, items: Sequence) -> list:
        if len(items) <= 1:
            return [fn(p) for p in items]
        return list(self._pool.map(fn, items))

    def _read_one(self, page: PageIO) -> bool:
        key, segments = page
        t0 = time.perf_counter()
        n = self._serve(key, lambda path: read_page(str(path), self.ns_id, key, segments))
        if n is None:
            return False
        self.stats.add(hit_pages=1, bytes_read=n, read_seconds=time.perf_counter() - t0)
        return True

    def _write_one(self, page: PageIO, kind: str) -> bool:
        key, segments = page
        if self._before_write is not None:
            self._before_write()
        size = header_bound(self.ns_id, key, [s.nbytes for s in segments]) + sum(s.nbytes for s in segments)
        t0 = time.perf_counter()

        def write(path: Path) -> int:
            n = write_page(str(path), self.ns_id, key, segments)
            if self.stash is not None and kind == "page":  # the payload just written, kept before the page is
                self.stash.keep(key, segments)  # indexed (and a repack may start); never a dedup's
            return n

        written = self._store_file(key, kind, size, write)
        if written:
            self.stats.add(written_pages=1, bytes_written=written, write_seconds=time.perf_counter() - t0)
        return written is not None

    def _store_file(self, key: str, kind: str, size: int, write: Callable[[Path], int], *,
                    count_dedup: bool = True) -> Optional[int]:
        """Reserve `size` bytes for entry `key` (evicting as needed), `write(path)` its file, index it. Returns the
        bytes written, 0 if it is stored or being stored already (touched, and counted as a dedup if
        `count_dedup`), None if it was not admitted (larger than the capacity, its page gone, or no room that
        eviction may make) or the write failed (counted)."""
        parent = activations.page_of(key) if kind == "activation" else None
        with self._lock:
            res = self._index.reserve(key, size, kind, parent=parent)
            if res.stored and count_dedup:
                self._index.touch(key)
            self._delete_locked(res.victims)
        if res.stored:
            if count_dedup:
                self.stats.add(dedup_pages=1)
            return 0
        if not res.admitted:
            self.stats.add(rejected_pages=1)
            self._publish_gauges()
            return None
        path = self._path(key)
        try:
            make_dir(path.parent)
            actual = write(path)
        except OSError as exc:
            logger.warning("tiered ssd: write of %s failed: %s", key, exc)
            with self._lock:
                self._index.abort(key)
            self.stats.add(io_errors=1)
            self._publish_gauges()
            return None
        with self._lock:
            self._delete_locked(self._index.commit(key, actual))
        self._publish_gauges()
        return actual

    # ----------------------------------------------------------------- meta files, groups: `meta`, `groups`
    def attach_stash(self, stash: PayloadStash) -> None:
        """From now on, pages written keep a copy of their payload in `stash` if it expects them, and `repack`
        takes a member page's payload from there before reading its file back (`stash.py`)."""
        self.stash = stash

    # ----------------------------------------------------------------- maintenance
    def clear(self) -> None:
        """Remove every page, activation, chunk and group of this namespace (meta files stay)."""
        with self._lock:
            self._delete_locked(self._index.clear(), count=False)
            self._groups.clear()
        self._publish_gauges()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _forget(self, key: str) -> None:
        """Drop entry `key` and what depends on it (a lost file, or a corrupt one: its file is removed)."""
        with self._lock:
            self._delete_locked(self._index.remove(key), count=False)
        self._publish_gauges()

    def _path(self, key: str) -> Path:
        return entry_path(self.root, self.dir, key)

    def _delete_locked(self, victims: Sequence[Victim], *, count: bool = True) -> None:
        """Delete the victims' files (lock held: nobody reserves their room before they are gone). `count`: they
        were evicted (not corrupt, cleared or grouped)."""
        if not victims:
            return
        for v in victims:
            if v.key.startswith(GROUP_PREFIX):
                self._groups.pop(v.key[len(GROUP_PREFIX):], None)
            unlink_quiet(self._path(v.key))
        if count:
            self.stats.add(evicted_pages=len(victims), evicted_bytes=sum(v.size for v in victims))

    def _publish_gauges(self) -> None:
        with self._lock:
            used, n = self._index.used, self._index.stored_pages()
        self.stats.set(used_bytes=used, stored_pages=n)

    # ----------------------------------------------------------------- startup (tier_scan.py)
    def _rebuild_index(self, scan_foreign: bool) -> None:
        t0 = time.perf_counter()
        found = tier_scan.scan(self.root, self.namespace, scan_foreign)
        with self._lock:
            tier_scan.load(found, self._index, self._groups)
            self._delete_locked(self._index.shrink())  # capacity lowered since the last run: oldest first
        self._publish_gauges()
        by_kind = self.bytes_by_kind()
        logger.info(
            "tiered ssd: namespace %s at %s: %d pages, %d bytes (capacity %d; %s) indexed in %.3f s%s",
            self.ns_id, self.dir, len(self), self.used_bytes, self.capacity_bytes,
            ", ".join(f"{k} {v}" for k, v in by_kind.items() if v), time.perf_counter() - t0,
            f", {found.removed_tmp} interrupted writes removed" if found.removed_tmp else "",
        )


def _bump_mtime(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def check_integrity(tier: SSDTier) -> None:
    """Assert the tier's bookkeeping is consistent (for tests): the index's invariants, the capacity, the files on
    disk."""
    with tier._lock:
        tier._index.check()
        assert tier._index.used <= tier.capacity_bytes, "over capacity"
        for kind in ("page", "activation", "chunk", "group", "foreign"):
            for key in tier._index.keys(kind):
                assert tier._path(key).stat().st_size == tier._index.size(key), f"size of {key} changed on disk"
        for key in tier._index.keys("meta"):
            path = tier._path(key)
            on_disk = path.stat().st_size if path.exists() else 0
            assert on_disk <= tier._index.size(key), f"{key} outgrew its reservation"
