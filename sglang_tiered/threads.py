"""Worker threads whose torch ops run on one OpenMP thread each, without changing anyone else's count.

The loaders (engine/layer_loader.py, engine/meet.py) read and copy on a thread of their own while the caller's layers
compute on all cores; a loader with an OpenMP team of its own would spin on those cores. `torch.set_num_threads(1)` on
the worker is the fix, but torch also stores that count as the process default that threads created later start with.
`one_thread_pool` sets 1 on each of its workers (after torch's per-thread first use there, which would otherwise copy
the process default in later), all of them started before it returns, and then sets the caller's own count again,
which restores the default and leaves the workers at 1. `one_thread_daemon` does the same for one long-lived thread.

Background work that no request waits for (the repacker) also runs at the lowest CPU priority (`nice=19`; Linux
sets it per thread): it then takes only the cycles the model forward leaves. A 2-core check (bf16 2,048-square
matmuls on the main thread, quantization on a background thread): the matmuls slowed by 80 % beside a two-thread
background, by 17 % at nice 19, and not measurably at nice 19 on one thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)


def one_thread_pool(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A pool of `workers` threads, each running torch on one thread; the caller's count and the process default are
    as before. The caller shuts the pool down (`shutdown` or a `with` block)."""
    caller = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
    started = threading.Barrier(workers)  # every worker is started (a pool starts them lazily, one per busy task)
    for job in [pool.submit(_one, started.wait) for _ in range(workers)]:
        job.result()  # each worker's count is 1 from now on
    torch.set_num_threads(caller)  # the process default again (the workers keep their own)
    return pool


def one_thread_daemon(name: str, target: Callable[[], object], nice: int = 0) -> threading.Thread:
    """A started daemon thread running `target()` with torch on one thread at CPU niceness `nice` (0 = the caller's
    priority, 19 = the lowest; left as it is where the platform has no per-thread priority); the caller's count and
    the process default are as before."""
    caller = torch.get_num_threads()
    ready = threading.Event()

    def run() -> None:
        _one(ready.set, nice)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    torch.set_num_threads(caller)
    return thread


def _one(started: Callable[[], object], nice: int = 0) -> None:
    torch.get_num_threads()  # torch's per-thread first use: it would later reset this thread to the process default
    torch.set_num_threads(1)
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError) as exc:  # no per-thread priority here: the thread runs at the caller's
            logger.info("thread %s keeps its priority: %s", threading.current_thread().name, exc)
    started()
