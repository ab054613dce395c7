"""The SSD tier's group files: a run of stored pages rewritten as one file in chunks with a probe (`repack`), read by
layer -- its probe, or chosen chunks -- by gated loading, and page by page (`read_pages`).
A group is committed by its rename; only then are its member pages' files removed, so a crash at any point leaves
either the old pages or the group. With a stash attached (`stash.py`) a repack takes its pages' payloads from the
copies kept at their write and reads only the others back."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sglang_tiered.storage import group_file
from sglang_tiered.storage.files import make_dir, unlink_quiet
from sglang_tiered.storage.groups import ITEMSIZE, build_group, group_bytes_bound, group_id, pages_from_group
from sglang_tiered.storage.page_file import read_page
from sglang_tiered.storage.tier_layout import GROUP_PREFIX

if TYPE_CHECKING:
    from sglang_tiered.storage.ssd_tier import PageIO, SSDTier

logger = logging.getLogger("sglang_tiered.storage.ssd_tier")


class TierGroups:
    """The group files of one SSD tier (its index, lock, statistics and committed groups' metadata)."""

    def __init__(self, tier: SSDTier) -> None:
        self.tier = tier

    def repack(self, keys: Sequence[str], probe_heads: Sequence[int], chunk: int = 16,
               probe_bits: int = group_file.PROBE_BITS, build: Callable[..., int] = build_group) -> bool:
        """Rewrite the stored plain pages `keys` (consecutive pages of one prefix, in prompt order) as one group,
        its file written by `build` (`groups.build_group`'s contract; e.g. `RepackWorker.build`, in a child
        process). True when committed; False (nothing changed) if a page is missing, unreadable or already grouped,
        the space is not there or the build failed. Blocking; call from a background thread."""
        with self.tier._lock:
            if any(self.tier._index.kind(k) != "page" or self.tier._index.writing(k) for k in keys):
                return False
        seg = self.tier.namespace.page_size * self.tier.namespace.kv_heads * self.tier.namespace.head_dim
        n_seg = 2 * self.tier.namespace.layer_num
        size = seg * ITEMSIZE.get(self.tier.namespace.dtype, 2)
        payloads = []
        for key in keys:
            payload = self.tier.stash.take(key) if self.tier.stash is not None else None
            if payload is not None and len(payload) == n_seg * size:
                self.tier.stats.add(repack_pages_kept=1)
                payloads.append(payload)
                continue
            bufs = [memoryview(bytearray(size)) for _ in range(n_seg)]
            n = self.tier._serve(key, lambda path, key=key, bufs=bufs: read_page(str(path), self.tier.ns_id, key, bufs))
            if n is None:
                return False
            self.tier.stats.add(repack_pages_read=1, repack_bytes_read=n)
            payloads.append(b"".join(bufs))
        ns = self.tier.namespace
        gid = group_id(keys)
        entry = GROUP_PREFIX + gid
        path = self.tier._path(entry)
        estimate = group_bytes_bound(ns, keys, sum(len(p) for p in payloads), probe_heads, chunk, probe_bits)
        with self.tier._lock:
            res = self.tier._index.reserve(entry, estimate, "group", keep=keys)
            self.tier._delete_locked(res.victims)
        if not res.admitted:
            return False
        try:
            make_dir(path.parent)
            written = build(str(path), ns, keys, payloads, probe_heads, chunk, probe_bits)
            fd = os.open(path, os.O_RDONLY)
            try:
                committed = group_file.read_meta(fd)
            finally:
                os.close(fd)
        except (OSError, ValueError, group_file.GroupError) as exc:
            logger.warning("tiered ssd: repack of %d pages failed: %s", len(keys), exc)
            with self.tier._lock:
                self.tier._index.abort(entry)
            unlink_quiet(path)
            self.tier.stats.add(io_errors=1)
            return False
        with self.tier._lock:
            self.tier._groups[gid] = committed
            self.tier._delete_locked(self.tier._index.commit_group(entry, written, keys), count=False)
        self.tier.stats.add(repacked_groups=1, repacked_pages=len(keys), bytes_written=written)
        self.tier._publish_gauges()
        return True

    def read_probe(self, gid: str, layer: int):
        """The group's probe of one layer (`group_file.read_probe`'s keys and scales) or None on a miss."""
        return self._io(gid, lambda fd, meta: group_file.read_probe(fd, meta, layer))

    def read_chunks(self, gid: str, layer: int, chunks: Sequence[int]):
        """{chunk: (K bytes, V bytes)} of one layer of the group, or None on a miss."""
        return self._io(gid, lambda fd, meta: group_file.read_chunks(fd, meta, layer, chunks))

    def _io(self, gid: str, fn):
        with self.tier._lock:
            meta = self.tier._groups.get(gid)
        if meta is None:
            return None
        entry = GROUP_PREFIX + gid
        path = self.tier._path(entry)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.tier._forget(entry)
            self.tier.stats.add(lost_pages=len(meta.keys))
            return None
        t0 = time.perf_counter()
        try:
            with contextlib.suppress(OSError):  # advice only: no readahead, a sparse load reads chosen chunks
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            out = fn(fd, meta)
        except group_file.GroupError as exc:
            logger.warning("tiered ssd: corrupt group %s (%s): removed, recomputing", gid, exc)
            self.tier._forget(entry)
            self.tier.stats.add(corrupt_pages=len(meta.keys))
            return None
        except OSError as exc:
            logger.warning("tiered ssd: read error on group %s: %s", gid, exc)
            self.tier.stats.add(io_errors=1)
            return None
        finally:
            os.close(fd)
        nbytes = sum(len(b) for pair in out.values() for b in pair) if isinstance(out, dict) else \
            sum(a.nbytes for a in out)
        with self.tier._lock:
            self.tier._index.touch(entry)
        self.tier.stats.add(group_reads=1, bytes_read=nbytes, read_seconds=time.perf_counter() - t0)
        return out

    def read_pages(self, gid: str, pages: Sequence[PageIO]) -> list[bool]:
        with self.tier._lock:
            meta = self.tier._groups.get(gid)
        if meta is None:
            self.tier.stats.add(miss_pages=len(pages))
            return [False] * len(pages)
        layers = []
        for layer in range(meta.layers):
            chunks = self.read_chunks(gid, layer, range(meta.chunks))
            if chunks is None:
                self.tier.stats.add(miss_pages=len(pages))
                return [False] * len(pages)
            layers.append(chunks)
        wanted = [meta.keys.index(key) for key, _ in pages]
        for (_, segments), payload in zip(pages, pages_from_group(meta, layers, wanted)):
            view, pos = memoryview(payload), 0
            for seg in segments:
                flat = seg.cast("B") if seg.format != "B" or seg.ndim != 1 else seg
                flat[:] = view[pos : pos + flat.nbytes]
                pos += flat.nbytes
        self.tier.stats.add(hit_pages=len(pages))
        return [True] * len(pages)
