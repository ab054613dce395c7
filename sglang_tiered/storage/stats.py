"""Thread-safe counters of one tier. Units: pages, bytes, seconds."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class TierStats:
    hit_pages: int = 0
    sparse_bytes_read: int = 0  # bytes sparse loads read from groups (probe + chunks)
    sparse_bytes_needed: int = 0  # bytes of the K and V of the tokens those loads used
    group_reads: int = 0  # reads from repacked groups (a probe layer, or chunks of one layer)
    repacked_groups: int = 0  # groups committed (a run of pages rewritten as one file)
    repacked_pages: int = 0  # pages rewritten into groups
    repack_pages_kept: int = 0  # pages a repack took from the copy kept at their write (stash.py): no read
    repack_pages_read: int = 0  # pages a repack read back from their files
    repack_bytes_read: int = 0  # bytes of those reads (not in bytes_read: no request waited for them)
    miss_pages: int = 0  # asked for and not in the index
    bytes_read: int = 0
    read_seconds: float = 0.0
    written_pages: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    dedup_pages: int = 0  # write requests for pages already stored
    evicted_pages: int = 0
    evicted_bytes: int = 0
    corrupt_pages: int = 0  # torn, truncated or checksum mismatch: removed
    foreign_pages: int = 0  # another namespace's page under our name: removed
    lost_pages: int = 0  # indexed but the file vanished
    io_errors: int = 0  # OSError on read or write (disk full, permissions)
    rejected_pages: int = 0  # could not be admitted (larger than the capacity)
    imported_pages: int = 0  # pages copied in from the shared store (remote tier)
    remote_hit_pages: int = 0  # pages missing locally and served from the shared store
    remote_miss_pages: int = 0  # pages asked of the shared store and not served (absent, lost, corrupt, down)
    remote_bytes_read: int = 0
    remote_read_seconds: float = 0.0
    remote_published_pages: int = 0  # pages put into the shared store
    remote_bytes_written: int = 0
    remote_corrupt_pages: int = 0  # fetched pages that failed their checksum (or named another page): not served
    remote_foreign_pages: int = 0  # fetched pages of another namespace under our key: not served
    remote_dropped_pages: int = 0  # pages not published: the queue was full or the store was down
    remote_errors: int = 0  # failed calls to the shared store (each marks it down until it answers again)
    used_bytes: int = 0  # gauge
    stored_pages: int = 0  # gauge
    remote_up: int = 0  # gauge: 1 while the shared store answers
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def set(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self, name, value)

    def snapshot(self) -> dict:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
