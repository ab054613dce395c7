"""The SSD tier's small files: meta files written whole (`write`), files their owner appends to (`reserve` before,
`settle` after), and scratch files for the length of a block (`scratch`) -- every byte counted against the tier's
one capacity under its lock, like its pages."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from sglang_tiered.storage.files import write_atomic
from sglang_tiered.storage.tier_layout import META_PREFIX

if TYPE_CHECKING:
    from sglang_tiered.storage.ssd_tier import SSDTier

logger = logging.getLogger("sglang_tiered.storage.ssd_tier")


class TierMeta:
    """The meta and scratch files of one SSD tier (its index, lock and statistics)."""

    def __init__(self, tier: SSDTier) -> None:
        self.tier = tier

    def write(self, relpath: str, data: bytes, *, replace: bool = True) -> bool:
        """Write the small file `<root>/<relpath>` atomically (0600), its bytes counted against the capacity (the
        temporary copy beside the old one included). `replace=False`: keep an existing file. False when there is
        no room (nothing written, counted) or the write failed."""
        with self.tier._lock:
            old = self.tier._index.size(META_PREFIX + relpath)
        if old and not replace:  # (an entry of 0 bytes: a write that failed, nothing there)
            return True
        if not self.reserve(relpath, (old or 0) + len(data)):  # old and new side by side until the rename
            return False
        try:
            write_atomic(self.tier.root / relpath, data)
        except OSError as exc:
            logger.warning("tiered ssd: writing %s failed: %s", relpath, exc)
            self.settle(relpath, old or 0)
            self.tier.stats.add(io_errors=1)
            return False
        self.settle(relpath, len(data))
        self.tier._publish_gauges()
        return True

    def reserve(self, relpath: str, nbytes: int) -> bool:
        """Make sure `nbytes` are counted for the file `<root>/<relpath>` that its owner writes itself (an
        append-only log: call before each append with its size after it; a rewrite beside it: with old + new).
        False (nothing changes) when there is no room. `settle` gives back what is not used."""
        key = META_PREFIX + relpath
        with self.tier._lock:
            old = self.tier._index.size(key)
            if old is not None and old >= nbytes:
                return True
            if old is None:
                res = self.tier._index.reserve(key, nbytes, "meta")
                if res.admitted:
                    self.tier._index.commit(key, nbytes)
            else:
                res = self.tier._index.resize(key, nbytes)
            self.tier._delete_locked(res.victims)
        if not res.admitted:
            self.tier.stats.add(rejected_pages=1)
        return res.admitted

    def settle(self, relpath: str, nbytes: int) -> None:
        """The file `<root>/<relpath>` now holds `nbytes` (after a rewrite shrank it)."""
        key = META_PREFIX + relpath
        with self.tier._lock:
            if self.tier._index.size(key) is not None:
                self.tier._index.resize(key, nbytes)

    @contextlib.contextmanager
    def scratch(self, name: str, nbytes: int) -> Iterator[Optional[Path]]:
        """A path under the root where a file of up to `nbytes` may be written for the duration of the block (e.g.
        a read-bandwidth probe), counted against the capacity; None when there is no room. Removed afterwards."""
        relpath = f"{self.tier.ns_id}/{name}"
        if not self.reserve(relpath, nbytes):
            yield None
            return
        path = self.tier.root / relpath
        try:
            yield path
        finally:
            with self.tier._lock:
                self.tier._delete_locked(self.tier._index.remove(META_PREFIX + relpath), count=False)
