"""On-disk format of one KV page: a small header, msgpack metadata, then the raw page bytes.

Layout (all integers little-endian)::

    magic  b"SGTKV\\x00\\x01\\x00"    8 bytes
    meta_len                       u32
    meta_crc32                     u32    crc32 of the msgpack bytes
    meta                           msgpack {"ns": str, "key": str, "nbytes": int, "crc32": None,
                                            "segs": [segment bytes, ...], "seg_crc": [crc32 of each segment, ...]}
    payload                        `nbytes` bytes, the page's segments concatenated in order

A page is written to a temporary name and renamed into place, so it becomes visible only when complete. Every
segment has its own checksum (pages written before per-segment checksums have one "crc32" over the whole payload),
verified on every read, so a page torn by a crash or power loss (rename without fsync) reads as corrupt, never as
data. `read_page`/`write_page` move bytes directly between the file and caller-owned buffers
(`os.preadv`/`os.pwritev`), so the host KV pool is the I/O buffer (zero copy).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import msgpack

from sglang_tiered.storage.checksum import crc32

MAGIC = b"SGTKV\x00\x01\x00"
_FIXED = struct.Struct("<8sII")
PAGE_SUFFIX = ".kvp"
TMP_SUFFIX = ".tmp"


class PageError(Exception):
    """Base class: the page cannot be served."""


class CorruptPage(PageError):
    """Torn, truncated or bit-flipped page (bad magic, short file, checksum mismatch)."""


class ForeignPage(PageError):
    """A well-formed page written under another namespace, key or page size."""


@dataclass(frozen=True)
class PageHeader:
    namespace: str
    key: str
    nbytes: int
    crc32: Optional[int]  # whole payload (pages written before per-segment checksums), else None
    segs: tuple[int, ...] = ()  # bytes of each segment
    seg_crc: tuple[int, ...] = ()  # crc32 of each segment

    def segment_offsets(self) -> list[int]:
        """Byte offset of each segment within the payload."""
        out, pos = [], 0
        for n in self.segs:
            out.append(pos)
            pos += n
        return out


def checksum(segments: Sequence[memoryview]) -> int:
    """crc32 over the concatenation of `segments`."""
    crc = 0
    for seg in segments:
        crc = crc32(seg, crc)
    return crc


def encode_header(namespace: str, key: str, segments: Sequence[memoryview]) -> bytes:
    nbytes = sum(seg.nbytes for seg in segments)
    meta = msgpack.packb({"ns": namespace, "key": key, "nbytes": nbytes, "crc32": None,
                          "segs": [seg.nbytes for seg in segments], "seg_crc": [crc32(seg) for seg in segments]})
    return _FIXED.pack(MAGIC, len(meta), crc32(meta)) + meta


def header_bound(namespace: str, key: str, segment_bytes: Sequence[int]) -> int:
    """An upper bound of the header's size for a page with these segments (before their checksums are known)."""
    meta = msgpack.packb({"ns": namespace, "key": key, "nbytes": 2**62, "crc32": None,
                          "segs": [2**62] * len(segment_bytes), "seg_crc": [2**32 - 1] * len(segment_bytes)})
    return _FIXED.size + len(meta)


def write_page(path: str, namespace: str, key: str, segments: Sequence[memoryview]) -> int:
    """Write a page atomically (temp file + rename). Returns bytes written, header included.

    Raises OSError (disk full, permissions, ...) after removing the temporary file.
    """
    return write_file(path, [memoryview(encode_header(namespace, key, segments)), *segments])


