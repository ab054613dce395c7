"""The shared store below the SSD tier: the primitives every backend provides (`RemoteStore`), and `MemoryStore`,
an in-process one for tests of the tier logic. `mooncake_store.MooncakeStore` is the real one.

Contract of a `RemoteStore` (all calls blocking; call them from background threads, never the scheduler loop):
* `put(key, blob)` stores `blob` under `key`. Storing a key that exists is a success and may keep the old value
  (objects are immutable: the same key always names the same bytes).
* `get(key)` returns the stored bytes, or None when nothing is stored under `key` (or the object was lost);
  `get_many(keys)` does the same for several keys in one round trip.
* `exists(keys)` answers for each key, in order, in one round trip.
* Any failure to reach the store raises `RemoteError`; a store that raised may work again later (reconnects are the
  backend's business; `RemoteTier` retries). A put may also fail while the store answers (no room now, a transfer
  to another member's segment failed): `RemoteTier` tells the two apart with an `exists`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Optional, Protocol


class RemoteError(Exception):
    """The shared store could not be reached or refused the operation."""


class RemoteStore(Protocol):
    def put(self, key: str, blob: bytes) -> None: ...

    def get(self, key: str) -> Optional[bytes]: ...

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]: ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def close(self) -> None: ...


class MemoryStore:
    """A `RemoteStore` in this process's memory (tests). `down = True` makes every call raise RemoteError;
    `refuse_puts = True` makes puts raise it while lookups answer (a full store)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False
        self.refuse_puts = False
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise RemoteError("memory store is down")

    def put(self, key: str, blob: bytes) -> None:
        self._check()
        if self.refuse_puts:
            raise RemoteError("memory store refuses puts")
        with self._lock:
            self.objects.setdefault(key, bytes(blob))

    def get(self, key: str) -> Optional[bytes]:
        self._check()
        with self._lock:
            return self.objects.get(key)

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        self._check()
        with self._lock:
            return [self.objects.get(k) for k in keys]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        with self._lock:
            return [k in self.objects for k in keys]

    def close(self) -> None:
        pass
