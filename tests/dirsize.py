"""The bytes a directory held at one instant, from the outside (for tests that check a disk bound while writers
run).

A walk is not a snapshot: a file deleted after it was counted and another created before the walk ends would both be
counted. So the directory is walked twice, and only the files (by inode) seen in both walks count, at their sizes from
the first: every such file existed at the instant the first walk ended (before its second sighting, after its first),
and files only grow while written, so the sum is at most what the directory held at that instant. A sample above a
bound is therefore a real violation, never an artefact of the walk.
"""

from __future__ import annotations

import os
from pathlib import Path


def _files(root: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for top, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue
            out[st.st_ino] = st.st_size
    return out


def sample_bytes(root: str | os.PathLike) -> int:
    """A lower bound of the bytes of the regular files under `root` at one instant during the call."""
    first = _files(Path(root))
    second = _files(Path(root))
    return sum(size for ino, size in first.items() if ino in second)
