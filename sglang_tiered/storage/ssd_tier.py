"""The SSD tier: one file per KV page under `<root>/<namespace id>/<key[:2]>/<key>.kvp`.

Contracts
* `contains`/`leading_hits` answer from the in-memory index; they never touch the disk.
* `read_pages`/`write_pages` do blocking file I/O on a bounded thread pool (`io_threads`); call them from a
  background thread (SGLang's prefetch and backup threads do), never from the scheduler loop.
* A page is served only if its file is complete, its header names this namespace and key, its size matches, and its
  payload checksum matches. Anything else is a miss; the file is removed and counted (corrupt / foreign / lost).
* `used_bytes` (file sizes, headers included) never exceeds `capacity_bytes`: space is reserved before a write and
  victims chosen by the eviction policy are deleted first. A page larger than the capacity is rejected.
* The index is rebuilt from the directory on start (names and sizes only; headers are checked lazily on read), in
  recency order taken from file mtimes (a read hit bumps the mtime). Temporary files of interrupted writes are removed.
* Only this process writes to its namespace directory (namespaces include the TP/PP rank).
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
from typing import Optional

from sglang_tiered.storage.eviction import EvictionPolicy, LRUPolicy
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import (
    PAGE_SUFFIX,
    TMP_SUFFIX,
    CorruptPage,
    ForeignPage,
    header_bound,
    read_page,
    read_segments,
    write_page,
)
from sglang_tiered.storage.stats import TierStats

logger = logging.getLogger(__name__)

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
        policy: Optional[EvictionPolicy] = None,
        before_write: Optional[Callable[[], object]] = None,
    ) -> None:
        """`before_write` runs in the I/O thread before each page write (e.g. `ForegroundGate.wait_idle`)."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.namespace = namespace
        self.ns_id = namespace.id
        self.dir = self.root / self.ns_id
        self.capacity_bytes = int(capacity_bytes)
        self.stats = TierStats()
        self._policy: EvictionPolicy = policy or LRUPolicy()
        self._before_write = before_write
        self._index: dict[str, int] = {}  # key -> file size in bytes
        self._writing: dict[str, int] = {}  # key -> reserved bytes, writes in flight
        self._used = 0  # bytes of indexed files plus reservations
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="tiered-ssd-io")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_namespace_file()
        self._rebuild_index()

    # ----------------------------------------------------------------- queries (index only)
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` that are stored."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
            return len(keys)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ----------------------------------------------------------------- data movement
    def read_pages(self, pages: Sequence[PageIO]) -> list[bool]:
        """Fill each page's buffers from disk. result[i] is False for a miss of any kind."""
        return self._map(self._read_one, pages)

    def write_pages(self, pages: Sequence[PageIO]) -> list[bool]:
        """Persist each page. result[i] is True if the page is stored (now or already)."""
        return self._map(self._write_one, pages)

    def read_segments(self, key: str, wanted: dict[int, memoryview]) -> bool:
        """Fill only the segments `wanted` ({segment index: buffer}) of one page, each checksummed on its own (e.g.
        one layer's keys). False on a miss of any kind, counted like a page miss (a page written before per-segment
        checksums cannot be read in part: a miss here, still served whole by `read_pages`). Blocking; call from an
        I/O thread."""
        with self._lock:
            known = key in self._index
        if not known:
            self.stats.add(miss_pages=1)
            return False
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            n = read_segments(str(path), self.ns_id, key, wanted)
        except NotImplementedError:
            self.stats.add(miss_pages=1)
            return False
        except FileNotFoundError:
            self._forget(key, delete=False)
            self.stats.add(lost_pages=1, miss_pages=1)
            return False
        except (CorruptPage, ForeignPage) as exc:
            logger.warning("tiered ssd: bad page %s (%s): removed", key, exc)
            self._forget(key, delete=True)
            self.stats.add(corrupt_pages=int(isinstance(exc, CorruptPage)),
                           foreign_pages=int(isinstance(exc, ForeignPage)), miss_pages=1)
            return False
        except OSError as exc:
            logger.warning("tiered ssd: read error on %s: %s", key, exc)
            self.stats.add(io_errors=1, miss_pages=1)
            return False
        self.stats.add(segment_reads=1, bytes_read=n, read_seconds=time.perf_counter() - t0)
        return True

    def index_size(self, key: str) -> Optional[int]:
        """File size of a stored page (header included), or None."""
        with self._lock:
            return self._index.get(key)

    def _map(self, fn: Callable[[PageIO], bool], pages: Sequence[PageIO]) -> list[bool]:
        if len(pages) <= 1:
            return [fn(p) for p in pages]
        return list(self._pool.map(fn, pages))

    def _read_one(self, page: PageIO) -> bool:
        key, segments = page
        with self._lock:
            known = key in self._index
        if not known:
            self.stats.add(miss_pages=1)
            return False
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            n = read_page(str(path), self.ns_id, key, segments)
        except FileNotFoundError:
            self._forget(key, delete=False)
            self.stats.add(lost_pages=1, miss_pages=1)
            return False
        except CorruptPage as exc:
            logger.warning("tiered ssd: corrupt page %s (%s): removed, recomputing", key, exc)
            self._forget(key, delete=True)
            self.stats.add(corrupt_pages=1, miss_pages=1)
            return False
        except ForeignPage as exc:
            logger.warning("tiered ssd: foreign page %s (%s): removed", key, exc)
            self._forget(key, delete=True)
            self.stats.add(foreign_pages=1, miss_pages=1)
            return False
        except OSError as exc:
            logger.warning("tiered ssd: read error on %s: %s", key, exc)
            self.stats.add(io_errors=1, miss_pages=1)
            return False
        with self._lock:
            self._policy.touch(key)
        _bump_mtime(path)
        self.stats.add(hit_pages=1, bytes_read=n, read_seconds=time.perf_counter() - t0)
        return True

    def _write_one(self, page: PageIO) -> bool:
        key, segments = page
        if self._before_write is not None:
            self._before_write()
        size = header_bound(self.ns_id, key, [s.nbytes for s in segments]) + sum(s.nbytes for s in segments)
        with self._lock:
            if key in self._index or key in self._writing:  # stored, or being stored by another thread
                self._policy.touch(key)
                self.stats.add(dedup_pages=1)
                return True
            if size > self.capacity_bytes:  # would never fit: reject before evicting anything for it
                victims, admitted = [], False
            else:
                victims = self._pick_victims_locked(self._used + size - self.capacity_bytes)
                admitted = self._used + size <= self.capacity_bytes
            if admitted:
                self._used += size
                self._writing[key] = size
        self._delete_victims(victims)
        if not admitted:  # larger than the capacity, or the rest of the space is being written right now
            self.stats.add(rejected_pages=1)
            self._publish_gauges()
            return False
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            path.parent.mkdir(exist_ok=True)
            actual = write_page(str(path), self.ns_id, key, segments)
        except OSError as exc:
            logger.warning("tiered ssd: write of %s failed: %s", key, exc)
            with self._lock:
                self._used -= self._writing.pop(key)
            self.stats.add(io_errors=1)
            self._publish_gauges()
            return False
        with self._lock:
            self._used += actual - self._writing.pop(key)
            self._index[key] = actual
            self._policy.insert(key)
        self.stats.add(written_pages=1, bytes_written=actual, write_seconds=time.perf_counter() - t0)
        self._publish_gauges()
        return True

    # ----------------------------------------------------------------- maintenance
    def clear(self) -> None:
        """Remove every page of this namespace."""
        with self._lock:
            keys = list(self._index)
            for key in keys:
                self._policy.remove(key)
            self._index.clear()
            self._used = sum(self._writing.values())
        for key in keys:
            _unlink_quiet(self._path(key))
        self._publish_gauges()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def check_integrity(self) -> None:
        """Assert the bookkeeping is consistent (for tests): used bytes, policy keys, files on disk."""
        with self._lock:
            assert self._used == sum(self._index.values()) + sum(self._writing.values()), "used bytes drifted"
            assert self._used <= self.capacity_bytes, "over capacity"
            assert len(self._policy) == len(self._index), "policy and index disagree"  # type: ignore[arg-type]
            for key, size in self._index.items():
                assert self._path(key).stat().st_size == size, f"size of {key} changed on disk"

    def _forget(self, key: str, *, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._policy.remove(key)
                self._used -= size
        if delete:
            _unlink_quiet(self._path(key))
        self._publish_gauges()

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"unsafe page key {key!r}")
        return self.dir / key[:2] / f"{key}{PAGE_SUFFIX}"

    def _publish_gauges(self) -> None:
        with self._lock:
            used, n = self._used, len(self._index)
        self.stats.set(used_bytes=used, stored_pages=n)

    def _write_namespace_file(self) -> None:
        desc = self.dir / "NAMESPACE.json"
        if not desc.exists():
            tmp = desc.with_suffix(f".{os.getpid()}{TMP_SUFFIX}")
            tmp.write_text(json.dumps(self.namespace.describe(), indent=2, sort_keys=True))
            os.replace(tmp, desc)

    def _rebuild_index(self) -> None:
        t0 = time.perf_counter()
        found: list[tuple[float, str, int]] = []
        removed_tmp = 0
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                if sub.name.endswith(TMP_SUFFIX):
                    _unlink_quiet(Path(sub.path))
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink_quiet(Path(entry.path))
                    removed_tmp += 1
                elif entry.name.endswith(PAGE_SUFFIX):
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name[: -len(PAGE_SUFFIX)], st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._policy.insert(key)
                self._used += size
        over = self._used - self.capacity_bytes
        if over > 0:  # capacity lowered since the last run: trim oldest first
            self._evict_bytes(over)
        self._publish_gauges()
        logger.info(
            "tiered ssd: namespace %s at %s: %d pages, %d bytes (capacity %d) indexed in %.3f s%s",
            self.ns_id,
            self.dir,
            len(self._index),
            self._used,
            self.capacity_bytes,
            time.perf_counter() - t0,
            f", {removed_tmp} interrupted writes removed" if removed_tmp else "",
        )

    def _evict_bytes(self, nbytes: int) -> None:
        with self._lock:
            victims = self._pick_victims_locked(nbytes)
        self._delete_victims(victims)

    def _pick_victims_locked(self, nbytes: int) -> list[tuple[str, int]]:
        """Drop policy-chosen pages from the index until `nbytes` are freed (or nothing is left). Lock held."""
        victims: list[tuple[str, int]] = []
        for victim in self._policy.victims():
            if nbytes <= 0:
                break
            vsize = self._index[victim]
            victims.append((victim, vsize))
            nbytes -= vsize
        for victim, vsize in victims:
            del self._index[victim]
            self._policy.remove(victim)
            self._used -= vsize
        return victims

    def _delete_victims(self, victims: list[tuple[str, int]]) -> None:
        for victim, _ in victims:
            _unlink_quiet(self._path(victim))
        if victims:
            self.stats.add(evicted_pages=len(victims), evicted_bytes=sum(v for _, v in victims))


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _bump_mtime(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
