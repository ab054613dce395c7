"""Where the SSD tier keeps each kind of entry: the index's key prefixes, the fixed file names, and the path of an
entry (`entry_path`). Pure: no I/O."""

from __future__ import annotations

from pathlib import Path

from sglang_tiered.storage import group_file
from sglang_tiered.storage.directory_lock import LOCK_FILE
from sglang_tiered.storage.page_file import PAGE_SUFFIX

CHUNK_PREFIX = "c."  # chunk entries: "c.<hash>"
GROUP_PREFIX = "g."  # group entries: "g.<gid>"
META_PREFIX = "m:"  # meta entries: "m:<path relative to the root>"
FOREIGN_PREFIX = "f:"  # foreign files: "f:<path relative to the root>"
NAMESPACE_FILE = "NAMESPACE.json"
PROFILE_FILE = "kvpr-profile.json"  # the compute-or-load profile (engine/kvpr_profile.py)
DTYPE_FILE = "cpu-dtype.json"  # the launcher's `--dtype auto` choice, kept for restarts (integration/server_flags.py)
ROOT_FILES = (PROFILE_FILE, DTYPE_FILE, LOCK_FILE)  # the whole server's, counted as meta
NAMESPACE_META = (NAMESPACE_FILE, PROFILE_FILE)  # meta files in a namespace's directory


def page_path(directory: Path, key: str) -> Path:
    """Where the plain page (or activation page) `key` of the namespace at `directory` is stored."""
    return directory / key[:2] / f"{key}{PAGE_SUFFIX}"


def entry_path(root: Path, directory: Path, key: str) -> Path:
    """The file of index entry `key` of the namespace at `directory` under `root`. Raises ValueError for a key that
    would leave the root."""
    if key.startswith((META_PREFIX, FOREIGN_PREFIX)):
        rel = key[2:]
        if not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError(f"unsafe path {key!r}")
        return root / rel
    if not key or "/" in key or key.startswith("."):
        raise ValueError(f"unsafe page key {key!r}")
    if key.startswith(GROUP_PREFIX):
        return directory / "groups" / f"{key[len(GROUP_PREFIX):]}{group_file.GROUP_SUFFIX}"
    if key.startswith(CHUNK_PREFIX):
        return directory / "chunks" / f"{key[len(CHUNK_PREFIX):]}{PAGE_SUFFIX}"
    return page_path(directory, key)
