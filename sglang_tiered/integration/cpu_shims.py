"""Compatibility shims that let stock SGLang 0.5.23 serve (hierarchical cache included) on a machine without CUDA.

Each shim is applied only when `torch.cuda.is_available()` is False; on a CUDA machine `apply_early()` and
`apply_in_process()` change nothing. What each one does, and what it refuses:

* `SGLANG_USE_CPU_ENGINE=1` (SGLang's own switch for its CPU engine) is set for this process and its children.
* `sgl_kernel` stand-in (`cpu_stubs/`) on `sys.path`/`PYTHONPATH` when no real one imports: its functions raise
  NotImplementedError (speculative decoding, the AMX path).
* (torchvision is not a shim: PyPI's build is linked against CUDA torch and `import sglang` imports it before any
  plugin runs, so a CPU install must leave it out; scripts/setup.sh does.)
* Host KV pool allocated without `pin_memory` (pinning needs CUDA).
* `transfer_kv_direct` for host<->device copies in `pool_host/mha.py`, in torch (the only copy op the
  `direct` I/O backend with the `layer_first` layout needs; `--kv-backend tiered` refuses other layouts at startup,
  see `integration/server_flags.py`), and the two `page_first_direct` copies (`transfer_kv_all_layer_direct_lf_pf`,
  `transfer_kv_per_layer_direct_pf_lf`), which SGLang's own Mooncake L3 backend switches to: they let that backend
  run on a CPU server as the baseline of `benchmarks/shared_store.py`.
* `torch.cpu.Stream.synchronize/query`, which SGLang's transfer code calls (CPU work is synchronous).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

STUB_DIR = str(Path(__file__).parent / "cpu_stubs")
CPU_IO_BACKEND = "direct"
CPU_MEM_LAYOUT = "layer_first"


def cuda_absent() -> bool:
    import torch

    return not torch.cuda.is_available()


def apply_early() -> None:
    """Environment for this process and every SGLang child process. Call before SGLang spawns anything."""
    if not cuda_absent():
        return
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    _clear_is_cpu_cache()
    if importlib.util.find_spec("sgl_kernel") is None or _stub_is_loaded():
        if STUB_DIR not in sys.path:
            sys.path.insert(0, STUB_DIR)
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if STUB_DIR not in parts:
            os.environ["PYTHONPATH"] = os.pathsep.join([STUB_DIR, *parts])


def apply_in_process() -> None:
    """Patches of SGLang objects. Idempotent; call in every process after `apply_early`."""
    if not cuda_absent():
        return
    import torch

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]
    if not hasattr(torch.cpu.Stream, "query"):
        torch.cpu.Stream.query = lambda self: True  # type: ignore[attr-defined]

    from sglang.srt.mem_cache.pool_host import base as host_base
    from sglang.srt.mem_cache.pool_host import mha as host_mha

    if not getattr(host_base.HostKVCache.__init__, "_tiered_unpinned", False):
        original_init = host_base.HostKVCache.__init__

        def init_unpinned(self, *args, **kwargs):
            if "pin_memory" in kwargs:
                kwargs["pin_memory"] = False
            else:
                args = _replace_positional(original_init, args, "pin_memory", False)
            return original_init(self, *args, **kwargs)

        init_unpinned._tiered_unpinned = True  # type: ignore[attr-defined]
        host_base.HostKVCache.__init__ = init_unpinned
    for name, fn in (("transfer_kv_direct", transfer_kv_direct),
                     ("transfer_kv_all_layer_direct_lf_pf", transfer_kv_all_layer_direct_lf_pf),
                     ("transfer_kv_per_layer_direct_pf_lf", transfer_kv_per_layer_direct_pf_lf)):
        if not hasattr(host_mha, name):
            setattr(host_mha, name, fn)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """Torch version of sgl_kernel's op: for each layer pair, dst[dst_indices] = src[src_indices] along dim 0."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers vs {len(dst_layers)} destination")
    src_idx = src_indices.to(device=src_layers[0].device, dtype=_long())
    dst_idx = dst_indices.to(device=dst_layers[0].device, dtype=_long())
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx).to(dst.device))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int) -> None:
    """Device (per-layer K buffers then V buffers, [tokens, heads, dim]) -> host `page_first_direct` K and V
    ([pages, layers, page_size, heads, dim]): host slot i of every layer = device slot i of that layer."""
    layers = len(src_ptrs) // 2
    host_k, host_v = dst_ptrs
    src_idx = src_indices.to(device=src_ptrs[0].device, dtype=_long())
    dst_idx = dst_indices.to(device=host_k.device, dtype=_long())
    page, offset = dst_idx // page_size, dst_idx % page_size
    for layer in range(layers):
        for src, host in ((src_ptrs[layer], host_k), (src_ptrs[layers + layer], host_v)):
            host[:, layer][page, offset] = src.index_select(0, src_idx).to(host.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int,
                                       page_size: int) -> None:
    """Host `page_first_direct` K and V of one layer -> that layer's device K and V buffers."""
    src_idx = src_indices.to(device=src_ptrs[0].device, dtype=_long())
    dst_idx = dst_indices.to(device=dst_ptrs[0].device, dtype=_long())
    page, offset = src_idx // page_size, src_idx % page_size
    for host, dst in zip(src_ptrs, dst_ptrs):
        dst.index_copy_(0, dst_idx, host[:, layer_id][page, offset].to(dst.device))


def _long():
    import torch

    return torch.int64


def _replace_positional(fn, args: tuple, name: str, value) -> tuple:
    import inspect

    params = [p for p in inspect.signature(fn).parameters][1:]  # drop self
    if name in params and params.index(name) < len(args):
        args = list(args)
        args[params.index(name)] = value
        return tuple(args)
    return args


def _clear_is_cpu_cache() -> None:
    mod = sys.modules.get("sglang.srt.utils.common")
    fn = getattr(mod, "is_cpu", None) if mod else None
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()


def _stub_is_loaded() -> bool:
    mod = sys.modules.get("sgl_kernel")
    return bool(mod is not None and getattr(mod, "SGLANG_TIERED_STUB", False))
