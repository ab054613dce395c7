"""Background repacking: prompts offered after their prefill get their stored pages rewritten as groups
(`TierGroups.repack`: one file, in prompt order, in chunks, with the probe a sparse load scores with).

Contracts
* `offer(keys)` never blocks (a full queue drops the offer; the pages stay plain, which is always correct).
* The worker waits (up to `wait_s`) for the pages to reach the SSD tier -- write-through is asynchronous -- then
  repacks each maximal run of consecutive plain pages of at least `min_pages` pages. A `chunk`-token run of
  consecutive tokens is the I/O unit of a sparse load, so neighbouring tokens travel together (a fact is a run of
  tokens); on SmolLM2, runs of consecutive tokens answer about as a single-token selection of the same size does
  (benchmarks/importance.py part quality).
* `before_repack()` runs first (e.g. `ForegroundGate.wait_idle`: on CPU, repacking yields to the model forward).
* With a `worker` (`repack_worker.RepackWorker`, what a server uses) the group files are built in its child process
  at the lowest CPU priority; without one, in this thread. In a server the thread shares the scheduler's GIL:
  6 cold 4,096-token prompts sent back to back (2 cores, bf16) had a median TTFT 1.39x a default server's with the
  thread, 1.05x with the child (one run).
* With a `stash` (the one attached to the tier, `stash.py`), an accepted offer asks the tier to keep the pages'
  payloads as they are written, and the repack takes them from there instead of reading the files back; the
  stash forgets the offer's pages when its repack is over, whatever the outcome.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

from sglang_tiered.storage.group_file import PROBE_BITS
from sglang_tiered.storage.groups import build_group
from sglang_tiered.storage.repack_worker import RepackWorker
from sglang_tiered.storage.ssd_tier import SSDTier
from sglang_tiered.storage.stash import PayloadStash

logger = logging.getLogger(__name__)


class Repacker:
    def __init__(self, tier: SSDTier, probe_heads: Sequence[int], *, min_pages: int = 4, chunk: int = 16,
                 wait_s: float = 30.0, before_repack: Optional[Callable[[], object]] = None,
                 probe_bits: int = PROBE_BITS, stash: Optional[PayloadStash] = None,
                 worker: Optional[RepackWorker] = None) -> None:
        """`probe_heads`: the KV heads the groups' probe holds, with `probe_bits` bits (`group_file.quantize_probe`).
        `stash`, `worker` (closed with the repacker): see the module docstring."""
        self.tier, self.probe_heads, self.probe_bits, self.stash = tier, list(probe_heads), probe_bits, stash
        self.worker = worker
        self.min_pages, self.chunk, self.wait_s, self.before_repack = min_pages, chunk, wait_s, before_repack
        self._queue: queue.Queue = queue.Queue(maxsize=256)
        self._busy = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tiered-repack", daemon=True)
        self._thread.start()

    def offer(self, keys: Sequence[str]) -> None:
        if len(keys) >= self.min_pages:
            if self.stash is not None:  # before the queue: the worker may take the offer at once
                self.stash.expect(keys)
            try:
                self._queue.put_nowait(list(keys))
            except queue.Full:
                if self.stash is not None:
                    self.stash.forget(keys)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every offer so far was handled (for tests)."""
        deadline = time.monotonic() + timeout
        while (not self._queue.empty() or self._busy.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        if self.worker is not None:
            self.worker.close()

    def _run(self) -> None:
        while True:
            keys = self._queue.get()
            if keys is None or self._stop:
                return
            self._busy.set()
            try:
                self._repack(keys)
            except Exception:  # a failed repack leaves the plain pages: correct, just not repacked
                logger.exception("tiered repack: failed")
            finally:
                if self.stash is not None:
                    self.stash.forget(keys)
                self._busy.clear()

    def _repack(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.wait_s
        while self.tier.leading_hits(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.2)
        run: list[str] = []
        for key in [*keys, None]:
            plain = key is not None and self.tier.contains(key) and self.tier.group_of(key) is None
            if plain:
                run.append(key)
                continue
            if len(run) >= self.min_pages:
                if self.before_repack is not None:
                    self.before_repack()
                build = self.worker.build if self.worker is not None else build_group
                if self.tier.groups.repack(run, self.probe_heads, self.chunk, self.probe_bits, build):
                    logger.info("tiered repack: %d pages", len(run))
            run = []
