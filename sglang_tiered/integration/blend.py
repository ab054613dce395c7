"""Scheduler side of blending (CacheBlend): a prompt marked with chunk separators (split in blend_prompt.py) is
prefilled by `engine.blend.blend_prefill` on the server's own weights, reusing each chunk's stored KV wherever the
chunk appears.

Seams (listed in plugin.py), registered in scheduler processes unless `--tiered-blend` is `off` or `prefix` (the
separator is removed by blend_prompt.py and the prefill is SGLang's own):
* a marked request to be blended prefills alone (`model_forward.prefill_alone`, the admission hook): it joins no
  prefill batch that already has a request and nothing joins its batch (`policy.admission`: it stays queued for
  the next round), so concurrent marked requests are each blended instead of falling back. With
  `--enable-mixed-chunk` decode rows still share its batch: it falls back. A marked request whose cached prefix
  covers every whole page of its chunks (a follow-up turn over blended KV) is not blended: SGLang extends it,
  batched like any request (`Blended`).
* `BlendHandler` on the shared Llama forward hook (model_forward.py): an extend batch of exactly one marked
  request (no prompt-token logprobs, TP = PP = 1, nothing our engine cannot compute: `model_forward.engine_declines`).
  Tokens already in the request's KV slots -- a radix-cache hit, or the earlier pieces of a chunked prefill -- are
  read from the KV pool and never recomputed; the span plan (`engine.blend_plan.plan_spans`) reuses a chunk cut by
  them from its first token after them, and a chunk cut by the end of a piece up to it. The chunks seen for the
  first time get their standalone KV computed (each at positions from 0, all in one pass: `chunk_kv`) and stored in
  the store's `ChunkStore` (memory LRU of `--tiered-blend-memory` bytes + write-through to the SSD tier, one
  capacity with every other file), each keyed by its tokens and the request's tenant seed (`keys.tenant_seed`:
  chunks never cross `cache_salt` or `extra_key`, so nor LoRA adapters). The blended KV is written into the
  request's KV slots; the final hidden state of the last token goes back to SGLang's logits processor, so sampling
  and decoding proceed normally.
* Blended KV enters the radix tree -- and moves to host and SSD like any page -- under a namespace of its own: at
  admission, before its first match, a marked request's `extra_key` is extended with the blend configuration (mode,
  ratio, selection: `namespace`), as SGLang's own elastic-EP namespacing does. An identical repeat or a follow-up
  turn then gets a prefix hit on exactly the KV the model saw the first time; the same tokens sent unmarked, or
  under another configuration or tenant (`cache_salt`, `extra_key`), match none of it. The prompt's last partial
  page (which a repeat's page-granular match stops short of) is computed fresh, so a repeat computes what the first
  ask computed there (a prompt shorter than a page is never matched: a repeat blends it again, the same way).

Logs one line per blended forward (`tiered blend: ...`) or fallback; Prometheus counters `sglang_tiered:blend_*`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang_tiered.engine.blend import blend_prefill, observe
from sglang_tiered.engine.blend_plan import plan_spans
from sglang_tiered.integration import model_forward
from sglang_tiered.integration.door import matched
from sglang_tiered.integration.keys import tenant_seed
from sglang_tiered.integration.requests import options
from sglang_tiered.policy.loading import LoadingController
from sglang_tiered.storage.chunk_store import ChunkMiss, ChunkStore, chunk_key

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")


def is_marked(req) -> bool:
    return options(req).chunks is not None


class Blended:
    """The prompts this process blended (a hash of the token ids and the tenant's seed), the most recent
    `capacity`. A forward is blended when chunk tokens are left after its cached prefix beyond the last whole page
    of the chunks (the radix tree holds whole pages only, so a follow-up turn over a blended prompt matches up to
    that page and no further: its few chunk tokens left are SGLang's own extend, exact and batched like any
    request); so are the later pieces of a blended request's chunked prefill (its prompt is recorded after the first
    piece), and an identical repeat's forward (the prompt's last partial page after a match on its blended pages:
    blended as the first ask computed it, so it answers the same)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def blends(self, req, prefix: int, page_size: int) -> bool:
        parts = options(req).chunks
        if parts is None:
            return False
        if prompt_key(req) in self._keys:  # a repeat, or a later piece of a blended chunked prefill
            return True
        whole_pages = sum(parts[:-1]) // page_size * page_size
        return prefix == 0 or prefix < whole_pages

    def add(self, req) -> None:
        key = prompt_key(req)
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


