"""Fusion of stored chunk KV (CacheBlend) inside the SGLang server.

Users mark chunk boundaries in a text prompt with the separator (`--tiered-blend-separator`, default `<|chunk|>`):
every part before the last separator is a chunk whose KV is reusable wherever it appears; the part after the last
separator (the question) is always computed. The separator itself never reaches the model.

Seams (all registered by `register_hooks`, only when `--tiered-blend` is not `off`; listed in plugin.py too):
* `TokenizerManager._tokenize_one_request` (BEFORE, launcher process): a text prompt containing the separator is
  split there, each part tokenized on its own (so a chunk's tokens do not depend on its neighbours), the ids
  concatenated into `input_ids`, and the part lengths put in `sampling_params.custom_params["tiered_chunks"]`.
  Works for `/generate`, `/v1/completions` and frontend programs (all send text).
* `serving_chat.parallel_prompt_encode` (AROUND, launcher): `/v1/chat/completions` renders the chat template to
  text and encodes it there; a rendered prompt containing the separator is split the same way, and the part
  lengths are remembered by token ids (LRU of 256) until the tokenizer hook above sees those ids. (Chat templates
  that SGLang encodes without rendering text first — lossy round trips, Python templates — are not split.)
* `TpModelWorker.forward_batch_generation` (AROUND, scheduler): remembers the batch's requests by rid.
* `models.llama.LlamaModel.forward` (AROUND, scheduler; the hook shared with chained prefill, see
  model_forward.py): an extend batch of exactly one marked request that
  prefills its whole prompt (no chunked prefill, no input logprobs, TP = PP = 1) runs through
  `engine.fusion.fuse` on the server's own weights (views, no copy). Tokens the radix cache already holds are read
  from the KV pool and never recomputed. A chunk seen for the first time gets its standalone KV computed (a prefill
  of the chunk at position 0, cost ~ the chunk's prefill) and stored in the `ChunkStore` (memory LRU of
  `--tiered-blend-memory` bytes + write-through to the SSD directory). The fused KV is written into the request's
  KV slots; the final hidden state of the last token goes back to SGLang's logits processor, so sampling and
  decoding proceed normally. Anything else goes to SGLang's own forward.
* The fused request is marked `skip_radix_cache_insert`: approximate KV never enters the radix tree, the host
  tier or the SSD page store, so later exact prefix hits stay exact.

Logs one line per fused request (`tiered blend: ...`); Prometheus counters `sglang_tiered:blend_*` (metrics.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from sglang_tiered.engine.fusion import Span, fuse
from sglang_tiered.integration import metrics, model_forward
from sglang_tiered.storage.chunk_store import ChunkMiss, ChunkStore, chunk_key

logger = logging.getLogger("sglang_tiered")

ENV = "SGLANG_TIERED_BLEND"
PARAM = "tiered_chunks"


@dataclass(frozen=True)
class BlendSettings:
    mode: str  # "off" or an engine.fusion mode
    separator: str
    ratio: float  # the quality floor r*
    memory_bytes: int
    ssd_dir: str
    ssd_capacity: int
    namespace: str
    model: str  # model fingerprint

    @classmethod
    def from_env(cls) -> Optional[BlendSettings]:
        return _parse(os.environ.get(ENV))


@functools.lru_cache(maxsize=4)
def _parse(raw: Optional[str]) -> Optional[BlendSettings]:
    return BlendSettings(**json.loads(raw)) if raw else None


def split_prompt(text: str, separator: str, encode) -> tuple[list[int], list[int]]:
    """(ids, part lengths) of `text` split at `separator`, each part encoded on its own; only the first part gets
    the tokenizer's special prefix tokens (BOS)."""
    ids: list[int] = []
    lengths: list[int] = []
    for i, part in enumerate(text.split(separator)):
        toks = encode(part, add_special_tokens=(i == 0))
        ids += toks
        lengths.append(len(toks))
    return ids, lengths


# ---------------------------------------------------------------------------------------------- launcher side
_CHAT_MEMORY = 256  # chat prompts whose chunk lengths wait for their request (one per request in flight)
_chat_chunks: OrderedDict[tuple, list[int]] = OrderedDict()
_chat_lock = threading.Lock()


def _mark(obj, lengths: list[int]) -> None:
    params = dict(obj.sampling_params or {})
    custom = dict(params.get("custom_params") or {})
    custom[PARAM] = lengths
    params["custom_params"] = custom
    obj.sampling_params = params