def write_file(path: str, parts: Sequence[memoryview]) -> int:
    """Write the concatenation of `parts` to `path` atomically (temp file + rename): a whole page file, or one
    obtained elsewhere (a shared store). Returns bytes written; raises OSError after removing the temporary file."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        total = sum(p.nbytes for p in parts)
        written = _vectored_all(os.pwritev, fd, list(parts), 0)
        if written != total:
            raise OSError(f"short write to {tmp}: {written} of {total} bytes")
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return total


Source = Union[int, bytes, memoryview]  # an open file descriptor, or a whole file's bytes held in memory


def _pread(source, n: int, offset: int) -> bytes:
    if isinstance(source, int):
        return os.pread(source, n, offset)
    return bytes(source[offset : offset + n])


def read_meta_block(source: Source, magic: bytes, max_len: int, error: type[Exception]) -> tuple[dict, int]:
    """The msgpack metadata after a file's fixed header (`magic`, length, crc32), verified; (metadata, offset of what
    follows it). `source`: a file descriptor or the file's bytes. Raises `error` for a truncated, foreign or corrupt
    header."""
    fixed = _pread(source, _FIXED.size, 0)
    if len(fixed) != _FIXED.size:
        raise error("truncated header")
    found, meta_len, meta_crc = _FIXED.unpack(fixed)
    if found != magic:
        raise error("bad magic")
    if meta_len > max_len:
        raise error("implausible metadata length")
    blob = _pread(source, meta_len, _FIXED.size)
    if len(blob) != meta_len or crc32(blob) != meta_crc:
        raise error("metadata checksum mismatch")
    try:
        meta = msgpack.unpackb(blob)
    except Exception as exc:  # malformed msgpack with a colliding crc: treat as corrupt
        raise error(f"bad metadata: {exc}") from exc
    if not isinstance(meta, dict):
        raise error("bad metadata")
    return meta, _FIXED.size + meta_len


def read_header(source: Source, file_size: int) -> tuple[PageHeader, int]:
    """Parse and validate the header of a page file (descriptor or bytes). Returns (header, payload offset)."""
    meta, offset = read_meta_block(source, MAGIC, 65536, CorruptPage)
    try:
        crc = meta.get("crc32")
        header = PageHeader(str(meta["ns"]), str(meta["key"]), int(meta["nbytes"]), None if crc is None else int(crc),
                            tuple(int(n) for n in meta.get("segs", ())), tuple(int(c) for c in meta.get("seg_crc", ())))
    except Exception as exc:  # malformed msgpack with a colliding crc: treat as corrupt
        raise CorruptPage(f"bad metadata: {exc}") from exc
    if header.crc32 is None and (len(header.segs) != len(header.seg_crc) or sum(header.segs) != header.nbytes):
        raise CorruptPage("segment table does not add up")
    if file_size != offset + header.nbytes:
        raise CorruptPage(f"size {file_size} != {offset + header.nbytes}")
    return header, offset


def read_page(path: str, namespace: str, key: str, segments: Sequence[memoryview]) -> int:
    """Read a page into `segments` (filled in order). Returns payload bytes read.

    Raises FileNotFoundError, CorruptPage or ForeignPage. On an error the buffers may hold partial data; the caller
    must treat them as garbage.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        header, offset = read_header(fd, os.fstat(fd).st_size)
        expected = _check_identity(header, path, namespace, key, segments)
        got = _vectored_all(os.preadv, fd, list(segments), offset)
    finally:
        os.close(fd)
    if got != expected:
        raise CorruptPage(f"short read {got} of {expected}")
    _verify_payload(header, segments)
    return expected


def read_blob(blob: bytes | memoryview, namespace: str, key: str, segments: Sequence[memoryview]) -> int:
    """`read_page` for a page file held in memory (e.g. fetched from a shared store): the same checks, the payload
    copied into `segments`. Returns payload bytes. Raises CorruptPage or ForeignPage."""
    view = memoryview(blob).cast("B")
    header, offset = read_header(view, view.nbytes)
    expected = _check_identity(header, "(in memory)", namespace, key, segments)
    pos = offset
    for seg in segments:
        flat = seg.cast("B") if seg.format != "B" or seg.ndim != 1 else seg
        flat[:] = view[pos : pos + flat.nbytes]
        pos += flat.nbytes
    _verify_payload(header, segments)
    return expected