def prompt_key(req) -> str:
    if not hasattr(req, "tiered_prompt_key"):
        req.tiered_prompt_key = chunk_key(req.origin_input_ids, chunk_seed(req))
    return req.tiered_prompt_key


class _Runtime:
    """Per scheduler process: the engine over SGLang's weights, the store's chunk KV, the loading controller."""

    def __init__(self, rt: Runtime, module) -> None:
        cfg = rt.settings.config
        self.engine = rt.forward.engine(module)
        if rt.store is None:
            raise NotImplementedError("no store in this process (the storage class did not open one)")
        self.store: ChunkStore = rt.store.chunks
        self.page_size = rt.store.page_size  # a repeat's radix match covers whole pages only
        c, dtype = self.engine.cfg, self.engine.dtype
        if self.store.dtype != dtype:
            raise NotImplementedError(f"the KV cache is {self.store.dtype}, the model {dtype}: blending computes "
                                      "chunk KV in the model's dtype")
        self.controller = LoadingController(floor=cfg.blend_ratio)
        self.token_layer_bytes = c.geometry(dtype.itemsize).token_layer_bytes
        self.mode, self.ratio = cfg.blend, cfg.blend_ratio
        self.select, self.window, self.position_tokens = cfg.blend_select, cfg.importance_window, \
            cfg.blend_position_tokens


