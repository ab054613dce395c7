"""The remote tier: one SSD tier's pages shared with every server that uses the same store and namespace.

Object names are `sgt/<namespace id>/<page key>` (the page file as stored on SSD: header naming namespace and key, one
checksum per segment), so servers with another model, dtype, page size, layout, TP/PP rank or salt never see each
other's objects, and a fetched page is checked exactly like a file read from the local disk.

Contracts
* `publish(keys)` never blocks: keys go to a bounded queue; one background thread reads each page's file and puts
  it. Pages that could not be put while the store was down are published when it answers again (up to
  `queue_pages` of them, the oldest dropped beyond); a full queue drops a page from sharing (counted). Either way
  the page stays on the local SSD.
* `leading_hits(keys)` and `fetch(pages)` block on the network: call them from SGLang's prefetch thread, never the
  scheduler loop. While the store is down they answer "miss" at once.
* A fetched page is served only if it passes the checks of a local read (`page_file.read_blob`: namespace, key,
  size, every segment's checksum); then the background thread keeps it on the local SSD (a local hit next time).
  Corrupt or foreign objects are counted misses, never served or kept.
* Down: a failed lookup, or a failed put after which the store does not answer an `exists` either, marks the store
  down (counted, logged once); the background thread retries `connect` (if it never connected) or a cheap `exists`
  every `retry_s` seconds and marks it up again when it answers.
* Refused: a put that fails while the store answers (no room now, a failed transfer to another member's segment, a
  restarted master before its members re-mount their segments) is counted as an error and the page waits with the
  deferred ones, retried every `retry_s` seconds and at once when a put succeeds (logged once until one does); the
  store stays up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Optional

from sglang_tiered.storage.page_file import CorruptPage, ForeignPage, read_blob
from sglang_tiered.storage.remote import RemoteError, RemoteStore
from sglang_tiered.storage.ssd_tier import PageIO, SSDTier

logger = logging.getLogger(__name__)

PREFIX = "sgt"
_PROBE = "probe"  # a key never stored: `exists` on it checks that the store answers
_KNOWN_MAX = 1 << 20  # keys remembered as published; beyond, forgotten (a second put of a key is harmless)


class RemoteTier:
    def __init__(self, connect: Callable[[], RemoteStore], tier: SSDTier, *,
                 retry_s: float = 5.0, queue_pages: int = 1024,
                 before_put: Optional[Callable[[], object]] = None) -> None:
        """`connect()` returns a connected store or raises RemoteError / ImportError; it is tried once now (a
        failure is logged and retried in the background: the server starts local-only). `before_put` runs in the
        background thread before each publish (e.g. `ForegroundGate.wait_idle`; keeping a fetched page on the SSD
        waits on the tier's own `before_write`)."""
        self._before_put = before_put
        self._connect_failed = False
        self._refusing = False  # the last put failed while the store answered: deferred pages are retried
        self._deferred: deque[str] = deque(maxlen=queue_pages)  # pages to publish once the store answers again
        self.tier = tier
        self.stats = tier.stats
        self.retry_s = retry_s
        self._connect = connect
        self._store: Optional[RemoteStore] = None
        self._up = False
        self._published: set[str] = set()  # keys this server put or found in the store (not put again)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_pages)  # page keys to publish, (key, blob) to keep
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._try_connect()
        self._thread = threading.Thread(target=self._run, name="tiered-remote", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- naming
    def object_key(self, key: str) -> str:
        return f"{PREFIX}/{self.tier.ns_id}/{key}"

    @property
    def up(self) -> bool:
        return self._up

    # ----------------------------------------------------------------- lookups (prefetch thread)
    def leading_hits(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` the shared store holds (0 while it is down)."""
        store = self._live()
        if store is None or not keys:
            return 0
        try:
            found = store.exists([self.object_key(k) for k in keys])
        except RemoteError as exc:
            self._mark_down(exc)
            return 0
        n = next((i for i, hit in enumerate(found) if not hit), len(found))
        with self._lock:
            self._published.update(keys[:n])
        return n

    def fetch(self, pages: Sequence[PageIO]) -> list[bool]:
        """Fill each page's buffers from the shared store, all pages in one round trip. result[i] is False for a
        miss of any kind (absent, lost, corrupt, foreign, store down), counted; its buffers are then garbage.
        Served pages are kept on the local SSD by the background thread."""
        store = self._live()
        if store is None or not pages:
            self.stats.add(remote_miss_pages=len(pages))
            return [False] * len(pages)
        t0 = time.perf_counter()
        try:
            blobs = store.get_many([self.object_key(key) for key, _ in pages])
        except RemoteError as exc:
            self._mark_down(exc)
            self.stats.add(remote_miss_pages=len(pages))
            return [False] * len(pages)
        out = []
        for (key, segments), blob in zip(pages, blobs):
            out.append(blob is not None and self._serve(key, blob, segments))
        served = [blob for blob, ok in zip(blobs, out) if ok]
        self.stats.add(remote_hit_pages=len(served), remote_miss_pages=len(pages) - len(served),
                       remote_bytes_read=sum(len(b) for b in served), remote_read_seconds=time.perf_counter() - t0)
        for (key, _), blob, ok in zip(pages, blobs, out):
            if ok:
                try:
                    self._queue.put_nowait((key, blob))
                except queue.Full:  # served, not kept locally: the next request fetches it again
                    pass
        return out

    def _serve(self, key: str, blob: bytes, segments: Sequence[memoryview]) -> bool:
        try:
            read_blob(blob, self.tier.ns_id, key, segments)
        except (CorruptPage, ForeignPage) as exc:
            foreign = isinstance(exc, ForeignPage)
            logger.warning("tiered remote: %s object for page %s (%s): not served", "foreign" if foreign else "corrupt",
                           key, exc)
            self.stats.add(**{"remote_foreign_pages" if foreign else "remote_corrupt_pages": 1})
            return False
        return True

    # ----------------------------------------------------------------- publishing (never blocks)
    def publish(self, keys: Sequence[str]) -> None:
        """Queue pages stored on the local SSD for the shared store."""
        with self._lock:
            if len(self._published) > _KNOWN_MAX:
                self._published.clear()
            fresh = [k for k in keys if k not in self._published]
            self._published.update(fresh)
        for key in fresh:
            self._enqueue(key)

    def _enqueue(self, key: str) -> None:
        """Queue a page for publishing; a full queue drops it from sharing (counted; a later write may retry)."""
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            self.stats.add(remote_dropped_pages=1)
            with self._lock:
                self._published.discard(key)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued page was handled (tests, shutdown). True if the queue emptied in time."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _put(self, store: RemoteStore, key: str) -> None:
        blob = self.tier.page_blob(key)
        if blob is None:  # evicted or repacked meanwhile
            with self._lock:
                self._published.discard(key)
            return
        if self._before_put is not None:
            self._before_put()
        try:
            store.put(self.object_key(key), blob)
        except RemoteError as exc:
            self._defer(key)
            self._put_failed(store, exc)
            return
        if self._refusing:
            self._refusing = False
            logger.info("tiered remote: the shared store takes pages again")
            self._resume()  # the pages it refused go out now (the retry timer runs only while it refuses)
        self.stats.add(remote_published_pages=1, remote_bytes_written=len(blob))

    def _put_failed(self, store: RemoteStore, exc: RemoteError) -> None:
        """Down if the store does not answer an `exists` now either; else refused (retried by `_run`)."""
        try:
            store.exists([self.object_key(_PROBE)])
        except RemoteError:
            self._mark_down(exc)
            return
        self.stats.add(remote_errors=1)
        if not self._refusing:
            self._refusing = True
            logger.warning("tiered remote: a put failed while the shared store answers (%s); pages wait and are "
                           "retried every %.0f s, lookups go on", exc, self.retry_s)

    def _defer(self, key: str) -> None:
        """Publish `key` once the store answers again; beyond `queue_pages` deferred pages, the oldest is dropped
        from sharing (counted)."""
        with self._lock:
            if len(self._deferred) == self._deferred.maxlen:
                self._published.discard(self._deferred[0])
                self.stats.add(remote_dropped_pages=1)
            self._deferred.append(key)

    def _resume(self) -> None:
        """The store answers again: queue the deferred pages."""
        with self._lock:
            keys, self._deferred = list(self._deferred), deque(maxlen=self._deferred.maxlen)
        for key in keys:
            self._enqueue(key)

    # ----------------------------------------------------------------- health
    def _live(self) -> Optional[RemoteStore]:
        return self._store if self._up else None

    def _mark_down(self, exc: Exception) -> None:
        self.stats.add(remote_errors=1)
        with self._lock:
            was_up, self._up = self._up, False
        if was_up:
            self.stats.set(remote_up=0)
            logger.warning("tiered remote: shared store down (%s); serving from local tiers, retrying every %.0f s",
                           exc, self.retry_s)

    def _mark_up(self) -> None:
        with self._lock:
            self._up = True
        self.stats.set(remote_up=1)

    def _try_connect(self) -> None:
        try:
            store = self._connect()
        except (RemoteError, ImportError, OSError) as exc:
            if not self._connect_failed and not self._stop.is_set():  # said once; the retries are quiet
                logger.warning("tiered remote: cannot connect (%s); local tiers only until it answers (retry every "
                               "%.0f s)", exc, self.retry_s)
            self._connect_failed = True
            return
        self._store = store
        self._mark_up()
        logger.info("tiered remote: connected, namespace %s", self.tier.ns_id)
        self._resume()

    def _probe(self) -> None:
        if self._store is None:
            self._try_connect()
            return
        try:
            self._store.exists([self.object_key(_PROBE)])
        except RemoteError:
            return
        self._mark_up()
        logger.info("tiered remote: shared store answers again; publishing %d deferred pages", len(self._deferred))
        self._resume()

    def _run(self) -> None:
        next_probe = 0.0
        while not self._stop.is_set():
            try:
                key = self._queue.get(timeout=self.retry_s / 4)
            except queue.Empty:
                key = None
            try:
                if isinstance(key, tuple):  # a fetched page, kept on the local SSD
                    self.tier.keep_page(*key)
                elif key is not None:
                    store = self._live()
                    if store is None:
                        self._defer(key)
                    else:
                        self._put(store, key)
                if (self._refusing or not self._up) and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.retry_s
                    if self._up:  # the last put was refused: try the deferred pages again
                        self._resume()
                    else:
                        self._probe()
            except Exception:  # the remote tier must never take the server down
                logger.exception("tiered remote: background thread error")
            finally:
                if key is not None:
                    self._queue.task_done()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.retry_s + 5)
        if self._store is not None:
            self._store.close()
