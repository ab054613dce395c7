"""Copies of page payloads kept from their write until the repacker rewrites them, so that a repack does not read
back from the SSD what was written moments before (on slow storage those reads compete with the loads that serve
requests). Pure bookkeeping: bytes in, bytes out; no files, no torch, no SGLang.

Contracts
* Only expected pages are kept: `expect(keys)` (the repacker, when a prompt is offered) comes before `keep`
  (the tier, when the page is written); a page written before it was expected is simply not kept (the repack
  reads it from the SSD, as without a stash).
* The kept bytes never exceed `capacity_bytes`; a page that does not fit is not kept (no eviction: what is kept
  is what the next repack needs, dropping it would only move the read).
* `take(key)` hands a kept payload over once (None if not kept); `forget(keys)` ends one `expect(keys)` (call it
  when the repack of those keys is over, whatever its outcome): a page no longer expected by any offer loses its
  copy, so nothing stays behind.
* Thread-safe: `keep` runs on the tier's I/O threads, `expect`/`take`/`forget` on the repacker's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Optional


class PayloadStash:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._expected: dict[str, int] = {}  # key -> offers expecting it
        self._kept: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def expect(self, keys: Iterable[str]) -> None:
        """The pages `keys` will be repacked: keep their payloads when they are written."""
        if self.capacity_bytes:
            with self._lock:
                for key in keys:
                    self._expected[key] = self._expected.get(key, 0) + 1

    def keep(self, key: str, segments: Sequence[memoryview]) -> bool:
        """Copy the payload of page `key` (its segments, in order) if it is expected and fits. True when kept."""
        size = sum(s.nbytes for s in segments)
        with self._lock:
            if key not in self._expected or key in self._kept or self._used + size > self.capacity_bytes:
                return False
            self._used += size  # reserved before the copy, outside the lock
        payload = b"".join(segments)
        with self._lock:
            if key in self._expected and key not in self._kept:
                self._kept[key] = payload
                return True
            self._used -= size  # forgotten (or kept by another thread) meanwhile
            return False

    def take(self, key: str) -> Optional[bytes]:
        """The kept payload of `key`, handed over once, or None."""
        with self._lock:
            payload = self._kept.pop(key, None)
            if payload is not None:
                self._used -= len(payload)
            return payload

    def forget(self, keys: Iterable[str]) -> None:
        """End one expectation of `keys`; a page no longer expected loses any payload still kept for it."""
        if not self.capacity_bytes:
            return
        with self._lock:
            for key in keys:
                left = self._expected.get(key, 0) - 1
                if left > 0:
                    self._expected[key] = left
                    continue
                self._expected.pop(key, None)
                payload = self._kept.pop(key, None)
                if payload is not None:
                    self._used -= len(payload)