class BlendHandler(model_forward.ForwardHandler):
    name = "blend"

    def __init__(self, rt: Runtime) -> None:
        super().__init__(rt)
        self.blended = Blended()

    def build_runtime(self, module) -> _Runtime:
        return _Runtime(self.rt, module)

    def forward(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        if not fb.rids:
            return None
        page = self.page_size()
        marked = [x.req for x in self.rt.forward.extends(fb) if x.req is not None
                  and self.blended.blends(x.req, x.prefix, page)]
        if not marked:
            return None
        req = marked[0]
        why = f"its prefill batch holds {fb.batch_size} requests" if fb.batch_size > 1 else self._unsupported(module,
                                                                                                            req)
        rt = self.runtime(module) if why is None else None
        if why is None and rt is None:
            why = f"blending is disabled in this process: {self.disabled}"
        if why is None:
            try:
                return self._blended_forward(rt, req, fb)
            except ChunkMiss as exc:  # a stored chunk vanished or failed its checksum: counted by the store
                why = f"chunk KV unavailable: {exc}"
        self.fallback([r.rid for r in marked], why)
        return None

    def prefills_alone(self, req) -> bool:
        """The admission predicate: a request whose forward will be blended prefills alone."""
        return self.blended.blends(req, matched(req), self.page_size())

    def page_size(self) -> int:
        return self.rt.store.page_size if self.rt.store is not None else 1

    def _unsupported(self, module, req) -> Optional[str]:
        declined = self.declines(req)
        if declined is not None:
            return declined
        if model_forward.wants_input_logprobs(req):
            return "input logprobs were requested"
        if not model_forward.whole_model_in_rank(module):
            return "pipeline parallelism"
        return None

    @torch.inference_mode()
    def _blended_forward(self, rt: _Runtime, req: Any, fb) -> torch.Tensor:
        hidden = _blended_forward(rt, self.rt.events, req, fb)
        self.blended.add(req)
        return hidden


@torch.inference_mode()
def _blended_forward(rt: _Runtime, events, req: Any, fb) -> torch.Tensor:
    t0 = time.perf_counter()
    eng, store = rt.engine, rt.store
    lengths = list(options(req).chunks)
    ids_list = list(req.origin_input_ids)
    prefix = int(fb.extend_prefix_lens_cpu[0])
    end = prefix + int(fb.extend_seq_lens_cpu[0])  # < len(ids_list) for a piece of a chunked prefill
    ids = torch.tensor(ids_list[:end], dtype=torch.int64)

    whole_pages = (len(ids_list) - 1) // rt.page_size * rt.page_size  # what a repeat's radix match can cover
    spans, refs = plan_spans(lengths, prefix, end, ids_list, seed=chunk_seed(req), fresh_from=whole_pages or None)
    new = [r for r in {r.key: r for r in refs if r is not None}.values() if not store.contains(r.key)]
    if new:  # chunks seen for the first time: their own KV, in one pass, stored
        chunks = [torch.tensor(ids_list[r.start : r.start + r.length], dtype=torch.int64) for r in new]
        for ref, kv in zip(new, eng.chunk_kv(chunks)):
            store.put(ref.key, kv)
    new_chunks = len(new)
    reused = sum(sp.length for sp in spans if sp.stored)
    ratio = rt.controller.ratio(reused, rt.token_layer_bytes) if rt.mode == "blend" else rt.ratio

    def load(layer: int, j: int) -> torch.Tensor:
        sp, ref = spans[j], refs[j]
        return store.layer(ref.key, layer, ref.length)[sp.offset : sp.offset + sp.length]

    # a loader thread hides reads from the SSD and copies to a GPU; with every chunk in memory on a CPU it only
    # takes cores from the layers' compute (a 1,355-token HotpotQA prompt, two threads: 0.21 s with it, 0.19 s without)
    overlap = eng.device.type != "cpu" or not all(store.in_memory(r.key) for r in refs if r is not None)
    t1 = time.perf_counter()
    res = blend_prefill(eng, ids, spans, load, mode=rt.mode, ratio=ratio, prefix_len=prefix,
                        prefix_loader=model_forward.prefix_kv_reader(fb) if prefix else None,
                        select=rt.select, window=rt.window, position_tokens=rt.position_tokens, overlap=overlap)
    t_blend = time.perf_counter() - t1
    observe(rt.controller, res, reused, rt.token_layer_bytes, t_blend)

    hidden = model_forward.write_extend(fb, eng, res.kv[:, prefix:], res.hidden)
    if end == len(ids_list):  # the last piece: one request
        events.count("blend_requests")
    events.count("blend_reused_tokens", reused)
    events.count("blend_new_chunks", new_chunks)
    logger.info(
        "tiered blend: rid %s tokens=%d extend=[%d,%d) chunks=%d (new %d) reused=%d mode=%s select=%s ratio=%.3f "
        "computed=%.3f load_wait=%.3fs blend=%.3fs total=%.3fs store_hits=%s",
        req.rid, len(ids_list), prefix, end, sum(sp.stored for sp in spans), new_chunks, reused, rt.mode, rt.select,
        ratio, res.recompute_fraction, res.load_wait_s, t_blend, time.perf_counter() - t0, store.hits)
    return hidden


def namespace_tag(cfg) -> str:
    """The radix namespace of KV blended under the configuration `cfg` (a `TieredConfig`)."""
    tag = f"tiered-blend:{cfg.blend}:{cfg.blend_ratio:g}:{cfg.blend_select}"
    return tag + (f":{cfg.blend_position_tokens}" if cfg.blend_select == "position" else "")


class Namespace:
    """Extends a marked request's `extra_key` with the blend namespace, once (the door calls it at every
    admission, a retraction's re-admission included)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, req) -> None:
        if not is_marked(req) or getattr(req, "tiered_blend_namespace", False):
            return
        req.tiered_chunk_seed = tenant_seed(req)  # chunk KV is exact: keyed by the tenant, not the blend namespace
        req.extra_key = f"{req.extra_key}|{self.tag}" if req.extra_key else self.tag
        req.tiered_blend_namespace = True


def chunk_seed(req) -> Optional[str]:
    """The seed of `req`'s chunk keys: its tenant's, as it was before the blend namespace extended `extra_key`."""
    return req.tiered_chunk_seed if hasattr(req, "tiered_chunk_seed") else tenant_seed(req)


def register_hooks(rt: Runtime) -> bool:
    """The scheduler-side hooks, in processes of a server with blending on. Returns True if registered."""
    current = rt.settings
    if current is None or not current.blend_on:
        return False
    if current.config.blend == "prefix":  # the separator is removed; the prefill is SGLang's own
        return False
    rt.door.namespacers.append(Namespace(namespace_tag(current.config)))
    handler = BlendHandler(rt)
    rt.forward.prefill_alone(handler.prefills_alone)
    rt.forward.add_handler(handler)
    return True
