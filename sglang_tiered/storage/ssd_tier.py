"""The SSD tier: every file one server rank keeps under `--tiered-ssd-dir`, one budget (`DiskIndex`) over them.

Files (under `<root>/<namespace id>/` unless said otherwise), by the index's kinds:
* page: `<key[:2]>/<key>.kvp`; activation: `<key[:2]>/<key>.x.kvp` (`activations.py`); chunk: `chunks/<hash>.kvp`
  (one segment per layer, `chunk_store.py`); group: `groups/<gid>.kvg` (`group_file.py`);
* meta: `NAMESPACE.json`, `SERVER` (the serving launcher's pid), `importance.log`, and
  `<root>/stats/<namespace id>.json`, the root's own files (`ROOT_FILES`: the compute-or-load profile, the
  launcher's `--dtype auto` choice, the server's claim on the directory), probe files (`write_meta`, `reserve_meta`,
  `scratch`);
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
* The index is rebuilt from the directory on start (names and sizes only; headers are checked lazily on read), in
  recency order taken from file mtimes (a read hit bumps the mtime). Temporary files of interrupted writes are removed.
* Only this process writes to its namespace directory (namespaces include the TP/PP rank).
* Groups (`repack`): a run of pages rewritten as one importance-ordered file. A group is committed by its rename;
  only then are its member pages' files removed, so a crash at any point leaves either the old pages or the group
  (on start, member pages of a committed group are deleted and orphaned temporary files swept). Members stay
  addressable by their page keys (`contains`, `read_pages`: token-identical through the group's map); a group is
  accounted, touched and evicted as one unit. With a stash attached (`attach_stash`, `stash.py`), a repack takes its
  pages' payloads from the copies kept at their write and reads only the others back (counted apart from request
  reads: `repack_pages_kept`, `repack_pages_read`).
* Retention: `pinned(key)` (a page key) keeps pinned pages, and groups holding one, from eviction until it says no.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, TypeVar

from sglang_tiered.storage import activations, group_file
from sglang_tiered.storage.directory_lock import LOCK_FILE
from sglang_tiered.storage.disk_index import DiskIndex, Victim
from sglang_tiered.storage.files import make_dir, unlink_quiet, write_atomic
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

CHUNK_PREFIX = "c."  # chunk entries: "c.<hash>"
GROUP_PREFIX = "g."  # group entries: "g.<gid>"
META_PREFIX = "m:"  # meta entries: "m:<path relative to the root>"
FOREIGN_PREFIX = "f:"  # foreign files: "f:<path relative to the root>"
NAMESPACE_FILE = "NAMESPACE.json"
DTYPE_FILE = "cpu-dtype.json"  # the launcher's `--dtype auto` choice, kept for restarts (integration/server_flags.py)
ROOT_FILES = ("kvpr-profile.json", DTYPE_FILE, LOCK_FILE)  # the whole server's, counted as meta


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
        self.on_leave: Optional[Callable[[list[str]], None]] = None  # page keys that left the tier (evicted, corrupt,
        #                                                             cleared); called under the tier's lock
        self._index = DiskIndex(self.capacity_bytes, pinned=pinned)
        self._groups: dict[str, group_file.GroupMeta] = {}  # gid -> meta of a committed group
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="tiered-ssd-io")
        make_dir(self.dir)
        self._rebuild_index(scan_foreign)
        self.write_meta(f"{self.ns_id}/{NAMESPACE_FILE}",
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
            for i, ok in zip(idx, self._read_from_group(gid, [pages[i] for i in idx])):
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

    # ----------------------------------------------------------------- meta files
    def write_meta(self, relpath: str, data: bytes, *, replace: bool = True) -> bool:
        """Write the small file `<root>/<relpath>` atomically (0600), its bytes counted against the capacity (the
        temporary copy beside the old one included). `replace=False`: keep an existing file. False when there is
        no room (nothing written, counted) or the write failed."""
        with self._lock:
            old = self._index.size(META_PREFIX + relpath)
        if old and not replace:  # (an entry of 0 bytes: a write that failed, nothing there)
            return True
        if not self.reserve_meta(relpath, (old or 0) + len(data)):  # old and new side by side until the rename
            return False
        try:
            write_atomic(self.root / relpath, data)
        except OSError as exc:
            logger.warning("tiered ssd: writing %s failed: %s", relpath, exc)
            self.settle_meta(relpath, old or 0)
            self.stats.add(io_errors=1)
            return False
        self.settle_meta(relpath, len(data))
        self._publish_gauges()
        return True

    def reserve_meta(self, relpath: str, nbytes: int) -> bool:
        """Make sure `nbytes` are counted for the file `<root>/<relpath>` that its owner writes itself (an
        append-only log: call before each append with its size after it; a rewrite beside it: with old + new).
        False (nothing changes) when there is no room. `settle_meta` gives back what is not used."""
        key = META_PREFIX + relpath
        with self._lock:
            old = self._index.size(key)
            if old is not None and old >= nbytes:
                return True
            if old is None:
                res = self._index.reserve(key, nbytes, "meta")
                if res.admitted:
                    self._index.commit(key, nbytes)
            else:
                res = self._index.resize(key, nbytes)
            self._delete_locked(res.victims)
        if not res.admitted:
            self.stats.add(rejected_pages=1)
        return res.admitted

    def settle_meta(self, relpath: str, nbytes: int) -> None:
        """The file `<root>/<relpath>` now holds `nbytes` (after a rewrite shrank it)."""
        key = META_PREFIX + relpath
        with self._lock:
            if self._index.size(key) is not None:
                self._index.resize(key, nbytes)

    @contextlib.contextmanager
    def scratch(self, name: str, nbytes: int) -> Iterator[Optional[Path]]:
        """A path under the root where a file of up to `nbytes` may be written for the duration of the block (e.g.
        a read-bandwidth probe), counted against the capacity; None when there is no room. Removed afterwards."""
        relpath = f"{self.ns_id}/{name}"
        if not self.reserve_meta(relpath, nbytes):
            yield None
            return
        path = self.root / relpath
        try:
            yield path
        finally:
            with self._lock:
                self._delete_locked(self._index.remove(META_PREFIX + relpath), count=False)

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
            if any(self._index.kind(k) != "page" or self._index.writing(k) for k in keys):
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
        gid, entry = meta["gid"], GROUP_PREFIX + meta["gid"]
        path = self._path(entry)
        tokens, chunks = meta["tokens"], -(-meta["tokens"] // chunk)  # + a bound of the metadata's size:
        estimate = (sum(len(p) for p in payloads) + sum(q.nbytes + sc.nbytes for q, sc in probes)
                    + 1024 + 72 * len(keys) + 5 * tokens + 5 * meta["layers"] * (chunks + 1))
        with self._lock:
            res = self._index.reserve(entry, estimate, "group", keep=keys)
            self._delete_locked(res.victims)
        if not res.admitted:
            return False
        try:
            make_dir(path.parent)
            written = group_file.write_group(str(path), meta, probes, data)
            fd = os.open(path, os.O_RDONLY)
            try:
                committed = group_file.read_meta(fd)
            finally:
                os.close(fd)
        except (OSError, group_file.GroupError) as exc:
            logger.warning("tiered ssd: repack of %d pages failed: %s", len(keys), exc)
            with self._lock:
                self._index.abort(entry)
            unlink_quiet(path)
            self.stats.add(io_errors=1)
            return False
        with self._lock:
            self._groups[gid] = committed
            self._delete_locked(self._index.commit_group(entry, written, keys), count=False, left=False)
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
        entry = GROUP_PREFIX + gid
        path = self._path(entry)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(entry)
            self.stats.add(lost_pages=len(meta.keys))
            return None
        t0 = time.perf_counter()
        try:
            with contextlib.suppress(OSError):  # advice only: no readahead, a sparse load reads chosen chunks
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            out = fn(fd, meta)
        except group_file.GroupError as exc:
            logger.warning("tiered ssd: corrupt group %s (%s): removed, recomputing", gid, exc)
            self._forget(entry)
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
            self._index.touch(entry)
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
        """Remove every page, activation, chunk and group of this namespace (meta files stay)."""
        with self._lock:
            self._delete_locked(self._index.clear(), count=False)
            self._groups.clear()
        self._publish_gauges()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def check_integrity(self) -> None:
        """Assert the bookkeeping is consistent (for tests): the index's invariants, the capacity, files on disk."""
        with self._lock:
            self._index.check()
            assert self._index.used <= self.capacity_bytes, "over capacity"
            for kind in ("page", "activation", "chunk", "group", "foreign"):
                for key in self._index.keys(kind):
                    assert self._path(key).stat().st_size == self._index.size(key), f"size of {key} changed on disk"
            for key in self._index.keys("meta"):
                path = self._path(key)
                on_disk = path.stat().st_size if path.exists() else 0
                assert on_disk <= self._index.size(key), f"{key} outgrew its reservation"

    def _forget(self, key: str) -> None:
        """Drop entry `key` and what depends on it (a lost file, or a corrupt one: its file is removed)."""
        with self._lock:
            self._delete_locked(self._index.remove(key), count=False)
        self._publish_gauges()

    def _path(self, key: str) -> Path:
        if key.startswith((META_PREFIX, FOREIGN_PREFIX)):
            rel = key[2:]
            if not rel or rel.startswith("/") or ".." in Path(rel).parts:
                raise ValueError(f"unsafe path {key!r}")
            return self.root / rel
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"unsafe page key {key!r}")
        if key.startswith(GROUP_PREFIX):
            return self.dir / "groups" / f"{key[len(GROUP_PREFIX):]}{group_file.GROUP_SUFFIX}"
        if key.startswith(CHUNK_PREFIX):
            return self.dir / "chunks" / f"{key[len(CHUNK_PREFIX):]}{PAGE_SUFFIX}"
        return page_path(self.dir, key)

    def _delete_locked(self, victims: Sequence[Victim], *, count: bool = True, left: bool = True) -> None:
        """Delete the victims' files (lock held: nobody reserves their room before they are gone). `count`: they
        were evicted (not corrupt, cleared or grouped). `left`: their pages left the tier (not into a group)."""
        if not victims:
            return
        pages: list[str] = []
        for v in victims:
            if v.kind == "page":
                pages.append(v.key)
            if v.key.startswith(GROUP_PREFIX):
                meta = self._groups.pop(v.key[len(GROUP_PREFIX):], None)
                pages.extend(meta.keys if meta is not None else ())
            unlink_quiet(self._path(v.key))
        if left and pages and self.on_leave is not None:
            self.on_leave(pages)
        if count:
            self.stats.add(evicted_pages=len(victims), evicted_bytes=sum(v.size for v in victims))

    def _publish_gauges(self) -> None:
        with self._lock:
            used, n = self._index.used, self._index.stored_pages()
        self.stats.set(used_bytes=used, stored_pages=n)

    # ----------------------------------------------------------------- startup
    def _rebuild_index(self, scan_foreign: bool) -> None:
        t0 = time.perf_counter()
        own: list[tuple[float, str, int, str]] = []  # (mtime, key, size, kind)
        removed_tmp = 0
        groups = self._scan_groups()
        members = {m for g in groups for m in g[3]}
        for entry in _walk(self.dir):
            rel = Path(entry.path).relative_to(self.dir)
            st = entry.stat()
            if entry.name.endswith(TMP_SUFFIX):
                unlink_quiet(Path(entry.path))
                removed_tmp += 1
                continue
            if rel.parts[0] == "groups":
                continue
            if len(rel.parts) == 1 and entry.name in (NAMESPACE_FILE, "importance.log",
                                                      "kvpr-profile.json"):
                own.append((st.st_mtime, META_PREFIX + f"{self.ns_id}/{entry.name}", st.st_size, "meta"))
                continue
            if entry.name.endswith(PAGE_SUFFIX) and len(rel.parts) == 2:
                stem = entry.name[: -len(PAGE_SUFFIX)]
                if rel.parts[0] == "chunks":
                    own.append((st.st_mtime, CHUNK_PREFIX + stem, st.st_size, "chunk"))
                    continue
                if stem in members:  # its group committed; the crash came before this file was removed
                    unlink_quiet(Path(entry.path))
                    continue
                kind = "activation" if activations.is_activation(stem) else "page"
                own.append((st.st_mtime, stem, st.st_size, kind))
                continue
            own.append((st.st_mtime, FOREIGN_PREFIX + f"{self.ns_id}/{rel}", st.st_size, "foreign"))
        for name in (f"stats/{self.ns_id}.json", *ROOT_FILES):
            path = self.root / name
            if path.is_file():
                own.append((path.stat().st_mtime, META_PREFIX + name, path.stat().st_size, "meta"))
        own.extend((mtime, GROUP_PREFIX + gid, size, "group") for mtime, gid, size, _ in groups)
        own.sort()
        foreign = sorted(self._scan_foreign()) if scan_foreign else []
        with self._lock:
            for _, key, size, _ in foreign:
                self._index.load(key, size, "foreign")
            for _, key, size, kind in own:
                if kind == "group":
                    self._index.load(key, size, kind, members=self._groups[key[len(GROUP_PREFIX):]].keys)
                else:
                    self._index.load(key, size, kind,
                                     parent=activations.page_of(key) if kind == "activation" else None)
            self._delete_locked(self._index.shrink())  # capacity lowered since the last run: oldest first
        self._publish_gauges()
        by_kind = self.bytes_by_kind()
        logger.info(
            "tiered ssd: namespace %s at %s: %d pages, %d bytes (capacity %d; %s) indexed in %.3f s%s",
            self.ns_id, self.dir, len(self), self.used_bytes, self.capacity_bytes,
            ", ".join(f"{k} {v}" for k, v in by_kind.items() if v), time.perf_counter() - t0,
            f", {removed_tmp} interrupted writes removed" if removed_tmp else "",
        )

    def _scan_groups(self) -> list[tuple[float, str, int, tuple[str, ...]]]:
        """Committed groups under groups/ (registered in `_groups`); temporary and unreadable files removed."""
        out = []
        gdir = self.dir / "groups"
        if not gdir.is_dir():
            return out
        for entry in os.scandir(gdir):
            if not entry.name.endswith(group_file.GROUP_SUFFIX):
                unlink_quiet(Path(entry.path))
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    meta = group_file.read_meta(fd)
                finally:
                    os.close(fd)
            except (OSError, group_file.GroupError) as exc:
                logger.warning("tiered ssd: unreadable group %s (%s): removed", entry.name, exc)
                unlink_quiet(Path(entry.path))
                continue
            if meta.ns != self.ns_id:
                unlink_quiet(Path(entry.path))
                continue
            self._groups[meta.gid] = meta
            st = entry.stat()
            out.append((st.st_mtime, meta.gid, st.st_size, meta.keys))
        return out

    def _scan_foreign(self) -> list[tuple[float, str, int, str]]:
        """Files under the root that no rank of this server owns: other namespaces' directories and statistics,
        older layouts, anything else. Another rank's directory (same namespace but for the TP/PP rank) is not
        foreign: that rank counts it."""
        siblings = {self.ns_id}
        for entry in os.scandir(self.root):
            if entry.is_dir() and _is_sibling(Path(entry.path) / NAMESPACE_FILE, self.namespace):
                siblings.add(entry.name)
        out = []
        for entry in _walk(self.root, skip=siblings):  # (this rank's own directory was indexed already)
            rel = Path(entry.path).relative_to(self.root)
            if str(rel) in ROOT_FILES:
                continue
            if rel.parts[0] == "stats" and len(rel.parts) == 2 and rel.stem in siblings:
                continue
            if entry.name.startswith(".write-check-"):  # config validation's probe of another starting server
                continue
            out.append((entry.stat().st_mtime, FOREIGN_PREFIX + str(rel), entry.stat().st_size, "foreign"))
        return out


def page_path(directory: Path, key: str) -> Path:
    """Where the plain page (or activation page) `key` of the namespace at `directory` is stored."""
    return directory / key[:2] / f"{key}{PAGE_SUFFIX}"


def _walk(top: Path, skip: frozenset | set = frozenset()) -> Iterator[os.DirEntry]:
    """Every regular file under `top` (symlinks not followed), not descending into `top`'s directories named in
    `skip`."""
    stack = [top]
    while stack:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if not (here == top and entry.name in skip):
                    stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                yield entry


def _is_sibling(desc_path: Path, ns: Namespace) -> bool:
    """True if `desc_path` describes `ns` but for its TP/PP rank (another rank of the same server)."""
    try:
        desc = json.loads(desc_path.read_text())
    except (OSError, ValueError):
        return False
    ranks = ("id", "tp_rank", "pp_rank")
    mine = {k: v for k, v in ns.describe().items() if k not in ranks}
    return {k: v for k, v in desc.items() if k not in ranks} == mine


def _bump_mtime(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


