"""`--kv-backend {default,tiered}` and the `--tiered-*` flags in SGLang's own parser, and their translation into
SGLang's real settings. Runs in the launcher (`python -m sglang.launch_server`, `sglang serve`), before SGLang
resolves its arguments; every SGLang process receives the result through `settings.py` (one environment variable).

A bad value stops the launcher with one line, `sglang-tiered: --flag: reason`, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

from sglang_tiered.config import (
    CHOICES,
    CUDA_PREVIEW_ENV,
    DEFAULT_PAGE_SIZE,
    FLAG_HELP,
    ConfigError,
    TieredConfig,
    cuda_refusal,
    default_partitions_path,
    hooked_prefills,
    layered_reads,
    parse_size,
)
from sglang_tiered.integration import cpu_shims, keys, runtime, settings
from sglang_tiered.models import DEFAULT_MODEL_ALIAS, model_fingerprint, resolve_model_path
from sglang_tiered.policy import cpu_dtype
from sglang_tiered.storage import directory_lock
from sglang_tiered.storage.files import write_atomic
from sglang_tiered.storage.geometry import KVGeometry
from sglang_tiered.storage.ssd_tier import DTYPE_FILE

logger = logging.getLogger("sglang_tiered")

STORAGE_MODULE = "sglang_tiered.integration.storage_backend"
STORAGE_CLASS = "TieredSSDStorage"
FLAG_TYPES = {"ssd_capacity": str}  # where a field's default does not show its flag's type


def _flag(name: str) -> str:
    return "--tiered-" + name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """AFTER hook body for `ServerArgs.add_cli_args`."""
    if any("--kv-backend" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group("sglang-tiered (GPU / host DRAM / SSD KV store)")
    group.add_argument(
        "--kv-backend",
        choices=["default", "tiered"],
        default="default",
        help="'tiered' serves the radix cache from a device / host DRAM / SSD KV store (sglang-tiered). "
        f"Turns on the hierarchical cache with our SSD tier; `--model-path {DEFAULT_MODEL_ALIAS}` serves the "
        "embedded SmolLM2-135M-Instruct.",
    )
    defaults = TieredConfig()
    for f in fields(TieredConfig):
        default = getattr(defaults, f.name)
        kind = FLAG_TYPES.get(f.name) or {int: int, float: float}.get(type(default), str)
        group.add_argument(
            _flag(f.name),
            dest=f"tiered_{f.name}",
            type=kind,
            default=default,
            choices=CHOICES.get(f.name),
            help=FLAG_HELP[f.name],
        )


def _fail(message: str) -> None:
    print(f"sglang-tiered: {message}", file=sys.stderr)
    raise SystemExit(2)


def config_from_namespace(ns: argparse.Namespace) -> TieredConfig:
    values: dict[str, Any] = {}
    for f in fields(TieredConfig):
        values[f.name] = getattr(ns, f"tiered_{f.name}", getattr(TieredConfig(), f.name))
    try:
        values["ssd_capacity"] = parse_size(values["ssd_capacity"])
    except ValueError as exc:
        raise ConfigError(f"--tiered-ssd-capacity: {exc}") from None
    values["ssd_dir"] = str(Path(values["ssd_dir"]).expanduser().resolve())
    return TieredConfig(**values)


def _hf_config(model_path: str) -> dict | None:
    """config.json of a local model directory, or None (a hub id, or unreadable)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


