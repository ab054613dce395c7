"""Shared protocol of the TTFT benchmarks: one server per (configuration, prompt length), distinct prompts per
repeat so that every "cold" run is really cold, and the cache state of each step checked from SGLang's
`cached_tokens_details` (recorded in the JSON next to every time).

Per repeat r at length L (device pool 1.5 L, host tier 3x the device pool):
  cold     P_r first seen
  device   P_r again
  device_settled  (optional) P_r again, after the write-through of P_r's cold prefill has drained (stored page count
           stable, then 2 s): a hit without the background copy of the previous prefill competing for the CPU
  (filler F_r of about L tokens pushes P_r out of device memory; the host tier keeps it)
  host     P_r again
  (/flush_cache empties device and host; the SSD tier keeps its pages)
  ssd      P_r again
After the repeats the server is restarted on the same storage directory (OS page cache dropped when permitted):
  restart  P_r, for every r
TTFT is the latency of a greedy request with max_new_tokens=1 (prefill + one sampled token), client side.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from sglang_tiered.server_process import ServerProcess, cached_details, essay_texts, exit_cleanly_on_sigterm

exit_cleanly_on_sigterm()  # benchmarks are scripts: a terminated run still stops its servers

RESULTS = Path(__file__).parent / "results"
SLOW_DISK = Path(__file__).resolve().parents[2] / "shared" / "tools" / "slow-disk"  # a kernel I/O throttle
STEPS = ("cold", "device", "device_settled", "host", "ssd", "restart")
# SGLang's own configurations run the loop a CPU server with --kv-backend tiered runs (server_flags.py: without
# overlap), so that a comparison measures the cache, not the scheduler loop
SGLANG_CPU_LOOP = ["--disable-overlap-schedule"]


def hicache_args(backend: str, extra_config: dict, ratio: int) -> list[str]:
    """SGLang's own hierarchical cache on a CPU server with storage `backend` (its `--hicache-storage-backend`,
    configured by `extra_config`) and a host pool `ratio` times the device pool, as every benchmark runs it: 64-token
    pages, direct I/O into a layer-first host layout, SGLang's loop as ours runs on a CPU."""
    return ["--enable-hierarchical-cache", "--hicache-ratio", str(ratio), "--hicache-storage-backend", backend,
            "--hicache-storage-backend-extra-config", json.dumps(extra_config), "--page-size", "64",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--device", "cpu",
            *SGLANG_CPU_LOOP]


class PromptSource:
    """Disjoint slices of the essays' token stream, decoded back to text of exactly the asked token count."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        from sglang_tiered.models import default_model_path

        self.tok = AutoTokenizer.from_pretrained(default_model_path())
        self.ids = self.tok("\n\n".join(essay_texts()))["input_ids"]
        self.pos = 0

    def take(self, n: int) -> str:
        if self.pos + n > len(self.ids):
            self.pos = 0  # wrapped: the SSD directories are fresh per configuration, so reuse is still cold
        chunk = self.ids[self.pos : self.pos + n]
        self.pos += n
        return self.tok.decode(chunk)


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import sglang

        sglang_version = sglang.__version__
    except ImportError:  # (a GPU machine runs the engine's component benchmarks without SGLang)
        sglang_version = None
    from sglang_tiered.policy.cpu_dtype import cpu_flags

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 1024**3, 1),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": list(cpu_flags()),
            "isa_limits": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ},
            "python": sys.version.split()[0], "torch": torch.__version__, "sglang": sglang_version,
            "platform": platform.platform()}


def machine_class() -> str:
    """A short name of this machine's class, for results files: the CPU's vendor and its widest bf16/vector
    capability ("amd-avx512bf16", "intel-amx", "amd-avx2"); "gpu" where CUDA is present."""
    if torch.cuda.is_available():
        return "gpu"
    from sglang_tiered.policy.cpu_dtype import cpu_flags

    cpu = machine()["cpu"].lower()
    vendor = "amd" if "amd" in cpu else "intel" if "intel" in cpu or "xeon" in cpu else "cpu"
    flags = set(cpu_flags())
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx2") if f in flags), "base")
    return f"{vendor}-{isa.replace('_', '').removesuffix('bf16') if isa == 'amx_bf16' else isa.replace('_', '')}"


def auto_dtype() -> str:
    """The dtype `--dtype auto` picks for SmolLM2 on this machine (benchmarks pass it to every server explicitly, so
    that all configurations of one run compute in the same dtype)."""
    from sglang_tiered.models import default_model_path
    from sglang_tiered.policy.cpu_dtype import choose_dtype

    return choose_dtype(json.loads((default_model_path() / "config.json").read_text())).dtype


def kv_bytes_per_token(dtype: str) -> int:
    from sglang_tiered.storage.geometry import KVGeometry

    return KVGeometry(layers=30, kv_heads=3, head_dim=64, itemsize=4 if dtype == "float32" else 2).token_bytes


def drop_page_cache() -> bool:
    """Drop the OS page cache (needs root and a writable /proc/sys); True if it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_from_page_cache(directory: Path) -> int:
    """Drop the page-cache pages of the files under `directory` only (posix_fadvise DONTNEED after fsync), so that
    the next reads of them reach the device while the server's code and libraries stay cached (dropping the whole
    cache would make every process re-read its code pages, which then dominate what it reads). Returns the files."""
    n = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


