"""A long-lived KV-Runahead chain: this process is the last rank, `world - 1` helper processes are the others.

Used by the server (integration/runahead.py): the scheduler process owns the KV cache, so it is the last rank of
the chain (the one that ends up with the full KV and the first-token logits); the helpers compute the earlier
slices. Each helper is `python -m sglang_tiered.engine.runahead_ranks` with the full weights loaded once (the memory
cost: one model copy per rank, unlike tensor parallelism's 1/N), `threads` torch threads, in the caller's process
group (so killing the server's group kills them); an idle helper exits when its control connection closes (the
caller stopped or died), a busy one when the chain breaks.

Lifecycle and contracts:
* `start()` spawns the helpers, accepts their control connections, builds a gloo group that is *not* the default
  group (SGLang owns that one) and waits until every helper has loaded its model. Blocking; call it from a thread.
* `prefill(ids, bounds, prefix_kv)` sends each helper its job (token ids and bounds, a few KB over the control
  connection), runs this rank's slice of `runahead_prefill` and returns its result. Per-layer pipelining is the
  chain's own: this rank starts layer l as soon as layer l's KV arrives.
* Any failure (a helper died, stalled past `timeout_s`, reported an error, or the group broke) raises RunaheadError
  and leaves the chain stopped: every helper is killed, the group dropped. `start()` may be called again.
  A chain never hangs the caller for longer than about `timeout_s` per wait.
* One job at a time (the scheduler thread); not thread-safe beyond `start()` running in another thread while the
  caller checks `ready`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch
import torch.distributed as dist

from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.engine.parallel_prefill import ParallelResult, RunaheadError, runahead_prefill
from sglang_tiered.engine.tuning import ModelSpec, load_model

logger = logging.getLogger("sglang_tiered")

class RunaheadRanks:
    def __init__(self, model: LlamaModel, spec: ModelSpec, world: int, *, threads: int = 1,
                 timeout_s: float = 30.0, start_timeout_s: float = 300.0) -> None:
        if world < 2:
            raise ValueError(f"a chain needs at least 2 ranks, got {world}")
        self.model, self.spec, self.world = model, spec, world
        self.threads, self.timeout_s, self.start_timeout_s = threads, timeout_s, start_timeout_s
        self.ready = False
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._pg: Any = None
        self._job = 0

    @property
    def helper_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Spawn and connect the helpers; raises RunaheadError (everything stopped) if they are not up in time."""
        self.stop()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            store = dist.TCPStore("127.0.0.1", 0, self.world, True, timeout=timedelta(seconds=self.start_timeout_s),
                                  wait_for_workers=False)
            settings = {"world": self.world, "store_port": store.port, "spec": self.spec,
                        "dtype": str(self.model.dtype).removeprefix("torch."), "threads": self.threads,
                        "timeout_s": self.timeout_s}
            for rank in range(self.world - 1):
                mine, theirs = socket.socketpair()
                cmd = [sys.executable, "-m", "sglang_tiered.engine.runahead_ranks",
                       json.dumps(dict(settings, rank=rank, control_fd=theirs.fileno()))]
                self._procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()]))
                theirs.close()
                self._conns.append(Connection(mine.detach()))
            for rank, conn in enumerate(self._conns):  # each helper loads its model, then joins the group
                msg = self._recv(conn, rank, deadline - time.monotonic())
                if msg[0] != "loaded":
                    raise RunaheadError(f"helper rank {rank} failed to start:\n{msg[1]}")
            for conn in self._conns:
                conn.send("join")
            self._pg = dist.ProcessGroupGloo(store, self.world - 1, self.world, timedelta(seconds=self.timeout_s))
            for rank, conn in enumerate(self._conns):
                msg = self._recv(conn, rank, self.timeout_s)
                if msg[0] != "ready":
                    raise RunaheadError(f"helper rank {rank} failed to join the group:\n{msg[1]}")
        except RunaheadError:
            self.stop()
            raise
        except Exception as exc:  # the store or the group could not be built
            codes = [p.poll() for p in self._procs]
            self.stop()
            raise RunaheadError(f"chain ranks did not start: {exc!r}; helper exit codes {codes}") from exc
        self.ready = True
        logger.info("tiered runahead: %d chain ranks ready (helper pids %s, %d threads each)", self.world,
                    self.helper_pids, self.threads)

    def stop(self) -> None:
        """Kill every helper and drop the group (idempotent)."""
        self.ready = False
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs, self._conns, self._pg = [], [], None

    def _recv(self, conn: Connection, rank: int, timeout_s: float) -> tuple:
        if not conn.poll(max(0.0, timeout_s)):
            raise RunaheadError(f"helper rank {rank} did not answer within {timeout_s:.1f} s")
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise RunaheadError(f"helper rank {rank} is gone (exit code {self._procs[rank].poll()})") from exc

    # ------------------------------------------------------------------------------------------ one prefill
    def prefill(self, ids: torch.Tensor, bounds: Sequence[int],
                prefix_kv: Optional[Callable[[int], torch.Tensor]] = None) -> ParallelResult:
        """This rank's part of one chained prefill (see `runahead_prefill`): logits, full KV and last hidden state;
        `bytes_sent` is summed over all ranks. RunaheadError stops the chain."""
        if not self.ready:
            raise RunaheadError("the chain ranks are not running")
        self._job += 1
        try:
            job = ("job", self._job, ids.tolist(), list(bounds))
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send(job)
                except OSError as exc:
                    raise RunaheadError(f"helper rank {rank} is gone: {exc}") from exc
            result = runahead_prefill(self.model, ids, bounds, self._pg, prefix_kv=prefix_kv, timeout_s=self.timeout_s)
            for rank, conn in enumerate(self._conns):  # every helper reports the job done before the next one
                msg = self._recv(conn, rank, self.timeout_s)
                if msg[0] != "done" or msg[1] != self._job:
                    raise RunaheadError(f"helper rank {rank}: {msg}")
                result.bytes_sent += msg[2]
            return result
        except BaseException:
            self.stop()
            raise


# ---------------------------------------------------------------------------------------------- helper process
def helper_main(settings: dict) -> int:
    rank, world = settings["rank"], settings["world"]
    torch.set_num_threads(settings["threads"])
    conn = Connection(settings["control_fd"])
    try:
        model = load_model(tuple(settings["spec"]), getattr(torch, settings["dtype"]))  # JSON made it a list
        conn.send(("loaded", os.getpid()))
        if conn.recv() != "join":
            return 0
        store = dist.TCPStore("127.0.0.1", settings["store_port"], world, False, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=settings["timeout_s"]))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the last rank closed the chain
            return 0
        if msg[0] != "job":
            return 0
        _, job, ids, bounds = msg
        try:
            result = runahead_prefill(model, torch.tensor(ids, dtype=torch.int64), bounds, pg,
                                   timeout_s=settings["timeout_s"])
        except Exception:  # exit: a broken group must not serve another job
            conn.send(("error", traceback.format_exc()))
            return 1
        conn.send(("done", job, result.bytes_sent))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a helper rank of a KV-Runahead chain (started by RunaheadRanks)")
    parser.add_argument("settings", help="JSON written by RunaheadRanks.start")
    sys.exit(helper_main(json.loads(parser.parse_args().settings)))
