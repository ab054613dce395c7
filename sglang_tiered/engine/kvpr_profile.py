"""Measuring what the compute-or-load decisions need (`policy.kvpr.Profile`) on this machine, and keeping it.

* read bandwidth of the SSD tier's directory: a fresh file (64 MiB, less where the tier's capacity leaves less
  room: it counts against it) read back with O_DIRECT (the page cache
  bypassed, so a kernel I/O throttle or a network disk shows; falls back to dropping the file's cached pages where
  O_DIRECT is refused, e.g. tmpfs);
* recompute time of K and V per token-layer from activations, one layer's time per new token and the time to move
  a stored token-layer's KV through the loader, timed on the served model's own weights and dtype (median of a few
  runs, tens of milliseconds). The server refines the read bandwidth from its loads.
* a computed chunk's time: one page and MEET_CHUNK_PAGES pages of a span, each prefilled as one chunk, fitted as a
  fixed part (on a CPU, the model's weights read from memory once per chunk) plus a part per token-layer.

The server measures from its first request on (read) and at its first stored-span load (compute) and writes the
result to `<ssd dir>/kvpr-profile.json` under "<model fingerprint>|<dtype>"; `sglang-tiered kvpr-profile` prints
that file (or measures a checkpoint itself with --model-path).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.engine.one_thread import one_thread_pool
from sglang_tiered.kernels.extend_attention import causal_attention
from sglang_tiered.policy.kvpr import MEET_CHUNK_PAGES, Profile
from sglang_tiered.storage.files import write_atomic

PROFILE_FILE = "kvpr-profile.json"
_CHUNK = 1 << 20


PROBE_BYTES = 64 << 20  # size of the read-bandwidth probe file
LAYER_TRIES = 3  # measurements of a layer's time at most, while it disagrees with the whole load's (settled_layer_s)


def measure_read(path: str | os.PathLike, nbytes: int = PROBE_BYTES) -> float:
    """Bytes per second reading a freshly written file of `nbytes` at `path` (removed afterwards) from its block
    device: the rate of its second half (a kernel I/O throttle lets the first 100 ms worth of bytes through at once --
    20 MB at 200 MB/s -- so the whole file's rate would overstate a throttled device)."""
    path = Path(path)
    block = os.urandom(_CHUNK)
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            for _ in range(max(1, nbytes // _CHUNK)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        size = path.stat().st_size
        buf = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT wants
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0, done, half, t_half = time.perf_counter(), 0, size // 2, None
            while done < size:
                if t_half is None and done >= half:
                    t_half = time.perf_counter()
                try:
                    n = os.preadv(fd, [buf], done)
                except OSError:  # O_DIRECT refused at read time: read through the (dropped) page cache
                    os.close(fd)
                    fd = os.open(path, os.O_RDONLY)
                    n = os.preadv(fd, [buf], done)
                if n <= 0:
                    break
                done += n
            end = time.perf_counter()
        finally:
            os.close(fd)
            buf.close()
        if t_half is None:
            return done / max(end - t0, 1e-9)
        return (done - half) / max(end - t_half, 1e-9)
    finally:
        path.unlink(missing_ok=True)


def _best_s(fn, repeats: int) -> float:
    """The fastest of `repeats` timed runs of `fn` after a warm-up (a run sharing the CPU with other work only ever
    takes longer)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Unsettled(RuntimeError):
    """The layer's time still disagreed with the whole load's after LAYER_TRIES measurements; `values`: the profile's
    compute part as measured anyway (recompute, layer, stored seconds)."""

    def __init__(self, values: tuple[float, float, float], bound: float) -> None:
        super().__init__(f"a layer {values[1] * 1e6:.1f} us per new token, more than twice the {bound * 1e6:.1f} us "
                         f"the whole load's time allows")
        self.values = values


class ProfileTries:
    """When a compute profile that disagrees with itself (`Unsettled`: something else slowed it) is taken again: at
    most `tries` profiles in all, each `retry_s` seconds after the one dropped (what slowed it has likely ended); the
    last, or one taken `final` (a forced load is waiting for it), is kept. Times are time.monotonic() seconds."""

    def __init__(self, tries: int, retry_s: float) -> None:
        self.tries, self.retry_s = tries, retry_s
        self.dropped = 0  # profiles dropped so far
        self.not_before = 0.0  # no profile is taken before this

    def due(self, now: float) -> bool:
        """Whether a profile may be taken at `now`."""
        return now >= self.not_before

    def drop(self, now: float, final: bool) -> bool:
        """An unsettled profile taken at `now`: True to drop it and take another `retry_s` later, False to keep it
        (the `tries`-th, or `final`)."""
        if final or self.dropped + 1 >= self.tries:
            return False
        self.dropped += 1
        self.not_before = now + self.retry_s
        return True


def settled_layer_s(first: float, again: Callable[[], float], bound: float,
                    tries: int = LAYER_TRIES) -> tuple[float, bool]:
    """A layer's time per new token: `first`, measured again (`again()`, the fastest kept) while it is more than
    twice `bound` -- the whole load's time over its layers x new tokens, which contains that layer work, so a layer
    timed far slower than that was slowed by something else -- `tries` measurements at most in all. Returns (the
    fastest, whether it agrees with `bound`). Measured once in a server: a layer 2125 us per new token, 27x its usual
    41-139 us, beside a whole load that fitted 77 us at most; that profile kept compute out of every load of the
    process (a page's compute looked 27x dearer than it was)."""
    best = first
    for _ in range(tries - 1):
        if best <= 2 * bound:
            break
        best = min(best, again())
    return best, best <= 2 * bound


@torch.inference_mode()
def measure_compute(model: LlamaModel, tokens: int = 256, new_tokens: int = 32,
                    repeats: int = 5) -> tuple[float, float, float]:
    """(seconds to recompute K, V of one token-layer from activations on the loader's one thread, seconds of one layer
    per new token, seconds per stored token-layer of a whole load from memory (every page loaded) beyond the new
    tokens' layers: assembling the span's KV, attending over it). Each the best of `repeats` runs; the layer first,
    before the loader's thread has run anything, and again where it disagrees with the whole load
    (`settled_layer_s`; `Unsettled` if it still does). Call it on the thread that runs the model's forwards:
    another thread's OpenMP team would compete with that thread's spinning one (measured in a server: a layer
    126-206 us per new token from a thread of its own, 54-74 us on its own)."""
    c = model.cfg
    g = torch.Generator().manual_seed(0)
    x = torch.randn(new_tokens, c.hidden, generator=g).to(model.dtype)
    npos = torch.arange(new_tokens)

    def layer():
        q, k, v = model.qkv(0, x, npos)
        model.finish_layer(0, x, causal_attention(q, k, v, 0))

    layer_s = _best_s(layer, repeats) / new_tokens
    h = torch.randn(tokens, c.hidden, generator=g).to(model.dtype)
    pos = torch.arange(tokens)
    recompute = _on_loader_thread(lambda: _best_s(lambda: model.kv_from_input(0, h, pos), repeats)) / tokens
    from sglang_tiered.engine.meet import MemoryPages, meet_prefill

    span = MemoryPages(torch.randn(c.layers, 2 * tokens, 2, c.kv_heads, c.head_dim, generator=g).to(model.dtype), 16)
    ids = torch.randint(0, c.vocab, (2 * tokens + new_tokens,), generator=g)
    whole = _best_s(lambda: meet_prefill(model, ids[: 2 * tokens], ids[2 * tokens :], prefix_len=0, source=span,
                                         split=0), max(1, repeats // 2))
    bound = whole / (c.layers * new_tokens)
    layer_s, agrees = settled_layer_s(layer_s, lambda: _best_s(layer, repeats) / new_tokens, bound)
    stored = max(0.0, whole - c.layers * new_tokens * layer_s) / (c.layers * 2 * tokens)
    if not agrees:
        raise Unsettled((recompute, layer_s, stored), bound)
    return recompute, layer_s, stored


@torch.inference_mode()
def measure_chunks(model: LlamaModel, page_size: int, pages: int = MEET_CHUNK_PAGES,
                   repeats: int = 2) -> tuple[float, float]:
    """(seconds a chunk of span pages computed from token ids takes whatever its length, seconds per span token-layer
    beyond that): a span of one page and one of `pages` pages, each computed as one chunk by the two-sided engine
    (its meet point forced to the whole span; the best of `repeats` after a warm-up), fitted as chunk + k x page.
    Where the wider chunk took no longer per page than the fit allows (timing noise): no fixed part, the wider
    chunk's time per token-layer. Call it on the thread that runs the model's forwards (as `measure_compute`)."""
    from sglang_tiered.engine.meet import MemoryPages, meet_prefill

    c, g = model.cfg, torch.Generator().manual_seed(1)

    def chunk_s(k: int) -> float:
        span = MemoryPages(torch.zeros(c.layers, k * page_size, 2, c.kv_heads, c.head_dim, dtype=model.dtype),
                           page_size)
        ids = torch.randint(0, c.vocab, (k * page_size + 1,), generator=g)
        return min([meet_prefill(model, ids[:-1], ids[-1:], prefix_len=0, source=span, split=k, chunk=k).compute_s
                    for _ in range(repeats + 1)][1:])

    one, wide = chunk_s(1), chunk_s(pages)
    token_layers = page_size * c.layers
    span_s = (wide - one) / ((pages - 1) * token_layers)
    if span_s <= 0:
        return 0.0, wide / (pages * token_layers)
    return max(0.0, one - token_layers * span_s), span_s


def _on_loader_thread(fn: Callable[[], float]) -> float:
    """`fn()` on a thread that runs torch the way the two-sided loader does (one OpenMP thread, engine/meet.py)."""
    with one_thread_pool("kvpr-profile-loader") as pool:
        return pool.submit(torch.inference_mode()(fn)).result()


def profile_key(model: str, dtype: str) -> str:
    return f"{model}|{dtype}"


def load_profiles(directory: str | os.PathLike) -> dict[str, dict]:
    path = Path(directory) / PROFILE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_profile(directory: str | os.PathLike, key: str, profile: Profile, *,
                 write: Optional[Callable[[bytes], object]] = None, **meta) -> Path:
    """Merge `profile` (and `meta`) into the directory's profile file under `key`. `write(data)` replaces the file
    (a server passes its SSD tier's `write_meta`, which counts the bytes); by default an atomic replace."""
    path = Path(directory) / PROFILE_FILE
    data = load_profiles(directory)
    data[key] = {**asdict(profile), **meta, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    blob = json.dumps(data, indent=1, sort_keys=True).encode()
    if write is not None:
        write(blob)
    else:
        write_atomic(path, blob)
    return path


def profile_of(entry: dict) -> Profile:
    """The profile an entry of the profile file holds (fields added since it was written are 0: not measured).
    Raises KeyError, TypeError or ValueError for an entry that is not one."""
    return Profile(float(entry["read_bytes_per_s"]), float(entry["recompute_s"]), float(entry["layer_s"]),
                   float(entry.get("stored_s", 0.0)), chunk_s=float(entry.get("chunk_s", 0.0)),
                   span_s=float(entry.get("span_s", 0.0)))


def stored_profile(directory: str | os.PathLike, key: str) -> Optional[Profile]:
    entry = load_profiles(directory).get(key)
    if not entry:
        return None
    try:
        return profile_of(entry)
    except (KeyError, TypeError, ValueError):
        return None


def describe(profile: Profile) -> str:
    return (f"SSD read {profile.read_bytes_per_s / 1e6:.0f} MB/s, K/V recompute {profile.recompute_s * 1e6:.2f} "
            f"us per token-layer, a layer {profile.layer_s * 1e6:.1f} us per new token, "
            f"{profile.stored_s * 1e6:.2f} us per stored token-layer" +
            (f", a computed chunk {profile.chunk_s * 1e3:.1f} ms + {profile.span_s * 1e6:.2f} us per span token-layer"
             if profile.span_s else ""))
