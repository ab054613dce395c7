"""Run a function on N local ranks, each a spawned process in its own process group, joined by a gloo group on
127.0.0.1. Used by tests, `sglang-tiered runahead-tune` and the benchmark.

`run_ranks(world, target, args)` calls `target(rank, world, *args)` in every rank after the process group is up and
returns the list of return values (rank order). If a rank raises, exits, or the whole run exceeds `timeout_s`, every
rank's process group is killed and RuntimeError/TimeoutError is raised: nothing outlives the call.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, threads: int, pg_timeout_s: float, target: Callable,
               args: Sequence[Any], results: Any) -> None:
    os.setsid()  # own process group: the parent can kill this rank and anything it starts
    try:
        torch.set_num_threads(threads)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world, timeout=timedelta(seconds=pg_timeout_s))
        try:
            # by value: torch's queue pickler would pass tensors as shared memory owned by this (exiting) process
            results.put((rank, "ok", pickle.dumps(target(rank, world, *args))))
        finally:
            torch.distributed.destroy_process_group()
    except BaseException:  # report every failure, including a peer's death seen as a gloo error
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, target: Callable, args: Sequence[Any] = (), *, threads: int = 1,
              timeout_s: float = 300.0, pg_timeout_s: float = 60.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, threads, pg_timeout_s, target, tuple(args), results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty as empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s} s") from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    codes = [procs[r].exitcode for r in dead]
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {codes})") from empty
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            if p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            p.join(timeout=10)
