"""Entry point of the `sglang.srt.plugins` group; SGLang runs `register()` in every one of its processes.

Every seam with SGLang, in one list (nothing else in SGLang is touched; each module's docstring says what its
hooks do). Launcher process (where plugins load before the flags are parsed):
* `ServerArgs.add_cli_args` (AFTER): `--kv-backend` and `--tiered-*` in SGLang's parser and `--help`.
* `ServerArgs.from_cli_args` (AROUND): translate `--kv-backend tiered` into SGLang fields, choose the CPU dtype,
  publish our settings to every process (`server_flags.translate`, `settings.publish`).
* `TokenizerManager._tokenize_one_request` (BEFORE) and `serving_chat.parallel_prompt_encode` (AROUND): split
  prompts marked with the chunk separator (`blend_prompt.py`).
* `TokenizerManager._validate_one_request` (BEFORE): bad requests get a 400 (`requests.py`).
Every process:
* `register_radix_cache_backend("tiered", ...)`: `radix_cache.TieredRadixCache`.
* `--hicache-storage-backend dynamic` naming `storage_backend.TieredSSDStorage` (constructed by SGLang).
* CPU shims (`cpu_shims.py`), only when CUDA is absent.
Scheduler processes of a `--kv-backend tiered` server:
* `TorchNativeAttnBackend._run_sdpa_forward_extend/_decode` (AROUND, `cpu_attention.py`), only without CUDA and
  with `--tiered-cpu-attention prefix_aware` (the default).
* `models.llama.LlamaModel.forward` and `TpModelWorker.forward_batch_generation` (AROUND, `model_forward.py`): one
  forward hook whose handlers are blend (`blend.py`, unless `--tiered-blend off|prefix`) and runahead
  (`runahead.py`, with `--tiered-runahead-ranks` >= 2); registered with the first handler, or on CPU-only servers
  (where every forward is marked as foreground work that the SSD write-through waits for).
* `PrefillAdder.add_one_req` (AROUND, `blend.py`): a request marked for blending prefills alone.
* `layers.radix_attention.RadixAttention.forward` (AROUND, `importance.py`): scores prompt tokens for importance
  after SGLang's attention ran (read-only), with `--tiered-importance-heads` >= 1 (the default).
* With `--tiered-importance-load gated` (`sparse_load.py`): `Scheduler._prefetch_kvcache` (AROUND: a gated request
  skips SGLang's L3 prefetch), a handler of the forward hook, the prefill-alone admission, and
  `TorchNativeAttnBackend.forward_decode` (AROUND, `cpu_attention.py`: the layer and requests of a decode step, so
  decoding skips the prefix positions a sparse load did not fill).
* With `--tiered-kvpr auto|force` on a model whose activations are smaller than its KV (`kvpr.py`):
  `models.llama.LlamaAttention.forward` (AROUND, read-only: copies the attention inputs to store them),
  `Scheduler._prefetch_kvcache` (AROUND: a request split by the loader skips SGLang's L3 prefetch), a handler of
  the forward hook and the prefill-alone admission.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("sglang_tiered")
_registered = False


def _after_add_cli_args(result, *args, **kwargs):
    from sglang_tiered.integration.server_flags import add_cli_args

    parser = next((a for a in (*args, *kwargs.values()) if isinstance(a, argparse.ArgumentParser)), None)
    if parser is not None:
        add_cli_args(parser)
    return result


def _around_from_cli_args(original, *args, **kwargs):
    from sglang_tiered.integration.server_flags import translate

    ns = next((a for a in (*args, *kwargs.values()) if isinstance(a, argparse.Namespace)), None)
    if ns is not None:
        translate(ns)
    return original(*args, **kwargs)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tiered.integration import cpu_shims

    cpu_shims.apply_early()
    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, HookType.AROUND)

    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sglang_tiered.integration.radix_cache import BACKEND_NAME, build_tiered_radix_cache

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_tiered_radix_cache)
    cpu_shims.apply_in_process()
    from sglang_tiered.integration import (
        blend,
        blend_prompt,
        cpu_attention,
        importance,
        kvpr,
        model_forward,
        requests,
        runahead,
        settings,
        sparse_load,
    )

    blend_prompt.register_hooks()  # launcher: act per request once the flags are known
    requests.register_hooks()
    cpu_attention.register_hooks()
    current = settings.current()
    if current is not None and current.cpu_only:  # a scheduler of a CPU-only server with --kv-backend tiered
        model_forward.gate_background_writes()
    importance.register_hooks()
    blend.register_hooks()  # blend first: a marked prompt is neither loaded sparsely nor chained
    sparse_load.register_hooks()
    kvpr.register_hooks()
    runahead.register_hooks()
