"""Measuring the compute-or-load inputs on this machine, and keeping them.

* `measure_read`: the SSD tier directory's read bandwidth -- a fresh file (64 MiB, less where the tier's capacity
  leaves less room: it counts against it) read back with O_DIRECT (the page cache bypassed, so a kernel I/O throttle
  or a network disk shows; dropping the file's cached pages where O_DIRECT is refused, e.g. tmpfs). It only seeds the
  read rate (policy/read_rate.py).
* `measure_profile`: the served model's compute (`policy.kvpr.Profile`): a chunk of MEET_CHUNK_PAGES span pages
  computed from token ids, and K, V recomputed from activations on the loader's one thread; each the best of a few
  runs: 0.3-3.7 s in all for the test models in fp32 on one AVX2 thread.

A server writes the result to `<ssd dir>/kvpr-profile.json` under `profile_key` (what the profile depends on: the
machine, torch, the model, the dtype, the page size) and a restart with the same key uses it instead of measuring
again (the measurement holds the scheduler for seconds on a CPU: 3.1 s for SmolLM2 in fp32 on one AVX2 thread);
`sglang-tiered kvpr-profile` prints that file (or measures a checkpoint itself with --model-path).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from sglang_tiered.engine.llama import LlamaModel
from sglang_tiered.engine.one_thread import one_thread_pool
from sglang_tiered.policy.cpu_dtype import signature
from sglang_tiered.policy.kvpr import MEET_CHUNK_PAGES, Profile
from sglang_tiered.storage.files import write_atomic
from sglang_tiered.storage.tier_layout import PROFILE_FILE

PROBE_BYTES = 64 << 20  # size of the read-bandwidth probe file
_CHUNK = 1 << 20


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


def _best_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` timed runs of `fn` after a warm-up (a run sharing the CPU only ever takes longer);
    on a CUDA `device` each run is timed until the device is done with it."""
    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_profile(model: LlamaModel, page_size: int, repeats: int = 2) -> Profile:
    """The served model's compute (see the module docstring). Call it on the thread that runs the model's forwards:
    another thread's OpenMP team would compete with that thread's."""
    from sglang_tiered.engine.meet import MemoryPages, meet_prefill

    c, g, k = model.cfg, torch.Generator().manual_seed(1), MEET_CHUNK_PAGES
    span = MemoryPages(torch.zeros(c.layers, k * page_size, 2, c.kv_heads, c.head_dim, dtype=model.dtype), page_size)
    ids = torch.randint(0, c.vocab, (k * page_size + 1,), generator=g)
    chunk_s = min(meet_prefill(model, ids[:-1], ids[-1:], prefix_len=0, source=span, split=k, chunk=k).compute_s
                  for _ in range(repeats + 1))
    h = torch.randn(page_size, c.hidden, generator=g).to(device=model.device, dtype=model.dtype)
    pos = torch.arange(page_size)
    with one_thread_pool("kvpr-profile-loader") as pool:  # torch as the loader runs it: one thread
        recompute = pool.submit(torch.inference_mode()(
            lambda: _best_s(lambda: model.kv_from_input(0, h, pos), repeats + 1, model.device))).result()
    return Profile(page_s=chunk_s / k, recompute_s=recompute / page_size)


def profile_key(model: str, dtype: str, page_size: int, device: torch.device) -> str:
    """The key of a profile of `model` (its fingerprint) in `dtype` with `page_size`-token pages computed on `device`
    by this process: on a CPU its `cpu_dtype.signature` (capability, flags, model name, torch's version) and torch's
    thread count, on a GPU its name and torch's version."""
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|{model}"
    else:
        machine = f"{signature(model)}|{torch.get_num_threads()} threads"
    return f"{machine}|{dtype}|page {page_size}"


def load_profiles(directory: str | os.PathLike) -> dict[str, dict]:
    path = Path(directory) / PROFILE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_profile(directory: str | os.PathLike, key: str, profile: Profile, *,
                 write: Optional[Callable[[bytes], bool]] = None, **meta) -> bool:
    """Merge `profile` (and `meta`) into the directory's profile file under `key`; whether the file was kept.
    `write(data)` replaces the file and says whether it did (a server passes its SSD tier's `meta.write`, which
    counts the bytes and is False with no room under the capacity or a failed write); by default an atomic replace,
    whose failure raises OSError."""
    data = load_profiles(directory)
    data[key] = {**asdict(profile), **meta, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    blob = json.dumps(data, indent=1, sort_keys=True).encode()
    if write is not None:
        return write(blob)
    write_atomic(Path(directory) / PROFILE_FILE, blob)
    return True


def profile_of(entry: dict) -> Profile:
    """The profile an entry of the profile file holds. Raises KeyError, TypeError or ValueError for an entry that is
    not one."""
    return Profile(float(entry["page_s"]), float(entry["recompute_s"]))


class StoredProfile(NamedTuple):
    profile: Profile
    read_bytes_per_s: float  # 0: the read probe had failed
    measured_at: str  # local time, ISO 8601 ("?" if not recorded)


def stored_entry(directory: str | os.PathLike, key: str) -> Optional[StoredProfile]:
    """The profile stored under `key`, or None."""
    entry = load_profiles(directory).get(key)
    try:
        return StoredProfile(profile_of(entry), float(entry["read_bytes_per_s"]), str(entry.get("measured_at", "?")))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def describe(profile: Profile, read_bps: Optional[float] = None) -> str:
    compute = (f"a span page computed in {profile.page_s * 1e3:.1f} ms, K/V recompute {profile.recompute_s * 1e6:.2f} "
               "us per token-layer")
    return compute if read_bps is None else f"SSD read {read_bps / 1e6:.0f} MB/s, {compute}"