_GENERIC_SHAPES = {"hidden_size": 2048, "num_attention_heads": 16, "intermediate_size": 8192}  # without config.json
_DTYPE_RECORDS = 8  # machine/model signatures kept in DTYPE_FILE (the newest)
_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def choose_cpu_dtype(ns: argparse.Namespace, hf: dict | None, ssd_dir: str) -> Optional[dict]:
    """`--dtype auto` on a CPU-only server: the dtype chosen for this machine and model before, as recorded in
    `<ssd_dir>/cpu-dtype.json` (a restart that chose another dtype would find every stored page foreign), else the
    fastest dtype measured now (policy/cpu_dtype.py); logged with the times. An explicit `--dtype` is obeyed.
    Returns the records to write back once the directory is known to be usable (None: nothing new)."""
    if getattr(ns, "dtype", "auto") != "auto":
        logger.info("sglang-tiered: --dtype %s (explicit)", ns.dtype)
        return None
    key = cpu_dtype.signature(model_fingerprint(ns.model_path))
    path = Path(ssd_dir) / DTYPE_FILE
    records = _dtype_records(path)
    try:
        choice = cpu_dtype.DtypeChoice.from_record(records[key])
    except (KeyError, ValueError):
        choice = None
    if choice is not None:
        ns.dtype = choice.dtype
        logger.info("sglang-tiered: --dtype auto on this CPU: %s, as measured on this machine at %s (kept in %s; "
                    "remove it to measure again)", choice.describe(), choice.measured_at or "?", path)
        return None
    choice = cpu_dtype.choose_dtype(hf or _GENERIC_SHAPES)
    ns.dtype = choice.dtype
    logger.info("sglang-tiered: --dtype auto on this CPU: %s (measured now; kept in %s for restarts)",
                choice.describe(), path)
    records[key] = choice.record()
    return dict(list(records.items())[-_DTYPE_RECORDS:])


