"""What the store has learned about each KV page: per-token importance and how often the page was reused, keyed by
the page's storage key (stable across radix-node splits, evictions and restarts), persisted next to the pages.

Contracts
* `observe(keys, important)` folds one prefill's verdict (per token of those pages: important or not) into each
  token's exponential moving average; `reuse(keys)` counts one reuse of each page. Both are cheap (a dict update and
  one small append to the log) and thread-safe.
* `important_tokens(keys)` (sum of the tokens' averages) and `reuses(keys)` answer from memory; unknown pages count
  as 0.
* Persistence: an append-only log `importance.log` in the namespace directory; each record is one page's full
  state (key, reuse count, per-token averages as fp16) with its own crc32. Replayed on open (the last record of a key
  wins); a torn or corrupt record ends the replay at that point (what came before is kept). When the log holds more
  than twice the live pages' records it is rewritten (temporary file + rename, so a crash leaves the old one).
* Bounded: the log's bytes count against the SSD tier's capacity (`allot(total bytes)` before each append and
  rewrite, False: not written, counted in `dropped`; `settle(bytes)` after a rewrite shrank it); at most `max_pages`
  pages are known, the least recently updated forgotten first. What a page's tokens taught is kept when the page
  leaves the SSD tier: a page computed again has the same key.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from sglang_tiered.policy.importance import ema
from sglang_tiered.storage.checksum import crc32

LOG_NAME = "importance.log"
_HEAD = struct.Struct("<2sH32sI")  # magic, page size, key (32 bytes: a 64-hex-digit key), reuse count
_MAGIC = b"IM"


@dataclass
class PageImportance:
    tokens: np.ndarray  # float32 [page_size], per-token moving average of "important" (-1 = never observed)
    reuses: int = 0


class ImportanceTable:
    def __init__(self, page_size: int, *, alpha: float = 0.3, directory: Optional[Path] = None,
                 readonly: bool = False, allot: Optional[Callable[[int], bool]] = None,
                 settle: Optional[Callable[[int], None]] = None, max_pages: int = 0) -> None:
        """`directory`: where the log lives (None: memory only). `readonly`: replay the log and never write it (a
        reader beside the server that owns it, e.g. `sglang-tiered stats`). `allot`, `settle`, `max_pages` (0 = no
        cap): see the module docstring."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size, self.alpha = page_size, alpha
        self._allot, self._settle, self.max_pages = allot, settle, max_pages
        self._size = 0  # bytes of the log file
        self.dropped = 0  # records not written: the SSD tier had no room for them
        self._pages: dict[str, PageImportance] = {}
        self._lock = threading.Lock()
        self._path = Path(directory) / LOG_NAME if directory is not None else None
        self._records = 0
        self._observed = 0  # pages with at least one observation
        self._reuses = 0  # sum of the pages' reuse counts
        self._fd: Optional[int] = None
        self._readonly = readonly
        if self._path is not None:
            self._replay()
            if not readonly:
                self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    # ---------------------------------------------------------------------------------------------- updates
    def observe(self, keys: Sequence[str], important: Sequence[bool]) -> None:
        """One prefill saw the tokens of pages `keys` (in order, page_size tokens each); `important[i]` says whether
        token i was among the prompt's important tokens."""
        if len(important) != len(keys) * self.page_size:
            raise ValueError(f"{len(important)} verdicts for {len(keys)} pages of {self.page_size} tokens")
        with self._lock:
            for p, key in enumerate(keys):
                page = self._page(key)
                self._observed += int(page.tokens[0] < 0)
                for t in range(self.page_size):
                    page.tokens[t] = ema(float(page.tokens[t]), float(important[p * self.page_size + t]), self.alpha)
                self._append(key, page)

    def reuse(self, keys: Sequence[str]) -> None:
        """A request reused pages `keys` (loaded them instead of computing them)."""
        with self._lock:
            for key in keys:
                page = self._page(key)
                page.reuses += 1
                self._reuses += 1
                self._append(key, page)

    # ---------------------------------------------------------------------------------------------- queries
    def get(self, key: str) -> Optional[PageImportance]:
        with self._lock:
            page = self._pages.get(key)
            return PageImportance(page.tokens.copy(), page.reuses) if page is not None else None

    def important_tokens(self, keys: Sequence[str]) -> float:
        with self._lock:
            return float(sum(np.clip(p.tokens, 0, None).sum() for p in map(self._pages.get, keys) if p is not None))

    def reuses(self, keys: Sequence[str]) -> int:
        with self._lock:
            return sum(p.reuses for p in map(self._pages.get, keys) if p is not None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)

    def coverage(self) -> dict:
        """Pages known, pages with observed importance, total reuses (for statistics; O(1))."""
        with self._lock:
            return {"pages": len(self._pages), "observed_pages": self._observed, "reuses": self._reuses}

    def _drop(self, key: str) -> None:
        page = self._pages.pop(key, None)
        if page is not None:
            self._observed -= int(page.tokens[0] >= 0)
            self._reuses -= page.reuses

    def export(self, key: str) -> Optional[bytes]:
        """Page `key`'s state as one checksummed record (what `adopt` takes on another server), or None if unknown."""
        with self._lock:
            page = self._pages.get(key)
            return self._encode(key, page) if page is not None and page.tokens[0] >= 0 else None

    def adopt(self, key: str, record: bytes) -> bool:
        """Take page `key`'s state from another server's `export` if this table knows nothing of the page yet (what
        was learned here wins). False: a record of another key or page size, or corrupt (ignored)."""
        found = list(self._iter_records(record)) if len(record) == self._record_size() else []
        if not found or found[0][0] != key:
            return False
        with self._lock:
            if key in self._pages:
                return True
            page = self._pages[key] = found[0][1]
            self._observed += int(page.tokens[0] >= 0)
            self._reuses += page.reuses
            self._append(key, page)
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # ---------------------------------------------------------------------------------------------- log
    def _page(self, key: str) -> PageImportance:
        page = self._pages.pop(key, None)  # re-inserted: the dict's order is the order of the last update
        if page is None:
            page = PageImportance(np.full(self.page_size, -1.0, dtype=np.float32))
        self._pages[key] = page
        while self.max_pages and len(self._pages) > self.max_pages:
            self._drop(next(iter(self._pages)))
        return page

    def _encode(self, key: str, page: PageImportance) -> bytes:
        body = _HEAD.pack(_MAGIC, self.page_size, bytes.fromhex(key), page.reuses) + \
            page.tokens.astype(np.float16).tobytes()
        return body + struct.pack("<I", crc32(body))

    def _append(self, key: str, page: PageImportance) -> None:
        if self._fd is None:
            return
        record = self._encode(key, page)
        if self._allot is not None and not self._allot(self._size + len(record)):
            self.dropped += 1
            return
        os.write(self._fd, record)
        self._size += len(record)
        self._records += 1
        if self._records > 2 * len(self._pages) + 1024:
            self._compact()

    def _record_size(self) -> int:
        return _HEAD.size + 2 * self.page_size + 4

    def _iter_records(self, data: bytes) -> Iterator[tuple[str, PageImportance]]:
        size = self._record_size()
        for off in range(0, len(data) - size + 1, size):
            rec = data[off : off + size]
            body, crc = rec[:-4], struct.unpack("<I", rec[-4:])[0]
            magic, page_size, key, reuses = _HEAD.unpack(body[: _HEAD.size])
            if magic != _MAGIC or page_size != self.page_size or crc32(body) != crc:
                return  # torn or corrupt: keep what came before
            tokens = np.frombuffer(body[_HEAD.size :], dtype=np.float16).astype(np.float32)
            yield key.hex(), PageImportance(tokens, reuses)

    def _replay(self) -> None:
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return
        self._size = len(data)
        for key, page in self._iter_records(data):
            old = self._pages.get(key)
            if old is not None:
                self._observed -= int(old.tokens[0] >= 0)
                self._reuses -= old.reuses
            self._pages[key] = page
            self._observed += int(page.tokens[0] >= 0)
            self._reuses += page.reuses
            self._records += 1
        if self._records * self._record_size() != len(data) and not self._readonly:
            self._compact()  # drop a torn tail before appending after it

    def _compact(self) -> None:
        """Rewrite the log with one record per live page (beside the old log until the rename: both counted)."""
        new_size = len(self._pages) * self._record_size()
        if self._allot is not None and not self._allot(self._size + new_size):
            return  # no room for the rewrite now: the log keeps growing only as far as allot allows
        tmp = self._path.with_suffix(f".{os.getpid()}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            for key, page in self._pages.items():
                f.write(self._encode(key, page))
        os.replace(tmp, self._path)
        self._records, self._size = len(self._pages), new_size
        if self._settle is not None:
            self._settle(new_size)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
