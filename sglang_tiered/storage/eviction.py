"""Eviction strategies, kept apart from the bookkeeping in `ssd_tier.py`.

A strategy sees only keys: `insert` a new key, `touch` one on access, `remove` one that is gone, and
`victims()` yields candidates in eviction order; the caller finishes iterating before it removes
any. It is not thread-safe on its own; the tier calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: str) -> None: ...
    def touch(self, key: str) -> None: ...
    def remove(self, key: str) -> None: ...
    def victims(self) -> Iterator[str]: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
