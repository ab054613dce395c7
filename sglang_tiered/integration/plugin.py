"""Entry point of the `sglang.srt.plugins` group; SGLang runs `register()` in every one of its processes.

Seams with SGLang (the complete list; nothing else in SGLang is touched):
* `ServerArgs.add_cli_args` (AFTER hook): `--kv-backend` and `--tiered-*` in SGLang's parser and `--help`.
* `ServerArgs.from_cli_args` (AROUND hook): translate `--kv-backend tiered` into SGLang fields
  (`server_flags.translate`).
* `register_radix_cache_backend("tiered", ...)`: `radix_cache.TieredRadixCache`.
* `--hicache-storage-backend dynamic` naming `storage_backend.TieredSSDStorage`.
* CPU shims (`cpu_shims.py`), only when CUDA is absent.
* `TorchNativeAttnBackend._run_sdpa_forward_extend/_decode` (AROUND hooks, `cpu_attention.py`), only when CUDA is
  absent and `--tiered-cpu-attention prefix_aware` (the default with `--kv-backend tiered`).
* Fusion of chunk KV (`blend.py`): `TokenizerManager._tokenize_one_request` (BEFORE) and
  `serving_chat.parallel_prompt_encode` (AROUND) always (they act only when fusion is on); unless
  `--tiered-blend off`: `TpModelWorker.forward_batch_generation` (AROUND), `PrefillAdder.add_one_req` (AROUND, not
  in mode `prefix`), and a handler of the `models.llama.LlamaModel.forward` hook.
* Chained prefill (`runahead.py`, with `--tiered-runahead-ranks` >= 2): a handler of the same forward hook.
* `models.llama.LlamaModel.forward` (AROUND, `model_forward.py`): one hook, registered with the first handler or on
  CPU-only servers (where every forward is marked as foreground work that the SSD write-through waits for);
  handlers that decline leave the batch to SGLang's own forward.
"""

from __future__ import annotations

import argparse
import logging
import os

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
    from sglang_tiered.integration import cpu_attention

    cpu_attention.register_hooks()
    if os.environ.get(cpu_attention.ENV) and cpu_shims.cuda_absent():  # a CPU-only server with --kv-backend tiered
        from sglang_tiered.integration import model_forward

        model_forward.gate_background_writes()
    from sglang_tiered.integration import blend, runahead

    blend.register_hooks()  # fusion first: a marked prompt is never chained
    runahead.register_hooks()