def _dtype_records(path: Path) -> dict:
    """The dtype records kept in `path` (signature -> record); {} if there are none or the file is unreadable."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("sglang-tiered: %s unreadable (%s): the dtype is measured again", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _page_bytes(hf: dict | None, ns: argparse.Namespace) -> Optional[int]:
    """Bytes of one KV page of this rank in the server's dtype, or None where the model's shape is not known."""
    if hf is None:
        return None
    try:
        itemsize = _ITEMSIZE.get(str(ns.dtype), 2)
        return KVGeometry.from_hf_config(hf, itemsize, getattr(ns, "tp_size", 1) or 1).page_bytes(ns.page_size)
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _keep_dtype_records(ssd_dir: str, records: dict) -> None:
    try:
        write_atomic(Path(ssd_dir) / DTYPE_FILE, json.dumps(records, indent=1).encode())
    except OSError as exc:
        logger.warning("sglang-tiered: cannot keep the dtype choice in %s (%s): a restart measures again", ssd_dir,
                       exc)


def translate(ns: argparse.Namespace) -> None:
    """Rewrite SGLang's parsed arguments in place for `--kv-backend tiered`; no-op for `default` (which also clears
    any settings inherited from a parent process)."""
    if getattr(ns, "model_path", None) == DEFAULT_MODEL_ALIAS:
        ns.model_path = resolve_model_path(ns.model_path)
        if getattr(ns, "tokenizer_path", None) in (None, DEFAULT_MODEL_ALIAS):
            ns.tokenizer_path = ns.model_path
    if getattr(ns, "kv_backend", "default") != "tiered":
        settings.clear()
        return
    try:
        _translate_tiered(ns)
    except ConfigError as exc:
        _fail(str(exc))


def _translate_tiered(ns: argparse.Namespace) -> None:
    conflicts = {
        "hicache_storage_backend": "--hicache-storage-backend",
        "hicache_storage_backend_extra_config": "--hicache-storage-backend-extra-config",
        "enable_lmcache": "--enable-lmcache",
        "disable_radix_cache": "--disable-radix-cache",
    }
    for attr, flag in conflicts.items():
        if getattr(ns, attr, None):
            raise ConfigError(f"{flag}: conflicts with --kv-backend tiered, which brings its own storage tier")
    if getattr(ns, "radix_cache_backend", None) not in (None, "tiered"):
        raise ConfigError(f"--radix-cache-backend: {ns.radix_cache_backend} conflicts with --kv-backend tiered")
    if getattr(ns, "hicache_host_memory_mode", "cache") != "cache":
        raise ConfigError("--hicache-host-memory-mode: --kv-backend tiered keeps the host tier as a cache")

    cfg = config_from_namespace(ns)
    if ns.page_size is None:
        ns.page_size = DEFAULT_PAGE_SIZE
    if ns.page_size < 1:
        raise ConfigError(f"--page-size: must be >= 1, got {ns.page_size}")
    cfg.validate()
    hf = _hf_config(ns.model_path)
    cpu_only = cpu_shims.cuda_absent()
    cuda_preview = not cpu_only and os.environ.get(CUDA_PREVIEW_ENV) == "1"
    if cpu_only:
        _cpu_settings(ns)
    else:
        _cuda_settings(ns, cfg, cuda_preview)
    threads, partitions = _runahead_settings(ns, cfg, hf)
    if cfg.remote:
        from sglang_tiered.storage.mooncake_store import import_client

        try:
            import_client()
        except ImportError as exc:
            raise ConfigError(f"--tiered-remote: {exc}") from None
    # after every other check: a bad flag stops the launcher before --dtype auto times the linears (about 1 s)
    dtype_records = choose_cpu_dtype(ns, hf, cfg.ssd_dir) if cpu_only else None
    cfg.check_page_fits(_page_bytes(hf, ns))
    _claim_directory(cfg.ssd_dir)
    if dtype_records is not None:
        _keep_dtype_records(cfg.ssd_dir, dtype_records)
    for field, value in cfg.host_pool_settings().items():
        setattr(ns, field, value)
    _load_page_hash()  # last: every flag is checked before a build can take its seconds
    settings.publish(settings.Settings(
        config=cfg, model=model_fingerprint(ns.model_path), model_path=str(ns.model_path), cpu_only=cpu_only,
        cuda_preview=cuda_preview,
        runahead_threads=threads, runahead_partitions=partitions, vocab_size=int((hf or {}).get("vocab_size") or 0),
        attention_heads=int((hf or {}).get("num_attention_heads") or 0)))
    extra = {  # only what SGLang itself reads; our settings travel in `settings`
        "backend_name": "tiered",
        "module_path": STORAGE_MODULE,
        "class_name": STORAGE_CLASS,
        "interface_v1": 1,
        "prefetch_threshold": cfg.prefetch_threshold or ns.page_size,
    }
    ns.enable_hierarchical_cache = True
    ns.radix_cache_backend = "tiered"
    ns.hicache_storage_backend = "dynamic"
    ns.hicache_storage_backend_extra_config = json.dumps(extra)
    logger.info(
        "sglang-tiered: hierarchical cache on, SSD tier %s (capacity %d bytes), page size %d, prefetch threshold %d",
        cfg.ssd_dir, cfg.ssd_capacity, ns.page_size, extra["prefetch_threshold"],
    )


def _load_page_hash() -> None:
    """Build (once per environment) and load SGLang's page-key hash here, before any process serves, so that no
    request waits for the build and a machine that cannot build it stops at startup instead of at its first request."""
    try:
        seconds = keys.load_page_hash()
    except RuntimeError as exc:
        raise ConfigError(f"--kv-backend tiered: {exc}") from None
    if seconds > 1:
        logger.info("sglang-tiered: SGLang's page-key hash built in %.1f s (once per environment)", seconds)


def _claim_directory(ssd_dir: str) -> None:
    """One server per SSD directory (storage/directory_lock.py): this launcher holds the claim while it runs."""
    claims = runtime.process().directory_claims
    if ssd_dir in claims:  # (this process parsed the flags before)
        return
    try:
        claims[ssd_dir] = directory_lock.claim(ssd_dir)
    except directory_lock.DirectoryInUse as exc:
        raise ConfigError(f"--tiered-ssd-dir: {exc}; give each server its own directory (its capacity and "
                          "eviction cover every file under it)") from None
    except OSError as exc:
        raise ConfigError(f"--tiered-ssd-dir: cannot claim {ssd_dir}: {exc.strerror or exc}") from None


CPU_OVERLAP_ENV = "SGLANG_TIERED_CPU_OVERLAP"  # "1": a CPU-only server keeps SGLang's overlap loop


def _cpu_settings(ns: argparse.Namespace) -> None:
    """Device, host-tier layout and I/O backend of a machine without CUDA (what the CPU shims support)."""
    if getattr(ns, "device", None) in (None, "cpu"):
        ns.device = "cpu"
    else:
        raise ConfigError(f"--device: {ns.device} requested but this machine has no CUDA")
    if ns.hicache_io_backend not in ("kernel", cpu_shims.CPU_IO_BACKEND):  # "kernel" is SGLang's default
        raise ConfigError(f"--hicache-io-backend: only 'direct' works without CUDA, got {ns.hicache_io_backend}")
    if ns.hicache_mem_layout not in ("page_first", cpu_shims.CPU_MEM_LAYOUT):  # "page_first" is the default
        raise ConfigError(f"--hicache-mem-layout: only 'layer_first' works without CUDA, got {ns.hicache_mem_layout}")
    ns.hicache_io_backend = cpu_shims.CPU_IO_BACKEND
    ns.hicache_mem_layout = cpu_shims.CPU_MEM_LAYOUT
    # SGLang's overlap loop handles a batch's result after launching the next batch; on a CPU the launch is the whole
    # forward, so every result waited for the next batch's forward: a first token for a decode step (docs/cpu.md).
    if os.environ.get(CPU_OVERLAP_ENV) != "1" and not ns.disable_overlap_schedule:
        ns.disable_overlap_schedule = True
        logger.info("sglang-tiered: --disable-overlap-schedule (CPU: a batch's result does not wait for the next "
                    "batch's forward; %s=1 keeps SGLang's overlap loop)", CPU_OVERLAP_ENV)


def _cuda_settings(ns: argparse.Namespace, cfg: TieredConfig, preview: bool) -> None:
    """What a CUDA server refuses (`config.cuda_refusal`); SGLang's `layer_first` host layout where a mechanism reads
    stored pages layer by layer (`config.layered_reads`); SGLang's prefill CUDA graph off where our hook computes
    prefills (`config.hooked_prefills`) and the operator did not choose a prefill graph backend."""
    chosen = prefill_graph_backend(ns)
    refusal = cuda_refusal(cfg, getattr(ns, "attention_backend", None), preview, chosen)
    if refusal:
        raise ConfigError(refusal)
    if preview:
        logger.warning("sglang-tiered: %s=1: gated loading and compute-or-load run on CUDA unverified",
                       CUDA_PREVIEW_ENV)
    layered = layered_reads(cfg, preview)
    if layered and ns.hicache_mem_layout != "layer_first":
        if ns.hicache_mem_layout != "page_first":  # (SGLang's default: replaced)
            raise ConfigError(f"--hicache-mem-layout: {', '.join(layered)} reads stored pages layer by layer "
                              f"(layer_first), got {ns.hicache_mem_layout}")
        ns.hicache_mem_layout = "layer_first"
        logger.info("sglang-tiered: --hicache-mem-layout layer_first (%s reads stored pages layer by layer)",
                    ", ".join(layered))
    hooked = hooked_prefills(cfg, preview)
    if hooked and chosen is None and not (getattr(ns, "disable_prefill_cuda_graph", False)
                                          or getattr(ns, "disable_cuda_graph", False)):
        ns.disable_prefill_cuda_graph = True
        logger.info("sglang-tiered: --disable-prefill-cuda-graph (%s computes prefills in SGLang's forward, which a "
                    "replayed prefill graph runs past; decode graphs stay)", ", ".join(hooked))


def prefill_graph_backend(ns: argparse.Namespace) -> Optional[str]:
    """The prefill CUDA graph backend the operator chose (`--cuda-graph-config`'s prefill backend over
    `--cuda-graph-backend-prefill`, as SGLang ranks them), or None."""
    config = getattr(ns, "cuda_graph_config", None)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            config = None  # (SGLang reports it)
    prefill = config.get("prefill") if isinstance(config, dict) else None
    if isinstance(prefill, dict) and prefill.get("backend") is not None:
        return str(prefill["backend"])
    return getattr(ns, "cuda_graph_backend_prefill", None)


def _runahead_settings(ns: argparse.Namespace, cfg: TieredConfig, hf: dict | None) -> tuple[int, str]:
    """Check that chained prefill can run with these SGLang settings; (threads per helper rank, partition table)."""
    if cfg.runahead_ranks < 2:
        return 1, ""
    flag = "--tiered-runahead-ranks"
    for attr, name in (("tp_size", "--tp-size"), ("pp_size", "--pp-size"), ("dp_size", "--dp-size")):
        if (getattr(ns, attr, 1) or 1) != 1:
            raise ConfigError(f"{flag}: needs {name} 1 (every chain rank holds the whole model)")
    if hf is None:
        raise ConfigError(f"{flag}: the helper ranks load the model from a local directory; {ns.model_path} is not one")
    table = cfg.runahead_partitions or (str(default_partitions_path()) if default_partitions_path().is_file() else "")
    threads = cfg.runahead_threads or max(1, (os.cpu_count() or 1) // cfg.runahead_ranks)
    return threads, str(Path(table).expanduser()) if table else ""
