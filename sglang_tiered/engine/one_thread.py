"""Worker threads whose torch ops run on one OpenMP thread each, without changing anyone else's count.

The loaders (engine/layer_loader.py, engine/meet.py) read and copy on a thread of their own while the caller's layers
compute on all cores; a loader with an OpenMP team of its own would spin on those cores. `torch.set_num_threads(1)` on
the worker is the fix, but torch also stores that count as the process default that threads created later start with.
`one_thread_pool` sets 1 on each of its workers (after torch's per-thread first use there, which would otherwise copy
the process default in later), all of them started before it returns, and then sets the caller's own count again,
which restores the default and leaves the workers at 1.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch


def one_thread_pool(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A pool of `workers` threads, each running torch on one thread; the caller's count and the process default are
    as before. The caller shuts the pool down (`shutdown` or a `with` block)."""
    caller = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
    started = threading.Barrier(workers)  # every worker is started (a pool starts them lazily, one per busy task)
    for job in [pool.submit(_one, started) for _ in range(workers)]:
        job.result()  # each worker's count is 1 from now on
    torch.set_num_threads(caller)  # the process default again (the workers keep their own)
    return pool


def _one(started: threading.Barrier) -> None:
    torch.get_num_threads()  # torch's per-thread first use: it would later reset this thread to the process default
    torch.set_num_threads(1)
    started.wait()
