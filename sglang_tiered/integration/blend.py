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
* `PrefillAdder.add_one_req` (AROUND, scheduler): a marked request prefills alone -- it joins no prefill batch that
  already has a request and nothing joins its batch (the refused request waits for the next round) -- so concurrent
  marked requests are each fused instead of falling back. Not with `--enable-mixed-chunk` (decode rows share the
  batch: falls back).
* `models.llama.LlamaModel.forward` (AROUND, scheduler; the hook shared with chained prefill, see
  model_forward.py): an extend batch of exactly one marked request (no input logprobs, TP = PP = 1) runs through
  `engine.fusion.fuse` on the server's own weights (views, no copy). Tokens already in the request's KV slots --
  a radix-cache hit, or the earlier pieces of a chunked prefill -- are read from the KV pool and never recomputed;
  a chunk they cut through is reused from its first token after them, and a chunk cut by the end of a piece up to
  it (the stored KV of a chunk's first k tokens does not depend on the rest). The piece's last token is always
  computed. A chunk seen for the first time gets its standalone KV computed (a prefill
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


def _is_marked(req) -> bool:
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    return PARAM in custom


def _around_add_one_req(original, self, req, *args, **kwargs):
    """A marked request prefills alone (fusion runs on extend batches of one request): it does not join a prefill
    batch that already has a request, and nothing joins one it is in. The refused request waits for the next round,
    as when the token budget runs out."""
    if self.can_run_list and (_is_marked(req) or any(_is_marked(r) for r in self.can_run_list)):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER
    return original(self, req, *args, **kwargs)


def _marked_reqs(fb) -> list[Any]:
    """The marked requests of an extend batch (fused only if it is the batch's one request)."""
    if not fb.forward_mode.is_extend() or not fb.rids:
        return []
    by_rid = getattr(_batch_reqs, "by_rid", {})
    return [r for r in (by_rid.get(rid) for rid in fb.rids) if _is_marked(r)]


def try_forward(module, input_ids, positions, fb) -> Optional[torch.Tensor]:
    """The fused forward of a marked request (see the module docstring), or None: SGLang's own forward runs."""
    global _runtime, _runtime_error
    settings = BlendSettings.from_env()
    if settings is None or settings.mode in ("off", "prefix") or _runtime_error is not None:
        return None
    marked = _marked_reqs(fb)
    if not marked:
        return None
    req = marked[0]
    why = f"its prefill batch holds {fb.batch_size} requests" if fb.batch_size > 1 else _unsupported(module, req, fb)
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
    metrics.count("blend_fallbacks", len(marked))
    logger.info("tiered blend: rid %s runs a normal prefill (%s)", " ".join(r.rid for r in marked), why)
    return None


def _unsupported(module, req, fb) -> Optional[str]:
    if req.return_logprob:
        return "input logprobs were requested"
    if not model_forward.whole_model_in_rank(module):
        return "pipeline parallelism"
    if sum(req.sampling_params.custom_params[PARAM]) != len(req.origin_input_ids):
        return "chunk lengths do not match the prompt"
    return None


@dataclass(frozen=True)
class ChunkRef:
    """A reusable chunk of the prompt: its store key (hash of all its tokens) and where it lies in the prompt."""

    key: str
    start: int  # the chunk's first token (prompt position)
    length: int  # all of the chunk's tokens, also those outside the piece being prefilled


def plan_spans(lengths: list[int], prefix: int, end: int,
               ids: list[int]) -> tuple[list[Span], list[Optional[ChunkRef]]]:
    """Spans tiling [prefix, end) -- the tokens this forward prefills: the whole prompt after its cached prefix, or
    one piece of a chunked prefill -- and each span's chunk (None for fresh spans). Every part but the last is a
    reusable chunk: its tokens inside [prefix, end) are a stored span (`offset` = its tokens before `prefix`). The last
    part (the question) is fresh, and so is the forward's last token (its hidden state gives the logits)."""
    spans: list[Span] = []
    refs: list[Optional[ChunkRef]] = []
    pos = 0
    for i, n in enumerate(lengths):
        lo, hi = max(pos, prefix), min(pos + n, end)
        if hi > lo and i < len(lengths) - 1:
            ref = ChunkRef(chunk_key(ids[pos : pos + n]), pos, n)
            cut = hi - 1 if hi == end else hi
            if cut > lo:
                spans.append(Span(lo, cut, True, lo - pos))
                refs.append(ref)
            if cut < hi:
                spans.append(Span(cut, hi, False))
                refs.append(None)
        elif hi > lo:
            spans.append(Span(lo, hi, False))
            refs.append(None)
        pos += n
    return spans, refs


@torch.inference_mode()
def _fused_forward(rt: _Runtime, req, fb) -> torch.Tensor:
    t0 = time.perf_counter()
    eng, store, s = rt.engine, rt.store, rt.settings
    lengths = list(req.sampling_params.custom_params[PARAM])
    ids_list = list(req.origin_input_ids)
    prefix = int(fb.extend_prefix_lens_cpu[0])
    end = prefix + int(fb.extend_seq_lens_cpu[0])  # < len(ids_list) for a piece of a chunked prefill
    ids = torch.tensor(ids_list[:end], dtype=torch.int64)

    spans, refs = plan_spans(lengths, prefix, end, ids_list)
    new_chunks = 0
    for ref in {r.key: r for r in refs if r is not None}.values():  # a chunk seen for the first time: stored
        if not store.contains(ref.key):
            chunk = torch.tensor(ids_list[ref.start : ref.start + ref.length], dtype=torch.int64)
            store.put(ref.key, eng.prefill(chunk).kv)
            new_chunks += 1
    reused = sum(sp.length for sp in spans if sp.stored)
    ratio = rt.controller.ratio(reused, rt.bytes_per_token_layer) if s.mode == "blend" else s.ratio

    def load(layer: int, j: int) -> torch.Tensor:
        sp, ref = spans[j], refs[j]
        return store.layer(ref.key, layer, ref.length)[sp.offset : sp.offset + sp.length]

    t1 = time.perf_counter()
    res = fuse(eng, ids, spans, load, mode=s.mode, ratio=ratio, prefix_len=prefix,
               prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None)
    t_fuse = time.perf_counter() - t1
    rt.controller.observe_fusion(res, reused, rt.bytes_per_token_layer, t_fuse)

    hidden = model_forward.write_extend(fb, eng, res.kv[:, prefix:], res.hidden)
    req.skip_radix_cache_insert = True  # also keeps the pieces of a chunked prefill out of the tree
    last_piece = end == len(ids_list)
    if last_piece:
        metrics.count("blend_requests")
    metrics.count("blend_reused_tokens", reused)
    metrics.count("blend_new_chunks", new_chunks)
    logger.info(
        "tiered blend: rid %s tokens=%d extend=[%d,%d) chunks=%d (new %d) reused=%d mode=%s ratio=%.3f "
        "computed=%.3f load_wait=%.3fs fuse=%.3fs total=%.3fs store_hits=%s",
        req.rid, len(ids_list), prefix, end, sum(sp.stored for sp in spans), new_chunks, reused, s.mode, ratio,
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
    if settings.mode != "prefix":  # "prefix" is SGLang's own prefill: nothing to keep apart
        HookRegistry.register("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", _around_add_one_req,
                              HookType.AROUND)
    model_forward.add_handler(try_forward)
    return True
