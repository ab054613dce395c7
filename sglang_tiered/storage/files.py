"""File helpers every writer under the SSD directory uses: directories 0700, files 0600 (a KV page is a tenant's
prompt in another form), whole files replaced atomically."""

from __future__ import annotations

import os
import threading
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_dir(path: str | os.PathLike) -> None:
    """Create `path` and missing parents with mode 0700 (existing directories are left as they are)."""
    Path(path).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` (temporary file + rename, mode 0600). Raises OSError after removing the
    temporary file."""
    path = Path(path)
    make_dir(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise


def unlink_quiet(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