def stream_generate(server: ServerProcess, payload: dict, timeout: float = 300.0) -> dict:
    """POST /generate with streaming on; the last chunk's JSON plus `ttft_s` (seconds until the first streamed chunk,
    i.e. the first token, client side) and `latency_s` (until the last)."""
    import urllib.request

    req = urllib.request.Request(server.url + "/generate", data=json.dumps({**payload, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            last = json.loads(line[5:])
    if last is None:
        raise RuntimeError("/generate streamed nothing")
    return {**last, "ttft_s": ttft, "latency_s": time.perf_counter() - t0}


def server_read_bytes(server: ServerProcess) -> int:
    """Bytes the server's processes read from storage (/proc/<pid>/io read_bytes: what reached the block layer)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != server.proc.pid:
                continue
            with open(f"/proc/{pid}/io") as f:
                total += int(next(line for line in f if line.startswith("read_bytes")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
    return total


def disk_read_bandwidth(directory: Path, size: int = 256 * 1024**2) -> dict:
    """Sequential read bandwidth of one large file in `directory` (bytes/s), page cache dropped if permitted."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "bandwidth-probe.bin"
    block = os.urandom(4 * 1024**2)
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dropped = drop_page_cache()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * 1024**2):
            pass
    seconds = time.perf_counter() - t0
    path.unlink()
    return {"bytes_per_s": size / seconds, "page_cache_dropped": dropped, "file_bytes": size}


def wait_for_storage(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.25)


def run_config(name: str, server_args: Callable[[Path, int], list[str]], lengths: list[int], repeats: int,
               workdir: Path, prompts: PromptSource, steps: tuple[str, ...] = STEPS,
               stored: Optional[Callable[[Path], int]] = None) -> dict:
    """Run the protocol for one configuration. Returns {length: {step: {"ttft_s": [...], "cached": [...]}}}."""
    out: dict = {}
    for length in lengths:
        store = workdir / f"{name}-{length}"
        subprocess.run(["rm", "-rf", str(store)], check=True)
        device_tokens = (length * 3 // 2 + 63) // 64 * 64 + 128
        args = ["--max-total-tokens", str(device_tokens), *server_args(store, length)]
        rows = {s: {"ttft_s": [], "cached": []} for s in steps}
        record = _recorder(rows)

        texts = [prompts.take(length) for _ in range(repeats)]
        print(f"[{name}] {length} tokens: server with {device_tokens} device tokens", flush=True)
        with ServerProcess(args, log_path=workdir / f"{name}-{length}.log") as server:
            server.generate(prompts.take(64), max_new_tokens=1)  # warm-up
            for text in texts:
                record("cold", server, text)
                if "device" in steps:
                    record("device", server, text)
                if "device_settled" in steps:
                    if stored is not None:
                        wait_for_storage(_settled(stored, store))
                    time.sleep(2.0)
                    record("device_settled", server, text)
                if "host" in steps:
                    server.generate(prompts.take(length), max_new_tokens=1)
                    record("host", server, text)
                if "ssd" in steps:
                    time.sleep(0.5)  # write-through to SSD is asynchronous
                    if stored is not None:
                        wait_for_storage(_settled(stored, store))
                    server.flush_cache()
                    record("ssd", server, text)
        if "restart" in steps:
            dropped = drop_page_cache()
            with ServerProcess(args, log_path=workdir / f"{name}-{length}-restart.log") as server:
                server.generate(prompts.take(64), max_new_tokens=1)
                for text in texts:
                    record("restart", server, text)
            rows["restart"]["page_cache_dropped"] = dropped
        for step in steps:
            med = statistics.median(rows[step]["ttft_s"])
            rows[step]["median_s"] = med
            print(f"[{name}] {length:>5} {step:<8} median {med:.3f} s  cached {rows[step]['cached'][0]}", flush=True)
        out[str(length)] = rows
    return out


def _recorder(rows: dict) -> Callable[[str, ServerProcess, str], None]:
    def record(step: str, server: ServerProcess, text: str) -> None:
        r = server.generate(text, max_new_tokens=1)
        rows[step]["ttft_s"].append(r["latency_s"])
        rows[step]["cached"].append(cached_details(r))

    return record


def _settled(stored: Callable[[Path], int], store: Path) -> Callable[[], bool]:
    """True once the number of stored pages stopped changing between two polls (write-through has drained)."""
    last = [-1]

    def check() -> bool:
        now = stored(store)
        done = now == last[0]
        last[0] = now
        return done

    return check


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results)
    lengths = list(next(iter(results.values())))
    steps = [s for s in STEPS if s in next(iter(next(iter(results.values())).values()))]
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 4), squeeze=False)
    width = 0.8 / len(configs)
    for ax, length in zip(axes[0], lengths):
        for i, cfg in enumerate(configs):
            rows = results[cfg][length]
            xs = [j + i * width for j in range(len(steps))]
            ax.bar(xs, [rows[s]["median_s"] if s in rows else 0 for s in steps], width, label=cfg)
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(steps))], steps)
        ax.set_title(f"{length} tokens")
        ax.set_ylabel("TTFT, median (s)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bootstrap(xs: list[float], draws: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile interval of the mean of `xs` (seeded): of paired differences, the paired interval."""
    rng = random.Random(seed)
    return interval95([statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(draws)])


def interval95(values: list[float]) -> list[float]:
    """The 95 % percentile interval [low, high] of bootstrap values."""
    v = sorted(values)
    return [v[int(0.025 * len(v))], v[int(0.975 * len(v)) - 1]]


def describe_run() -> dict:
    """What a results file says of its own run (benchmarks/report.py renders it): the benchmark (the script's name),
    its description (the first paragraph of the script's docstring) and the command that ran."""
    main = sys.modules.get("__main__")
    doc = (getattr(main, "__doc__", None) or "").strip().split("\n\n")[0]
    script = Path(sys.argv[0]).name
    return {"benchmark": Path(script).stem, "description": " ".join(doc.split()),
            "command": " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])}


def save(name: str, payload: dict) -> Path:
    """Write `payload` as results/NAME.json, with the run's own description (`describe_run`) where it has none."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**describe_run(), **payload}, indent=1))
    return path
