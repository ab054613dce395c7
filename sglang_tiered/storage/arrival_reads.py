"""Reads of a request's stored pages into the OS page cache from the request's arrival, before a scheduler sees it.

A scheduler busy in a forward receives no request until that forward ends -- seconds on a CPU behind another
request's prefill -- so the reads a loader begins at admission (engine/early_reads.py) and SGLang's own prefetch
begin only then. The launcher sees the request first: `ArrivalReads` reads the files of its stored pages on one
background thread, the last page first (the two-sided loader's order, engine/meet.py: the pages compute would reach
last), through one buffer, so that they are in the page cache when the scheduler reads them. Jobs run in the order
they were started (the scheduler's, first come first served).

Contract: reads only -- nothing is written, kept in this process's memory (one buffer), counted against the SSD
capacity or decided for the scheduler. A job stops before its next file once its `stop()` says so (its request was
answered or ended), skips a file that is gone (evicted or replaced meanwhile; counted `missing`) and reports once,
through `on_done`, when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

BUFFER_BYTES = 1 << 20  # one read at a time, through this buffer


@dataclass(frozen=True)
class ArrivalRead:
    """What one job read (`ArrivalReads.start`)."""

    name: str  # whose pages: a request id
    files: int  # files read to their end
    nbytes: int  # bytes read
    seconds: float  # from the job's first read to its end
    left: int  # files not read: the job was stopped before them
    missing: int  # files gone when their turn came


@dataclass
class _Job:
    name: str
    paths: Sequence[Path]  # front to back: read from the last
    stop: Callable[[], bool]


class ArrivalReads:
    """One background thread reading the jobs' files, the last of each first."""

    def __init__(self, on_done: Callable[[ArrivalRead], None] = lambda read: None,
                 buffer_bytes: int = BUFFER_BYTES) -> None:
        """`on_done(read)`: told of each job as it ends (on the reading thread)."""
        self.on_done = on_done
        self._buffer = bytearray(buffer_bytes)
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def start(self, name: str, paths: Sequence[Path], stop: Callable[[], bool]) -> None:
        """Queue reading `paths` (front to back; read back to front) for `name`, until `stop()` is true."""
        with self._cv:
            self._jobs.append(_Job(name, list(paths), stop))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-arrival-reads", daemon=True)
                self._thread.start()
            self._cv.notify()

    def queued(self) -> int:
        """Jobs not begun yet."""
        with self._cv:
            return len(self._jobs)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
            try:
                self.on_done(self._read(job))
            except Exception:  # noqa: BLE001 -- a bad job must not end the thread: the next request's reads need it
                logger.exception("tiered arrival reads: job %s failed", job.name)

    def _read(self, job: _Job) -> ArrivalRead:
        files = nbytes = missing = 0
        t0 = time.perf_counter()
        view = memoryview(self._buffer)
        for done, path in enumerate(reversed(job.paths)):
            if job.stop():
                return ArrivalRead(job.name, files, nbytes, time.perf_counter() - t0, len(job.paths) - done, missing)
            try:
                with open(path, "rb", buffering=0) as f:
                    while n := f.readinto(view):
                        nbytes += n
            except FileNotFoundError:
                missing += 1
                continue
            files += 1
        return ArrivalRead(job.name, files, nbytes, time.perf_counter() - t0, 0, missing)
