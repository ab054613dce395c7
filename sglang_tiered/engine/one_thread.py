"""A worker thread whose torch ops run on one OpenMP thread, without changing anyone else's count.

The loaders (engine/layer_loader.py, engine/meet.py) read and copy on a thread of their own while the caller's layers
compute on all cores; a loader with an OpenMP team of its own would spin on those cores. `torch.set_num_threads(1)` on
the worker is the fix, but torch also stores that count as the process default that threads created later start with.
`one_thread_pool` sets 1 on its worker (after torch's per-thread first use there, which would otherwise copy the
process default in later) and then sets the caller's own count again, which restores the default and leaves the
worker at 1.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def one_thread_pool(name: str) -> ThreadPoolExecutor:
    """A one-worker pool whose worker runs torch on one thread; the caller's count and the process default are as
    before. The caller shuts the pool down (`shutdown` or a `with` block)."""
    caller = torch.get_num_threads()
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    pool.submit(_one).result()  # starts the worker; its count is 1 from now on
    torch.set_num_threads(caller)  # the process default again (the worker keeps its own)
    return pool


def _one() -> None:
    torch.get_num_threads()  # torch's per-thread first use: it would later reset this thread to the process default
    torch.set_num_threads(1)
