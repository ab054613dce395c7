"""Per-request retention: a client asks the server to keep its prompt's KV pages for N seconds
(`custom_params.tiered_retain`), and every tier keeps them ahead of everything that is not pinned until then.
Pure: no SGLang, no files, no torch.

Contracts
* `pin(keys, seconds)`: pins the pages `keys` (a prompt's page keys, in order: the last one names the whole prefix,
  SGLang's keys being a hash chain) until now + `seconds`, capped at `max_seconds`. Pinning the same prefix again
  keeps the later expiry and makes it the newest pin. The pages of all live pins number at most `max_pages`: the
  oldest pins are released early to make room (returned: the caller counts them); a prompt of more than `max_pages`
  pages is refused (`PinRefused`).
* `pinned(key)`: a live pin covers page `key` (expired pins cover nothing, whether or not `expire` ran).
  Thread-safe: the SSD tier asks from its I/O threads, the scheduler pins.
* `expire()` forgets expired pins (`pin` does it too) and returns them.
How the tiers honour pins: device and host eviction rank a pinned radix node after every unpinned one of its tier
(`policy/placement.rank`); the SSD index never picks a pinned entry (`storage/disk_index.py`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    keys: tuple[str, ...]
    until: float  # the clock's time at expiry


class PinRefused(ValueError):
    """A prompt with more pages than retention may hold at all."""


class Retention:
    def __init__(self, max_seconds: float, max_pages: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_seconds < 0 or max_pages < 0:
            raise ValueError(f"max_seconds and max_pages must be >= 0, got {max_seconds}, {max_pages}")
        self.max_seconds, self.max_pages, self.clock = float(max_seconds), int(max_pages), clock
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # by the prefix's last key, oldest first
        self._pages: Counter[str] = Counter()  # page key -> live pins covering it
        self._until: dict[str, float] = {}  # page key -> latest expiry of the pins covering it
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_seconds > 0 and self.max_pages > 0

    def pin(self, keys: Sequence[str], seconds: float) -> tuple[Pin, list[Pin]]:
        """Pin `keys` for `seconds` (capped); returns the pin and the pins released early to make room."""
        keys = tuple(keys)
        if not keys:
            raise ValueError("nothing to pin: the prompt has no complete page")
        if len(set(keys)) > self.max_pages:
            raise PinRefused(f"{len(keys)} pages; retention holds at most {self.max_pages}")
        now = self.clock()
        until = now + min(float(seconds), self.max_seconds)
        with self._lock:
            self._expire_locked(now)
            old = self._pins.get(keys[-1])
            if old is not None:
                until = max(until, old.until)
                self._drop_locked(keys[-1])
            released = []
            while self._pins and len(set(self._pages) | set(keys)) > self.max_pages:
                released.append(self._drop_locked(next(iter(self._pins))))
            pin = self._pins[keys[-1]] = Pin(keys, until)
            for key in keys:
                self._pages[key] += 1
                self._until[key] = max(self._until.get(key, 0.0), until)
            return pin, released

    def pinned(self, key: str) -> bool:
        with self._lock:
            return self._until.get(key, 0.0) > self.clock()

    def expire(self) -> list[Pin]:
        with self._lock:
            return self._expire_locked(self.clock())

    def pages(self) -> list[str]:
        """The page keys live pins cover (expired pins forgotten first)."""
        with self._lock:
            self._expire_locked(self.clock())
            return list(self._pages)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pins)

    def _expire_locked(self, now: float) -> list[Pin]:
        gone = [last for last, pin in self._pins.items() if pin.until <= now]
        return [self._drop_locked(last) for last in gone]

    def _drop_locked(self, last: str) -> Pin:
        pin = self._pins.pop(last)
        for key in pin.keys:
            self._pages[key] -= 1
            if self._pages[key] <= 0:
                del self._pages[key]
                del self._until[key]
        touched = set(pin.keys) & set(self._until)
        if touched:  # pages other pins still cover: their latest expiry among those pins
            for key in touched:
                self._until[key] = 0.0
            for other in self._pins.values():
                for key in touched.intersection(other.keys):
                    self._until[key] = max(self._until[key], other.until)
        return pin
