"""Background I/O that yields to foreground compute, for machines where both share the same CPU cores.

On a CPU-only server the model forward and the SSD write-through run on the same cores: a page write that lands
during a short prefill (a cache hit recomputes one page) makes it noticeably slower. `ForegroundGate` lets the
writers wait while a forward runs: `busy()` brackets foreground work, `wait_idle()` blocks a writer until no
foreground work is running, or at most `max_wait_s` seconds (so writes are delayed, never starved: under
continuous load every write still goes out within `max_wait_s` plus its own time). Reads are never gated: they are
what a waiting request needs.

Each server process has one gate (`runtime.Runtime.foreground`), enabled by the integration only on machines
without CUDA (on a GPU server the forward does not compete with file I/O for the CPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ForegroundGate:
    def __init__(self, enabled: bool = False, max_wait_s: float = 1.0) -> None:
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self._active = 0
        self._cond = threading.Condition()
        self.waited_s = 0.0  # total seconds writers spent waiting (for tests and logs)

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def wait_idle(self) -> float:
        """Block until no foreground work runs (at most `max_wait_s`); returns the seconds waited."""
        if not self.enabled:
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + self.max_wait_s
        with self._cond:
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            waited = time.monotonic() - t0
            self.waited_s += waited
        return waited