def _before_tokenize(self, obj, *args, **kwargs):
    settings = BlendSettings.from_env()
    if settings is None or settings.mode == "off":
        return None
    text = getattr(obj, "text", None)
    if obj.input_ids is not None:  # a chat prompt split by `_around_chat_encode`?
        if not isinstance(obj.input_ids, list) or not obj.input_ids or not isinstance(obj.input_ids[0], int):
            return None
        with _chat_lock:  # the same ids always split the same way: kept (LRU), not popped
            lengths = _chat_chunks.get(tuple(obj.input_ids))
        if lengths is None:
            return None
        _mark(obj, lengths)
        return (self, obj, *args), kwargs
    if not isinstance(text, str) or settings.separator not in text:
        return None
    ids, lengths = split_prompt(text, settings.separator, self.tokenizer.encode)
    obj.input_ids, obj.text = ids, None
    _mark(obj, lengths)
    return (self, obj, *args), kwargs


def _around_chat_encode(original, tokenizer, text, encode_kwargs=None):
    """/v1/chat/completions renders the chat template to text, then encodes it here: split a rendered prompt at the
    separator like a /generate text, and remember the part lengths for the request these ids will arrive in."""
    settings = BlendSettings.from_env()
    if settings is None or settings.mode == "off" or not isinstance(text, str) or settings.separator not in text:
        return original(tokenizer, text, encode_kwargs)
    first = dict(encode_kwargs or {})

    def encode(part: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(part, **(first if add_special_tokens else {"add_special_tokens": False}))

    ids, lengths = split_prompt(text, settings.separator, encode)
    with _chat_lock:
        _chat_chunks[tuple(ids)] = lengths
        while len(_chat_chunks) > _CHAT_MEMORY:
            _chat_chunks.popitem(last=False)
    return ids


# ---------------------------------------------------------------------------------------------- scheduler side
class _Runtime:
    """Per scheduler process: the engine over SGLang's weights, the chunk store, the loading controller."""

    def __init__(self, settings: BlendSettings, module) -> None:
        from sglang_tiered.scheduler.blend_controller import LoadingController
        from sglang_tiered.storage.namespace import Namespace
        from sglang_tiered.storage.ssd_tier import SSDTier

        self.settings = settings
        self.engine = model_forward.engine_from_sglang(module)
        c, dtype = self.engine.cfg, self.engine.dtype
        ns = Namespace(model=settings.model, dtype=str(dtype), page_size=0, layout="chunk-kv", layer_num=c.layers,
                       kv_heads=c.kv_heads, head_dim=c.head_dim, salt=settings.namespace)
        ssd = SSDTier(Path(settings.ssd_dir) / "chunks", ns, settings.ssd_capacity)
        self.store = ChunkStore(layers=c.layers, kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=dtype,
                                memory_bytes=settings.memory_bytes, ssd=ssd)
        self.controller = LoadingController(floor=settings.ratio)
        self.bytes_per_token_layer = 2 * c.kv_heads * c.head_dim * dtype.itemsize


_runtime: Optional[_Runtime] = None
_runtime_error: Optional[str] = None  # why fusion cannot run in this process (set once, then normal prefill)
_batch_reqs = threading.local()


def _around_worker(original, self, batch=None, *args, **kwargs):
    reqs = getattr(batch, "reqs", None) or []
    _batch_reqs.by_rid = {r.rid: r for r in reqs}
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _batch_reqs.by_rid = {}


def _marked_req(fb) -> Any:
    if not fb.forward_mode.is_extend() or fb.batch_size != 1 or not fb.rids:
        return None
    req = getattr(_batch_reqs, "by_rid", {}).get(fb.rids[0])
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    return req if PARAM in custom else None


def try_forward(module, input_ids, positions, fb) -> Optional[torch.Tensor]:
    """The fused forward of a marked request (see the module docstring), or None: SGLang's own forward runs."""
    global _runtime, _runtime_error
    settings = BlendSettings.from_env()
    if settings is None or settings.mode in ("off", "prefix") or _runtime_error is not None:
        return None
    req = _marked_req(fb)
    if req is None:
        return None
    why = _unsupported(module, req, fb)
    if why is None and _runtime is None:
        try:
            _runtime = _Runtime(settings, module)
        except NotImplementedError as exc:  # e.g. tensor parallelism: fusion off for this process
            _runtime_error = why = str(exc)
            logger.warning("tiered blend: disabled in this process: %s", exc)
    if why is None:
        try:
            return _fused_forward(_runtime, req, fb)
        except ChunkMiss as exc:  # a stored chunk vanished or failed its checksum: counted by the store
            why = f"chunk KV unavailable: {exc}"
    metrics.count("blend_fallbacks")
    logger.info("tiered blend: rid %s runs a normal prefill (%s)", req.rid, why)
    return None


def _unsupported(module, req, fb) -> Optional[str]:
    prefix, ext = fb.extend_prefix_lens_cpu[0], fb.extend_seq_lens_cpu[0]
    if prefix + ext != len(req.origin_input_ids):
        return "the prompt is split by chunked prefill"
    if req.return_logprob:
        return "input logprobs were requested"
    if not model_forward.whole_model_in_rank(module):
        return "pipeline parallelism"
    if sum(req.sampling_params.custom_params[PARAM]) != len(req.origin_input_ids):
        return "chunk lengths do not match the prompt"
    return None


def plan_spans(lengths: list[int], prefix: int, ids: list[int]) -> tuple[list[Span], list[Optional[str]]]:
    """Spans tiling [prefix, total) and each span's chunk key (None for fresh spans). Every part but the last is a
    reusable chunk if it lies wholly after the radix prefix; a part the prefix cuts through, and the last part (the
    question), are fresh."""
    spans: list[Span] = []
    keys: list[Optional[str]] = []
    pos = 0
    for i, n in enumerate(lengths):
        start, end = max(pos, prefix), pos + n
        if end > start:
            reusable = i < len(lengths) - 1 and start == pos
            spans.append(Span(start, end, reusable))
            keys.append(chunk_key(ids[start:end]) if reusable else None)
        pos = end
    return spans, keys


@torch.inference_mode()
def _fused_forward(rt: _Runtime, req, fb) -> torch.Tensor:
    t0 = time.perf_counter()
    eng, store, s = rt.engine, rt.store, rt.settings
    lengths = list(req.sampling_params.custom_params[PARAM])
    ids_list = list(req.origin_input_ids)
    ids = torch.tensor(ids_list, dtype=torch.int64)
    prefix = int(fb.extend_prefix_lens_cpu[0])

    spans, keys = plan_spans(lengths, prefix, ids_list)
    new_chunks = 0
    for sp, key in zip(spans, keys):  # a chunk seen for the first time: its standalone KV, stored
        if key is not None and not store.contains(key):
            store.put(key, eng.prefill(ids[sp.start : sp.end]).kv)
            new_chunks += 1
    reused = sum(sp.length for sp in spans if sp.stored)
    ratio = rt.controller.ratio(reused, rt.bytes_per_token_layer) if s.mode == "blend" else s.ratio

    def load(layer: int, j: int) -> torch.Tensor:
        return store.layer(keys[j], layer, spans[j].length)

    t1 = time.perf_counter()
    res = fuse(eng, ids, spans, load, mode=s.mode, ratio=ratio, prefix_len=prefix,
               prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None)
    t_fuse = time.perf_counter() - t1
    rt.controller.observe_fusion(res, reused, rt.bytes_per_token_layer, t_fuse)

    hidden = model_forward.write_extend(fb, eng, res.kv[:, prefix:], res.hidden)
    req.skip_radix_cache_insert = True
    metrics.count("blend_requests")
    metrics.count("blend_reused_tokens", reused)
    metrics.count("blend_new_chunks", new_chunks)
    logger.info(
        "tiered blend: rid %s tokens=%d radix_prefix=%d chunks=%d (new %d) reused=%d mode=%s ratio=%.3f "
        "computed=%.3f load_wait=%.3fs fuse=%.3fs total=%.3fs store_hits=%s",
        req.rid, len(ids_list), prefix, sum(sp.stored for sp in spans), new_chunks, reused, s.mode, ratio,
        res.recompute_fraction, res.load_wait_s, t_fuse, time.perf_counter() - t0, store.hits)
    return hidden


def register_hooks() -> bool:
    """The tokenizer hook always: in the launcher, plugins load before the flags are parsed, so whether fusion is on
    is only known per request (it checks the environment `translate` sets). The model hooks only in processes
    started with fusion on (schedulers inherit the environment). Returns True if the model hooks were registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request",
                          _before_tokenize, HookType.BEFORE)
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_chat.parallel_prompt_encode", _around_chat_encode,
                          HookType.AROUND)
    settings = BlendSettings.from_env()
    if settings is None or settings.mode == "off":
        return False
    HookRegistry.register("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", _around_worker,
                          HookType.AROUND)
    model_forward.add_handler(try_forward)
    return True
