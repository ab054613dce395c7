"""The one layer loader of the layer-by-layer engine: stored KV of layer l + 1 is fetched while layer l computes.

Blending (stored chunk KV re-rotated into a prompt) and compute-or-load (stored KV of a prefix) both
walk the layers in order and need, at layer l, data that comes from memory, a file or the network. `LayerLoader`
runs `fetch(layer)` on one background thread, one layer ahead of the caller:

    loader = LayerLoader(fetch, layers, first=0)
    for layer in range(layers):
        data = loader.get(layer)      # waits only if the fetch of this layer is not done yet
        ...compute layer...
    loader.close()

Contracts
* `get` must be called with consecutive layers starting at `first`; the fetch of layer l + 1 is submitted when
  layer l is handed out, so at most two layers are in memory at once (the one in use and the next).
* `fetch` runs on the loader thread (or on the caller's thread with `overlap=False`); an exception it raises is
  raised again by the `get` of that layer. The loader thread runs torch with one OpenMP thread (a team of its own
  would spin on the cores the caller's layers compute on); the caller's count is left as it was
  (engine/one_thread.py).
* `load_s` sums the seconds spent in `fetch` (overlapped or not); `wait_s` sums the seconds `get` blocked the
  caller (0 when loading hides entirely behind compute).
* On a CUDA `device` the fetches run on a stream of the loader's own, which starts after the work queued on the
  caller's stream when the loader is made (what a fetch reads, e.g. RoPE rows); `get` makes the caller's stream
  wait for that layer's fetch and marks its tensors as used there (the caching allocator keeps their memory until
  the caller's kernels are done). Without this, a fetch's kernels would run on the loader thread's default stream,
  which a caller on another stream (SGLang runs its forward on one) does not wait for.
* `close()` (or leaving the `with` block) waits for a running fetch and drops queued ones; on CUDA the caller's
  stream then waits for every fetch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, Optional, TypeVar

import torch

from sglang_tiered.engine.one_thread import one_thread_pool

T = TypeVar("T")


class LayerLoader(Generic[T]):
    def __init__(self, fetch: Callable[[int], T], layers: int, *, first: int = 0, overlap: bool = True,
                 name: str = "layer-load", device: Optional[torch.device] = None) -> None:
        self._fetch, self.layers, self.overlap = fetch, layers, overlap
        self.load_s = 0.0
        self.wait_s = 0.0
        self._next_layer = first
        self._pool = one_thread_pool(name) if overlap else None
        self._streams = _Streams(device) if overlap and device is not None and device.type == "cuda" else None
        self._pending: Optional[Future] = None
        if overlap and first < layers:
            self._pending = self._pool.submit(self._timed, first)

    def _timed(self, layer: int) -> tuple[T, Optional[torch.cuda.Event]]:
        """The layer's data, and on CUDA the event its fetch's stream records at the end."""
        t0 = time.perf_counter()
        try:
            return (self._fetch(layer), None) if self._streams is None else self._streams.run(self._fetch, layer)
        finally:
            self.load_s += time.perf_counter() - t0

    def get(self, layer: int) -> T:
        """The data of `layer` (the next one in order)."""
        if layer != self._next_layer:
            raise ValueError(f"layers are loaded in order: expected {self._next_layer}, asked for {layer}")
        self._next_layer = layer + 1
        t0 = time.perf_counter()
        if self._pool is None:
            data, _ = self._timed(layer)
        else:
            pending, self._pending = self._pending, None
            if layer + 1 < self.layers:
                self._pending = self._pool.submit(self._timed, layer + 1)
            data, done = pending.result()
            if done is not None:
                data = self._streams.take(data, done)
        self.wait_s += time.perf_counter() - t0
        return data

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._streams is not None:
            self._streams.close()

    def __enter__(self) -> LayerLoader[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Streams:
    """A CUDA loader's two streams: the caller's (current when the loader is made) and the fetches' own."""

    def __init__(self, device: torch.device) -> None:
        self.caller = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self.side.wait_stream(self.caller)

    def run(self, fetch: Callable[[int], T], layer: int) -> tuple[T, torch.cuda.Event]:
        """On the loader thread: `fetch(layer)` queued on the side stream, and the event of its end."""
        with torch.cuda.stream(self.side):
            data = fetch(layer)
            return data, self.side.record_event()

    def take(self, data: T, done: torch.cuda.Event) -> T:
        """On the caller's thread: its stream waits for the fetch; the fetched tensors are in use there."""
        self.caller.wait_event(done)
        for t in data if isinstance(data, (tuple, list)) else (data,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.caller)
        return data

    def close(self) -> None:
        """The caller's stream waits for every fetch (what they read may be freed after)."""
        self.caller.wait_stream(self.side)
