"""Dropping files from the OS page cache, so that the next read of them reaches the disk (tests only)."""

from __future__ import annotations

import os


def drop_from_page_cache(*paths) -> None:
    """Sync each of `paths` and drop its pages from the page cache (posix_fadvise DONTNEED)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
