"""On-disk format of one KV page: a small header, msgpack metadata, then the raw page bytes.

Layout (all integers little-endian)::

    magic  b"SGTKV\\x00\\x01\\x00"    8 bytes
    meta_len                       u32
    meta_crc32                     u32    crc32 of the msgpack bytes
    meta                           msgpack {"ns": str, "key": str, "nbytes": int, "crc32": int}
    payload                        `nbytes` bytes, the page's segments concatenated in order

A page is written to a temporary name and renamed into place, so it becomes visible only when complete. The
payload checksum is verified on every read, so a page torn by a crash or power loss (rename without fsync) reads as
corrupt, never as data. `read_page`/`write_page` move bytes directly between the file and caller-owned buffers
(`os.preadv`/`os.pwritev`), so the host KV pool is the I/O buffer (zero copy).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

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
    crc32: int


def checksum(segments: Sequence[memoryview]) -> int:
    """crc32 over the concatenation of `segments`."""
    crc = 0
    for seg in segments:
        crc = zlib.crc32(seg, crc)
    return crc


def encode_header(namespace: str, key: str, segments: Sequence[memoryview]) -> bytes:
    nbytes = sum(seg.nbytes for seg in segments)
    meta = msgpack.packb({"ns": namespace, "key": key, "nbytes": nbytes, "crc32": checksum(segments)})
    return _FIXED.pack(MAGIC, len(meta), zlib.crc32(meta)) + meta


def write_page(path: str, namespace: str, key: str, segments: Sequence[memoryview]) -> int:
    """Write a page atomically (temp file + rename). Returns bytes written, header included.

    Raises OSError (disk full, permissions, ...) after removing the temporary file.
    """
    header = encode_header(namespace, key, segments)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = len(header) + sum(seg.nbytes for seg in segments)
        written = _vectored_all(os.pwritev, fd, [memoryview(header), *segments], 0)
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


def read_header(fd: int, file_size: int) -> tuple[PageHeader, int]:
    """Parse and validate the header. Returns (header, payload offset)."""
    fixed = os.pread(fd, _FIXED.size, 0)
    if len(fixed) != _FIXED.size:
        raise CorruptPage("truncated header")
    magic, meta_len, meta_crc = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if meta_len > 4096:
        raise CorruptPage("implausible metadata length")
    meta_bytes = os.pread(fd, meta_len, _FIXED.size)
    if len(meta_bytes) != meta_len or zlib.crc32(meta_bytes) != meta_crc:
        raise CorruptPage("metadata checksum mismatch")
    try:
        meta = msgpack.unpackb(meta_bytes)
        header = PageHeader(str(meta["ns"]), str(meta["key"]), int(meta["nbytes"]), int(meta["crc32"]))
    except Exception as exc:  # malformed msgpack with a colliding crc: treat as corrupt
        raise CorruptPage(f"bad metadata: {exc}") from exc
    offset = _FIXED.size + meta_len
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
        expected = sum(seg.nbytes for seg in segments)
        if header.namespace != namespace or header.key != key or header.nbytes != expected:
            raise ForeignPage(
                f"page {path} is ns={header.namespace} key={header.key} nbytes={header.nbytes}, "
                f"expected ns={namespace} key={key} nbytes={expected}"
            )
        got = _vectored_all(os.preadv, fd, list(segments), offset)
    finally:
        os.close(fd)
    if got != expected:
        raise CorruptPage(f"short read {got} of {expected}")
    if checksum(segments) != header.crc32:
        raise CorruptPage("payload checksum mismatch")
    return expected


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