def _check_identity(header: PageHeader, where: str, namespace: str, key: str, segments: Sequence[memoryview]) -> int:
    """The payload size the caller's buffers expect; ForeignPage if the header names another page."""
    expected = sum(seg.nbytes for seg in segments)
    if header.namespace != namespace or header.key != key or header.nbytes != expected:
        raise ForeignPage(f"page {where} is ns={header.namespace} key={header.key} nbytes={header.nbytes}, "
                          f"expected ns={namespace} key={key} nbytes={expected}")
    return expected


def _verify_payload(header: PageHeader, segments: Sequence[memoryview]) -> None:
    if header.crc32 is not None:
        if checksum(segments) != header.crc32:
            raise CorruptPage("payload checksum mismatch")
    else:
        _verify(header, list(range(len(header.segs))), _split(segments, header.segs))


class PageReader:
    """Random access to the segments of one page file: the header is read and checked once (namespace, key,
    segment sizes), then `read(first, count)` returns segments first .. first + count - 1, each verified against
    its own checksum. Raises FileNotFoundError, CorruptPage or ForeignPage (and CorruptPage for a page written
    before per-segment checksums, which cannot be verified piecewise)."""

    def __init__(self, path: str, namespace: str, key: str, segment_bytes: Sequence[int]) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.header, self.offset = read_header(self.fd, os.fstat(self.fd).st_size)
            h = self.header
            if h.namespace != namespace or h.key != key or list(h.segs) != list(segment_bytes):
                raise ForeignPage(f"page {path} is ns={h.namespace} key={h.key} segs={len(h.segs)}, expected "
                                  f"ns={namespace} key={key} segs={len(segment_bytes)}")
            if h.crc32 is not None:
                raise CorruptPage("page has no per-segment checksums")
            self._starts = h.segment_offsets()
        except BaseException:
            os.close(self.fd)
            raise

    def read(self, first: int, count: int) -> list[bytearray]:
        """Segments [first, first + count), verified. Raises CorruptPage (short read, checksum mismatch)."""
        segs = self.header.segs
        if first < 0 or count < 1 or first + count > len(segs):
            raise ValueError(f"segments {first}..{first + count} of {len(segs)}")
        bufs = [bytearray(n) for n in segs[first : first + count]]
        got = _vectored_all(os.preadv, self.fd, [memoryview(b) for b in bufs], self.offset + self._starts[first])
        if got != sum(segs[first : first + count]):
            raise CorruptPage(f"short read {got} of segments {first}..{first + count}")
        _verify(self.header, range(first, first + count), [memoryview(b) for b in bufs])
        return bufs

    def close(self) -> None:
        os.close(self.fd)


def _split(segments: Sequence[memoryview], sizes: Sequence[int]) -> list[memoryview]:
    """The caller's buffers cut at the page's segment boundaries (they may be laid out differently)."""
    flat = [memoryview(s).cast("B") if s.format != "B" or s.ndim != 1 else s for s in segments]
    if [b.nbytes for b in flat] == list(sizes):
        return flat
    joined = memoryview(b"".join(bytes(b) for b in flat))
    out, pos = [], 0
    for n in sizes:
        out.append(joined[pos : pos + n])
        pos += n
    return out


def _verify(header: PageHeader, indices: Sequence[int], bufs: Sequence[memoryview]) -> None:
    for i, buf in zip(indices, bufs):
        if crc32(buf) != header.seg_crc[i]:
            raise CorruptPage(f"segment {i} checksum mismatch")


def _vectored_all(op, fd: int, bufs: list[memoryview], offset: int) -> int:
    """Run `op` (os.preadv or os.pwritev) until every buffer is done or it returns 0 (end of file); at most IOV_MAX
    buffers per call. Returns the bytes moved."""
    done = 0
    pending = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in bufs]
    while pending:
        n = op(fd, pending[:1024], offset)
        if n == 0:
            break
        done += n
        offset += n
        pending = _advance(pending, n)
    return done


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    while bufs and n >= bufs[0].nbytes:
        n -= bufs[0].nbytes
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
