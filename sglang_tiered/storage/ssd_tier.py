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
* Groups (`repack`): a run of pages rewritten as one importance-ordered file under `groups/<gid>.kvg`
  (`group_file.py`). A group is committed by its rename; only then are its member pages' files removed, so a crash
  at any point leaves either the old pages or the group (on start, member pages of a committed group are deleted
  and orphaned temporary files swept). Members stay addressable by their page keys (`contains`, `read_pages`:
  token-identical through the group's map); a group is accounted, touched and evicted as one unit. With a stash
  attached (`attach_stash`, `stash.py`), a repack takes its pages' payloads from the copies kept at their write and
  reads only the others back (counted apart from request reads: `repack_pages_kept`, `repack_pages_read`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, TypeVar

from sglang_tiered.storage import group_file
from sglang_tiered.storage.eviction import EvictionPolicy, LRUPolicy
from sglang_tiered.storage.groups import ITEMSIZE, assemble, pages_from_group
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import (
    PAGE_SUFFIX,
    TMP_SUFFIX,
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
        self.stash: Optional[PayloadStash] = None  # payloads kept for the repacker (`attach_stash`)
        self._index: dict[str, int] = {}  # key (or "g.<gid>" for a group) -> file size in bytes
        self._groups: dict[str, group_file.GroupMeta] = {}  # gid -> meta of a committed group
        self._member: dict[str, str] = {}  # page key -> gid of the group holding it
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
            return key in self._index or key in self._member

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` that are stored."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index and key not in self._member:
                    return i
            return len(keys)

    def group_of(self, key: str) -> Optional[group_file.GroupMeta]:
        """The committed group holding page `key`, or None (a plain page, or not stored)."""
        with self._lock:
            gid = self._member.get(key)
            return self._groups.get(gid) if gid is not None else None

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        """Stored pages (plain or in groups)."""
        with self._lock:
            return len(self._index) - len(self._groups) + len(self._member)

    # ----------------------------------------------------------------- data movement
    def read_pages(self, pages: Sequence[PageIO]) -> list[bool]:
        """Fill each page's buffers from disk. result[i] is False for a miss of any kind."""
        with self._lock:
            grouped = [i for i, (key, _) in enumerate(pages) if key in self._member]
        if not grouped:
            return self._map(self._read_one, pages)
        out = [False] * len(pages)
        plain = [i for i in range(len(pages)) if i not in set(grouped)]
        for i, ok in zip(plain, self._map(self._read_one, [pages[i] for i in plain])):
            out[i] = ok
        by_group: dict[str, list[int]] = {}
        with self._lock:
            for i in grouped:
                gid = self._member.get(pages[i][0])
                if gid is not None:
                    by_group.setdefault(gid, []).append(i)
        for gid, idx in by_group.items():
            for i, ok in zip(idx, self._read_from_group(gid, [pages[i] for i in idx])):
                out[i] = ok
        return out

    def open_page(self, key: str, segment_bytes: Sequence[int]) -> Optional[PageReader]:
        """A reader of the stored plain page `key` (random access to its segments, e.g. one layer), or None for a
        miss of any kind (counted and handled like `read_pages`; a page inside a group is a miss here). A segment
        that then fails its checksum raises CorruptPage from `PageReader.read`: hand it to `drop_corrupt`."""
        reader = self._serve(key, lambda path: PageReader(str(path), self.ns_id, key, segment_bytes))
        if reader is not None:
            self.stats.add(hit_pages=1)
        return reader

    def _serve(self, key: str, action: Callable[[Path], T]) -> Optional[T]:
        """`action(path)` on the stored plain page `key`; a miss of any kind gives None, counted (a lost file is
        forgotten, a corrupt or foreign one removed); a hit touches the page."""
        with self._lock:
            known = key in self._index
        if not known:
            self.stats.add(miss_pages=1)
            return None
        path = self._path(key)
        try:
            out = action(path)
        except FileNotFoundError:
            self._forget(key, delete=False)
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
            self._policy.touch(key)
        _bump_mtime(path)
        return out

    def drop_corrupt(self, key: str, exc: Exception) -> None:
        """Remove page `key` found corrupt or foreign by a reader (counted)."""
        foreign = isinstance(exc, ForeignPage)
        logger.warning("tiered ssd: %s page %s (%s): removed, recomputing", "foreign" if foreign else "corrupt", key,
                       exc)
        self._forget(key, delete=True)
        self.stats.add(miss_pages=1, **{"foreign_pages" if foreign else "corrupt_pages": 1})

    def write_pages(self, pages: Sequence[PageIO]) -> list[bool]:
        """Persist each page. result[i] is True if the page is stored (now or already)."""
        return self._map(self._write_one, pages)

    def page_blob(self, key: str) -> Optional[bytes]:
        """The stored file of plain page `key` (header and payload, what `keep_page` takes), or None (not stored,
        inside a group, or unreadable). Not checked here: whoever reads it checks it."""
        with self._lock:
            if key not in self._index:
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
        written = self._store_file(key, len(blob), lambda path: write_file(str(path), [memoryview(blob)]),
                                   count_dedup=False)
        if written:
            self.stats.add(imported_pages=1, bytes_written=written)
        return written is not None

    def run_io(self, fn: Callable, items: Sequence) -> list:
        """`fn` over `items` on the tier's I/O threads (in the caller's thread for one item), results in order."""
        return self._map(fn, items)

    def _map(self, fn: Callable[[PageIO], bool], pages: Sequence[PageIO]) -> list[bool]:
        if len(pages) <= 1:
            return [fn(p) for p in pages]
        return list(self._pool.map(fn, pages))

    def _read_one(self, page: PageIO) -> bool:
        key, segments = page
        t0 = time.perf_counter()
        n = self._serve(key, lambda path: read_page(str(path), self.ns_id, key, segments))
        if n is None:
            return False
        self.stats.add(hit_pages=1, bytes_read=n, read_seconds=time.perf_counter() - t0)
        return True

    def _write_one(self, page: PageIO) -> bool:
        key, segments = page
        if self._before_write is not None:
            self._before_write()
        size = header_bound(self.ns_id, key, [s.nbytes for s in segments]) + sum(s.nbytes for s in segments)
        t0 = time.perf_counter()

        def write(path: Path) -> int:
            n = write_page(str(path), self.ns_id, key, segments)
            if self.stash is not None:  # the payload just written, kept before the page is indexed (and a repack
                self.stash.keep(key, segments)  # may start); never a dedup's, which may differ in its low bits
            return n

        written = self._store_file(key, size, write)
        if written:
            self.stats.add(written_pages=1, bytes_written=written, write_seconds=time.perf_counter() - t0)
        return written is not None

    def _store_file(self, key: str, size: int, write: Callable[[Path], int], *, count_dedup: bool = True
                    ) -> Optional[int]:
        """Reserve `size` bytes for page `key` (evicting as needed), `write(path)` its file, index it. Returns the
        bytes written, 0 if the page is stored or being stored already (touched, and counted as a dedup if
        `count_dedup`), None if it was not admitted (larger than the capacity, or the rest of the space is being
        written right now) or the write failed (counted)."""
        with self._lock:
            if key in self._index or key in self._writing or key in self._member:  # stored, or being stored
                if count_dedup:
                    self._policy.touch(key)
                    self.stats.add(dedup_pages=1)
                return 0
            if size > self.capacity_bytes:  # would never fit: reject before evicting anything for it
                victims, admitted = [], False
            else:
                victims = self._pick_victims_locked(self._used + size - self.capacity_bytes)
                admitted = self._used + size <= self.capacity_bytes
            if admitted:
                self._used += size
                self._writing[key] = size
        self._delete_victims(victims)
        if not admitted:
            self.stats.add(rejected_pages=1)
            self._publish_gauges()
            return None
        path = self._path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            actual = write(path)
        except OSError as exc:
            logger.warning("tiered ssd: write of %s failed: %s", key, exc)
            with self._lock:
                self._used -= self._writing.pop(key)
            self.stats.add(io_errors=1)
            self._publish_gauges()
            return None
        with self._lock:
            self._used += actual - self._writing.pop(key)
            self._index[key] = actual
            self._policy.insert(key)
        self._publish_gauges()
        return actual

    # ----------------------------------------------------------------- groups
    def attach_stash(self, stash: PayloadStash) -> None:
        """From now on, pages written keep a copy of their payload in `stash` if it expects them, and `repack`
        takes a member page's payload from there before reading its file back (`stash.py`)."""
        self.stash = stash

    def repack(self, keys: Sequence[str], order: Sequence[int], probe_heads: Sequence[int], chunk: int = 16,
               probe_bits: int = group_file.PROBE_BITS) -> bool:
        """Rewrite the stored plain pages `keys` (consecutive pages of one prefix, logical order) as one group whose
        slot i holds logical token order[i]. True when committed; False (nothing changed) if a page is missing,
        unreadable or already grouped, or the space is not there. Blocking; call from a background thread."""
        with self._lock:
            if any(k not in self._index or k in self._writing for k in keys):
                return False
        seg = self.namespace.page_size * self.namespace.kv_heads * self.namespace.head_dim
        n_seg = 2 * self.namespace.layer_num
        size = seg * ITEMSIZE.get(self.namespace.dtype, 2)
        payloads = []
        for key in keys:
            payload = self.stash.take(key) if self.stash is not None else None
            if payload is not None and len(payload) == n_seg * size:
                self.stats.add(repack_pages_kept=1)
                payloads.append(payload)
                continue
            bufs = [memoryview(bytearray(size)) for _ in range(n_seg)]
            n = self._serve(key, lambda path, key=key, bufs=bufs: read_page(str(path), self.ns_id, key, bufs))
            if n is None:
                return False
            self.stats.add(repack_pages_read=1, repack_bytes_read=n)
            payloads.append(b"".join(bufs))
        meta, probes, data = assemble(self.namespace, keys, payloads, order, probe_heads, chunk, probe_bits)
        gid, entry = meta["gid"], "g." + meta["gid"]
        path = self._path(entry)
        tokens, chunks = meta["tokens"], -(-meta["tokens"] // chunk)  # + a bound of the metadata's size:
        estimate = (sum(len(p) for p in payloads) + sum(q.nbytes + sc.nbytes for q, sc in probes)
                    + 1024 + 72 * len(keys) + 5 * tokens + 5 * meta["layers"] * (chunks + 1))
        with self._lock:
            if entry in self._index or entry in self._writing:
                return False
            victims = self._pick_victims_locked(self._used + estimate - self.capacity_bytes, keep=set(keys))
            admitted = self._used + estimate <= self.capacity_bytes
            if admitted:
                self._used += estimate
                self._writing[entry] = estimate
        self._delete_victims(victims)
        if not admitted:
            return False
        try:
            path.parent.mkdir(exist_ok=True)
            written = group_file.write_group(str(path), meta, probes, data)
            fd = os.open(path, os.O_RDONLY)
            try:
                committed = group_file.read_meta(fd)
            finally:
                os.close(fd)
        except (OSError, group_file.GroupError) as exc:
            logger.warning("tiered ssd: repack of %d pages failed: %s", len(keys), exc)
            with self._lock:
                self._used -= self._writing.pop(entry)
            _unlink_quiet(path)
            self.stats.add(io_errors=1)
            return False
        with self._lock:
            self._used += written - self._writing.pop(entry)
            gone = [(k, self._index.pop(k)) for k in keys if k in self._index]
            for k, size in gone:
                self._policy.remove(k)
                self._used -= size
            self._index[entry] = written
            self._policy.insert(entry)
            self._groups[gid] = committed
            self._member.update({k: gid for k in keys})
        for k, _ in gone:
            _unlink_quiet(self._path(k))
        self.stats.add(repacked_groups=1, repacked_pages=len(keys), bytes_written=written)
        self._publish_gauges()
        return True

    def read_group_probe(self, gid: str, layer: int):
        """The group's probe of one layer (`group_file.read_probe`'s keys and scales) or None on a miss."""
        return self._group_io(gid, lambda fd, meta: group_file.read_probe(fd, meta, layer))

    def read_group_chunks(self, gid: str, layer: int, chunks: Sequence[int]):
        """{chunk: (K bytes, V bytes)} of one layer of the group, or None on a miss."""
        return self._group_io(gid, lambda fd, meta: group_file.read_chunks(fd, meta, layer, chunks))

    def _group_io(self, gid: str, fn):
        with self._lock:
            meta = self._groups.get(gid)
        if meta is None:
            return None
        path = self._path("g." + gid)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget("g." + gid, delete=False)
            self.stats.add(lost_pages=len(meta.keys))
            return None
        t0 = time.perf_counter()
        try:
            with contextlib.suppress(OSError):  # advice only: no readahead, a sparse load reads chosen chunks
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            out = fn(fd, meta)
        except group_file.GroupError as exc:
            logger.warning("tiered ssd: corrupt group %s (%s): removed, recomputing", gid, exc)
            self._forget("g." + gid, delete=True)
            self.stats.add(corrupt_pages=len(meta.keys))
            return None
        except OSError as exc:
            logger.warning("tiered ssd: read error on group %s: %s", gid, exc)
            self.stats.add(io_errors=1)
            return None
        finally:
            os.close(fd)
        nbytes = sum(len(b) for pair in out.values() for b in pair) if isinstance(out, dict) else \
            sum(a.nbytes for a in out)
        with self._lock:
            self._policy.touch("g." + gid)
        self.stats.add(group_reads=1, bytes_read=nbytes, read_seconds=time.perf_counter() - t0)
        return out

    def _read_from_group(self, gid: str, pages: Sequence[PageIO]) -> list[bool]:
        with self._lock:
            meta = self._groups.get(gid)
        if meta is None:
            self.stats.add(miss_pages=len(pages))
            return [False] * len(pages)
        layers = []
        for layer in range(meta.layers):
            chunks = self.read_group_chunks(gid, layer, range(meta.chunks))
            if chunks is None:
                self.stats.add(miss_pages=len(pages))
                return [False] * len(pages)
            layers.append(chunks)
        wanted = [meta.keys.index(key) for key, _ in pages]
        for (_, segments), payload in zip(pages, pages_from_group(meta, layers, wanted)):
            view, pos = memoryview(payload), 0
            for seg in segments:
                flat = seg.cast("B") if seg.format != "B" or seg.ndim != 1 else seg
                flat[:] = view[pos : pos + flat.nbytes]
                pos += flat.nbytes
        self.stats.add(hit_pages=len(pages))
        return [True] * len(pages)

    # ----------------------------------------------------------------- maintenance
    def clear(self) -> None:
        """Remove every page of this namespace."""
        with self._lock:
            keys = list(self._index)
            for key in keys:
                self._policy.remove(key)
            self._index.clear()
            self._groups.clear()
            self._member.clear()
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
                self._drop_group_locked(key)
        if delete:
            _unlink_quiet(self._path(key))
        self._publish_gauges()

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"unsafe page key {key!r}")
        if key.startswith("g."):
            return self.dir / "groups" / f"{key[2:]}{group_file.GROUP_SUFFIX}"
        return self.dir / key[:2] / f"{key}{PAGE_SUFFIX}"

    def _drop_group_locked(self, entry: str) -> None:
        if entry.startswith("g."):
            meta = self._groups.pop(entry[2:], None)
            for k in meta.keys if meta else ():
                self._member.pop(k, None)

    def _publish_gauges(self) -> None:
        with self._lock:
            used, n = self._used, len(self._index) - len(self._groups) + len(self._member)
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
        groups = self._scan_groups()
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                if sub.name.endswith(TMP_SUFFIX):
                    _unlink_quiet(Path(sub.path))
                continue
            if sub.name == "groups":
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink_quiet(Path(entry.path))
                    removed_tmp += 1
                elif entry.name.endswith(PAGE_SUFFIX):
                    key = entry.name[: -len(PAGE_SUFFIX)]
                    if key in self._member:  # its group committed; the crash came before this file was removed
                        _unlink_quiet(Path(entry.path))
                        continue
                    st = entry.stat()
                    found.append((st.st_mtime, key, st.st_size))
        found.extend(groups)
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

    def _scan_groups(self) -> list[tuple[float, str, int]]:
        """Committed groups under groups/ (registered as members); temporary and unreadable files removed."""
        out: list[tuple[float, str, int]] = []
        gdir = self.dir / "groups"
        if not gdir.is_dir():
            return out
        for entry in os.scandir(gdir):
            if not entry.name.endswith(group_file.GROUP_SUFFIX):
                _unlink_quiet(Path(entry.path))
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    meta = group_file.read_meta(fd)
                finally:
                    os.close(fd)
            except (OSError, group_file.GroupError) as exc:
                logger.warning("tiered ssd: unreadable group %s (%s): removed", entry.name, exc)
                _unlink_quiet(Path(entry.path))
                continue
            if meta.ns != self.ns_id:
                _unlink_quiet(Path(entry.path))
                continue
            self._groups[meta.gid] = meta
            self._member.update({k: meta.gid for k in meta.keys})
            st = entry.stat()
            out.append((st.st_mtime, "g." + meta.gid, st.st_size))
        return out

    def _evict_bytes(self, nbytes: int) -> None:
        with self._lock:
            victims = self._pick_victims_locked(nbytes)
        self._delete_victims(victims)

    def _pick_victims_locked(self, nbytes: int, keep: frozenset | set = frozenset()) -> list[tuple[str, int]]:
        """Drop policy-chosen pages (or groups) from the index until `nbytes` are freed (or nothing is left), never
        one in `keep`. Lock held."""
        victims: list[tuple[str, int]] = []
        for victim in self._policy.victims():
            if nbytes <= 0:
                break
            if victim in keep:
                continue
            vsize = self._index[victim]
            victims.append((victim, vsize))
            nbytes -= vsize
        for victim, vsize in victims:
            del self._index[victim]
            self._policy.remove(victim)
            self._used -= vsize
            self._drop_group_locked(victim)
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
