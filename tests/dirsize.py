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
import threading
import time
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


class Sampler:
    """Samples a directory's size from outside while servers write into it (`sample_bytes`, every 20 ms)."""

    def __init__(self, root: Path) -> None:
        self.root, self.samples = root, [0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.root.exists():
                self.samples.append(sample_bytes(self.root))
            time.sleep(0.02)

    def stop(self) -> int:
        """Stop sampling; the largest sample."""
        self._stop.set()
        self._thread.join()
        return max(self.samples)
