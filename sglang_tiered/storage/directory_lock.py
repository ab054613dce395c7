"""One server per SSD directory.

The store's guarantees -- one capacity for every byte under the directory, one eviction order -- hold only while one
server owns the directory: a second one would count its own files against its own copy of the capacity and evict
the first one's as foreign. The launcher therefore claims the directory (`claim`) for as long as it lives: an
exclusive `flock` on `<dir>/server.lock`, which holds the claimant's pid. The kernel drops the lock when the process
ends, however it ends (a killed server leaves no stale claim). A second server on the same directory stops at
startup naming the first one's pid (`DirectoryInUse`). TP ranks of one server share its directory (they are the
launcher's children: the claim is the server's, not a rank's).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from sglang_tiered.storage.files import FILE_MODE

LOCK_FILE = "server.lock"


class DirectoryInUse(Exception):
    def __init__(self, root: Path, holder: str) -> None:
        super().__init__(f"{root} is in use by another server (pid {holder or '?'})")
        self.holder = holder


def holder(root: str | os.PathLike) -> str:
    """The pid written by the process that claimed `root` ("" where none did or it cannot be read)."""
    try:
        return (Path(root) / LOCK_FILE).read_text().strip()
    except OSError:
        return ""


def claim(root: str | os.PathLike) -> int:
    """Claim `root` for this process: the open descriptor that holds the lock (keep it open for as long as the
    server runs; closing it gives the directory up). Raises DirectoryInUse if another process holds it."""
    path = Path(root) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(Path(root), holder(root)) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
