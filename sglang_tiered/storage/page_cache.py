"""Whether parts of a file are in the OS page cache, without reading them: mincore(2) over a read-only mapping of
the file (mapping a file reads nothing). Linux and other systems with mincore; elsewhere None.

Not a non-blocking read (preadv2 RWF_NOWAIT): on a cold page such a read starts the kernel's readahead before it
answers EAGAIN, so it touches what it probes, and where the device answers quickly the page can be in by the time the
kernel looks again -- measured on an AMD EPYC VM (kernel 6.18, ext4): 23 of 100 files just dropped from the cache,
with mincore reporting none of their pages resident, were read "without blocking" at offset 0.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from typing import Optional

_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


_LIBC = _libc()


def resident(fd: int, offsets: Iterable[int]) -> Optional[bool]:
    """Whether the pages holding each byte offset of the open file `fd` are all in the page cache: True, False, or
    None where that cannot be told (no mincore here, an empty file, a mapping refused). Reads nothing."""
    size = os.fstat(fd).st_size
    if _LIBC is None or size == 0:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if _LIBC.mincore(addr, size, vec) != 0:
            return None
        return all(vec[min(max(o, 0), size - 1) // mmap.PAGESIZE] & 1 for o in offsets)
    finally:
        _LIBC.munmap(addr, size)
