"""Reads of stored spans begun at admission, before their forward.

A load taken at the door can wait a whole forward of other requests (the next piece of another request's chunked
prefill) before its own forward begins; its reads need not wait with it. `EarlyReader` reads the pages of loads
queued for their forward on one background thread per process, each load's last page first (the loader's order in
`engine/meet.py`: the pages compute would reach last), into memory, within one byte budget shared by every queued
load. The forward `take`s what was read -- the page in flight too, as a future -- and reads the rest itself.

Nothing here decides what is loaded: a page read early is the read the loader would make (a miss raises the same
SpanMiss, from the future, when the forward waits for it). A load whose forward never comes (an aborted request, a
re-admission, a fallback) is `drop`ped, or expires `hold_s` after its start (at the next `start`). Pages read early
wait in memory: `budget_bytes` bounds them; a page that does not fit waits for room, the others' take or drop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Optional

from sglang_tiered.engine.meet import PageSource, StoredPage


class EarlyJob:
    """One load's early reads: `source`'s pages from the last down to `lowest` (each by `read`), `page_bytes` each in
    memory."""

    def __init__(self, source: PageSource, read: Callable[[int], StoredPage], lowest: int, page_bytes: int,
                 since: float) -> None:
        self.source, self.read, self.lowest, self.page_bytes, self.since = source, read, lowest, page_bytes, since
        self.next = source.pages - 1  # the next page to read (below `lowest`: done)
        self.pages: dict[int, Future] = {}  # read or in flight
        self.stopped = False
        self.held = 0  # bytes of the budget this job holds


class EarlyReader:
    def __init__(self, budget_bytes: int, hold_s: float, clock: Callable[[], float] = time.monotonic,
                 on_expired: Callable[[int], None] = lambda n: None) -> None:
        """`on_expired(n)`: told of the `n` jobs a `start` dropped for outliving `hold_s` (called under the lock)."""
        self.budget_bytes, self.hold_s, self.clock, self.on_expired = budget_bytes, hold_s, clock, on_expired
        self.held = 0  # bytes held by every job
        self.jobs: deque[EarlyJob] = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def start(self, source: PageSource, lowest: int, page_bytes: int,
              read: Optional[Callable[[int], StoredPage]] = None) -> Optional[EarlyJob]:
        """Begin reading `source`'s pages [lowest, pages) early, the last first, by `read` (default `source.read`);
        None if there is none to read or one page would not fit the whole budget."""
        with self._cv:
            now = self.clock()
            old = [j for j in self.jobs if now - j.since > self.hold_s]
            for job in old:
                self._end(job)
            if old:
                self.on_expired(len(old))
            if lowest >= source.pages or page_bytes > self.budget_bytes:
                return None
            job = EarlyJob(source, read or source.read, max(0, lowest), page_bytes, now)
            self.jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-early-reads", daemon=True)
                self._thread.start()
            self._cv.notify_all()
            return job

    def unread_bytes(self) -> int:
        """Bytes the queued jobs have still to read (their pages not begun), in memory size."""
        with self._cv:
            return sum(max(0, j.next - j.lowest + 1) * j.page_bytes for j in self.jobs if not j.stopped)

    def take(self, job: EarlyJob) -> dict[int, Future]:
        """Stop `job` (no page begun after this) and hand over its pages, read or in flight: page -> a future of
        its `StoredPage` (raising what the read raised). Its bytes leave the budget: the forward's memory now."""
        with self._cv:
            pages = dict(job.pages)
            self._end(job)
            return pages

    def drop(self, job: EarlyJob) -> None:
        """Stop `job` and forget its pages (a load that will not be followed)."""
        with self._cv:
            self._end(job)

    def _end(self, job: EarlyJob) -> None:
        job.stopped = True
        job.pages = {}
        self.held -= job.held
        job.held = 0
        if job in self.jobs:
            self.jobs.remove(job)
        self._cv.notify_all()

    def _next(self) -> Optional[tuple[EarlyJob, int, Future]]:
        """The first queued job's next page that fits the budget, claimed (under the lock), or None."""
        for job in self.jobs:
            if not job.stopped and job.next >= job.lowest and self.held + job.page_bytes <= self.budget_bytes:
                page, future = job.next, Future()
                job.next -= 1
                job.pages[page] = future
                job.held += job.page_bytes
                self.held += job.page_bytes
                return job, page, future
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                claim = self._next()
                while claim is None:
                    self._cv.wait()
                    claim = self._next()
            job, page, future = claim
            try:
                future.set_result(job.read(page))
            except BaseException as exc:  # noqa: BLE001 -- the forward meets it when it waits for the page
                future.set_exception(exc)
                with self._cv:
                    job.stopped = True
