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
Scheduler processes of a `--kv-backend tiered` server (each mechanism's hooks are methods of one object, kept in
the process's `runtime.Runtime`):
* `TorchNativeAttnBackend._run_sdpa_forward_extend/_decode` (AROUND, `cpu_attention.py`), only without CUDA and
  with `--tiered-cpu-attention prefix_aware` (the default).
* `models.llama.LlamaModel.forward` and `TpModelWorker.forward_batch_generation` (AROUND, `model_forward.py`): one
  forward hook whose handlers are, in order, blend (`blend.py`, unless `--tiered-blend off|prefix`), sparse
  (`sparse.py`, with `--tiered-importance-load gated`), kvpr (`kvpr.py`, with `--tiered-kvpr auto|force` on a
  model whose activations are smaller than its KV) and runahead (`runahead.py`, with `--tiered-runahead-ranks` >=
  2), and one observer of SGLang's own extend forwards (sparse: offers each prefilled prompt's pages to the
  repacker); registered with the first handler, or on CPU-only servers (where every forward is marked as foreground work
  that the SSD write-through waits for).
* `PrefillAdder.add_one_req` (AROUND, `model_forward.py`): a request marked for blending, or whose stored span a
  loader took at the door, prefills alone: it closes a prefill batch that has a request and stays queued for the
  next round (`policy/admission.py`).
* `Scheduler._prefetch_kvcache` (AROUND, `door.py`): the one door for stored spans -- which loader (SGLang's L3
  prefetch, sparse, kvpr) serves a request's stored span, decided once per admission into `req.tiered_load` -- and
  retention pins (`custom_params.tiered_retain`).
* `models.llama.LlamaAttention.forward` (AROUND, `kvpr.py`, read-only: copies the attention inputs to store them)
  and `TorchNativeAttnBackend.forward_decode` (AROUND, `cpu_attention.py`: the layer and requests of a decode step,
  so decoding skips the prefix positions a sparse load did not fill), with their mechanisms.
"""

from __future__ import annotations

import argparse
import logging

from sglang_tiered.integration import runtime

logger = logging.getLogger("sglang_tiered")


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
    rt = runtime.process()
    if rt.registered:
        return
    rt.registered = True
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
        kvpr,
        requests,
        runahead,
        sparse,
    )
    from sglang_tiered.integration.door import Door
    from sglang_tiered.integration.model_forward import ForwardHook

    blend_prompt.register_hooks(rt)  # launcher: act per request once the flags are known
    requests.register_hooks(rt)
    cpu_attention.register_hooks(rt)
    current = rt.settings
    if current is None:  # the launcher (flags not parsed yet) or a server without --kv-backend tiered
        return
    rt.forward = ForwardHook(rt)
    if current.cpu_only:  # every forward is foreground work the SSD write-through yields to
        rt.forward.gate_background_writes()
    rt.door = Door(rt)
    rt.door.register()
    blend.register_hooks(rt)  # blend first: a marked prompt is neither loaded sparsely nor chained
    sparse.register_hooks(rt)  # the door's loaders, in order: sparse, then kvpr
    kvpr.register_hooks(rt)
    runahead.register_hooks(rt)
