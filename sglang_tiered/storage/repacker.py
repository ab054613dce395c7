"""Background repacking: prompts whose tokens were scored get their stored pages rewritten as importance-ordered
groups (`SSDTier.repack`), so that a sparse load finds the tokens it wants in a group's first chunks.

Contracts
* `offer(keys)` never blocks (a full queue drops the offer; the pages stay plain, which is always correct).
* The worker waits (up to `wait_s`) for the pages to reach the SSD tier -- write-through is asynchronous -- then
  repacks each maximal run of consecutive plain pages of at least `min_pages` pages. Slots are ordered by
  `chunk`-token runs of consecutive tokens, most important run first (the mean of its tokens' importance averages;
  ties and unobserved runs by position), tokens in prompt order inside a run: a chunk is the I/O unit of a sparse
  load, and neighbouring tokens travel together (a fact is a run of tokens). On SmolLM2, runs of consecutive
  tokens answer about as a single-token selection of the same size does (benchmarks/importance.py part quality);
  bundles of 16 importance-ranked tokens, the layout before, agreed less with a full load in an engine experiment.
* `before_repack()` runs first (e.g. `ForegroundGate.wait_idle`: on CPU, repacking yields to the model forward).
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
from sglang_tiered.storage.importance_table import ImportanceTable
from sglang_tiered.storage.ssd_tier import SSDTier
from sglang_tiered.storage.stash import PayloadStash

logger = logging.getLogger(__name__)


def importance_order(table: ImportanceTable, keys: Sequence[str], page_size: int, chunk: int) -> list[int]:
    """Token positions of the run `keys`: `chunk`-token runs of consecutive positions, the most important run first
    (mean importance; unknown importance counts 0; ties by position), each run in position order."""
    scores: list[float] = []
    for key in keys:
        page = table.get(key)
        scores += [max(0.0, float(x)) for x in page.tokens] if page is not None else [0.0] * page_size
    starts = range(0, len(scores), chunk)
    mean = {c: sum(scores[c : c + chunk]) / len(scores[c : c + chunk]) for c in starts}
    return [t for c in sorted(starts, key=lambda c: (-mean[c], c)) for t in range(c, min(c + chunk, len(scores)))]


class Repacker:
    def __init__(self, tier: SSDTier, table: ImportanceTable, probe_heads: Sequence[int], *, min_pages: int = 4,
                 chunk: int = 16, wait_s: float = 30.0, before_repack: Optional[Callable[[], object]] = None,
                 by_importance: bool = True, probe_bits: int = PROBE_BITS,
                 stash: Optional[PayloadStash] = None) -> None:
        """`by_importance` False: groups keep prompt order (`--tiered-importance-order position`, for comparison).
        `probe_bits`: the groups' probe (`group_file.quantize_probe`). `stash`: see the module docstring."""
        self.tier, self.table, self.probe_heads, self.probe_bits = tier, table, list(probe_heads), probe_bits
        self.by_importance, self.stash = by_importance, stash
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

    def _run(self) -> None:
        while True:
            keys = self._queue.get()
            if keys is None or self._stop:
                return
            self._busy.set()
            try:
                self._repack(keys)
            except Exception:  # a failed repack leaves the plain pages: correct, just not reordered
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
                ps = self.tier.namespace.page_size
                order = importance_order(self.table, run, ps, self.chunk) if self.by_importance else \
                    list(range(len(run) * ps))
                if self.tier.groups.repack(run, order, self.probe_heads, self.chunk, self.probe_bits):
                    logger.info("tiered repack: %d pages in %s order", len(run),
                                "importance" if self.by_importance else "prompt")
            run = []
