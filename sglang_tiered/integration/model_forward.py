"""The one hook on SGLang's Llama forward and the base of the mechanisms that compute a prefill themselves
(`ForwardHandler`: blend in blend.py, runahead in runahead.py), plus the glue they share: our layer-by-layer
engine over SGLang's weights, the requests of the running batch, reading a cached prefix's KV from SGLang's pool and
writing an extend's KV into it.

Seams (listed with all others in plugin.py): `models.llama.LlamaModel.forward` (AROUND) and
`managers.tp_worker.TpModelWorker.forward_batch_generation` (AROUND, remembers the batch's requests by rid), both
in scheduler processes. For an extend batch without input embeddings or pipeline proxies, each registered handler
is asked in order; the first that returns a tensor has done the forward: the request's new KV is in its slots
(`forward_batch.out_cache_loc`) and the returned [extend tokens, hidden] tensor holds the final-normed hidden
state of the last token in its last row (the rows before it are zeros: SGLang's logits processor reads only the
last row unless input logprobs or hidden states were requested, which handlers must decline). A handler returns
None to leave the batch to SGLang's own forward. A handler that raises is logged and counted
(`sglang_tiered:hook_errors_total`) and the batch goes to SGLang's own forward: a failure of ours never takes the
scheduler down (nothing a handler wrote into the request's new slots survives SGLang's forward over them).
On CPU-only servers every forward (also SGLang's own) is marked as foreground work, so that the SSD write-through
yields to it (`gate_background_writes`, storage/foreground.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.integration import faults, metrics
from sglang_tiered.storage.foreground import FOREGROUND

logger = logging.getLogger("sglang_tiered")


class ForwardHandler:
    """A mechanism that may compute an extend forward itself. Subclasses set `name` (one word, the flag's:
    "blend", "runahead") and implement `build_runtime` and `forward`.

    * `build_runtime(module)`: per-process state (engine over SGLang's weights, stores, helper ranks), built at the
      first `runtime()` call. NotImplementedError, OSError or ValueError disable the handler in this process
      (logged once; `disabled` holds the reason).
    * `forward(module, input_ids, positions, forward_batch)`: the hidden states (see the module docstring) or None.
      It may raise: the hook then logs, counts and runs SGLang's forward.
    """

    name = "handler"

    def __init__(self) -> None:
        self._runtime: Any = None
        self.disabled: Optional[str] = None
        self._errors = 0

    def build_runtime(self, module) -> Any:
        raise NotImplementedError

    def forward(self, module, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def runtime(self, module) -> Any:
        """This process's runtime (built once), or None if the handler is disabled here."""
        if self._runtime is None and self.disabled is None:
            try:
                self._runtime = self.build_runtime(module)
            except (NotImplementedError, OSError, ValueError) as exc:  # e.g. tensor parallelism
                self.disabled = str(exc)
                logger.warning("tiered %s: disabled in this process: %s", self.name, exc)
        return self._runtime

    def fallback(self, rids: list[str], why: str) -> None:
        """Requests that get SGLang's normal prefill: logged and counted (`<name>_fallbacks`)."""
        metrics.count(f"{self.name}_fallbacks", len(rids))
        logger.info("tiered %s: rid %s runs a normal prefill (%s)", self.name, " ".join(rids) or "?", why)

    def __call__(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        try:
            faults.check(f"{self.name}_forward")
            return self.forward(module, input_ids, positions, fb)
        except Exception as exc:
            self._errors += 1
            metrics.count("hook_errors")
            rids = " ".join(fb.rids or [])
            if self._errors == 1:
                logger.exception("tiered %s: failed on rid %s; SGLang's own forward runs instead", self.name, rids)
            else:
                logger.error("tiered %s: failed on rid %s (%s, failure %d); SGLang's own forward runs instead",
                             self.name, rids, exc, self._errors)
            return None


_handlers: list[ForwardHandler] = []
_alone: list[Callable[[Any], bool]] = []
_admission_errors = 0
_engines: dict[int, LlamaModel] = {}
_batch = threading.local()
_hooked = False
_tracking = False


def _ensure_hook() -> None:
    global _hooked
    if not _hooked:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.models.llama.LlamaModel.forward", _around_forward, HookType.AROUND)
        track_batches()
        _hooked = True


def track_batches() -> None:
    """Make `batch_requests` work in this process (registers the worker hook once)."""
    global _tracking
    if not _tracking:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", _around_worker,
                              HookType.AROUND)
        _tracking = True


def add_handler(handler: ForwardHandler) -> None:
    """Register `handler` (once per name); the forward hook itself is registered once."""
    _ensure_hook()
    if all(h.name != handler.name for h in _handlers):
        _handlers.append(handler)


def prefill_alone(predicate: Callable[[Any], bool]) -> None:
    """Requests for which `predicate(req)` holds prefill alone (the handlers compute extend batches of one
    request): such a request joins no prefill batch that already has a request, and nothing joins its batch; the
    refused request waits for the next round, as when the token budget runs out. Seam (plugin.py):
    `PrefillAdder.add_one_req` (AROUND), registered with the first predicate."""
    if not _alone:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", _around_add_one_req,
                              HookType.AROUND)
    _alone.append(predicate)


def _around_add_one_req(original, self, req, *args, **kwargs):
    """If this check fails, SGLang's admission decides alone (logged and counted)."""
    global _admission_errors
    try:
        faults.check("admission")
        alone = bool(self.can_run_list) and any(p(req) or any(p(r) for r in self.can_run_list) for p in _alone)
    except Exception as exc:
        _admission_errors += 1
        metrics.count("hook_errors")
        if _admission_errors == 1:
            logger.exception("tiered: admission check failed; SGLang admits the request on its own")
        else:
            logger.error("tiered: admission check failed (%s, failure %d)", exc, _admission_errors)
        alone = False
    if alone:
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER
    return original(self, req, *args, **kwargs)


def gate_background_writes() -> None:
    """CPU-only servers: SSD write-through waits while a forward runs (storage/foreground.py)."""
    FOREGROUND.enabled = True
    _ensure_hook()


def _around_worker(original, self, batch=None, *args, **kwargs):
    reqs = getattr(batch, "reqs", None) or []
    _batch.by_rid = {r.rid: r for r in reqs}
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _batch.by_rid = {}


def batch_requests(fb) -> list[Any]:
    """SGLang's `Req` objects of the forward batch, in batch order (those the worker hook saw)."""
    by_rid = getattr(_batch, "by_rid", {})
    return [r for r in (by_rid.get(rid) for rid in fb.rids or []) if r is not None]


def _around_forward(original, self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None,
                    **kwargs):
    with FOREGROUND.busy():
        if input_embeds is None and pp_proxy_tensors is None and forward_batch.forward_mode.is_extend():
            for handler in _handlers:
                hidden = handler(self, input_ids, positions, forward_batch)
                if hidden is not None:
                    return hidden
        return original(self, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, **kwargs)


def too_long_for_one_extend(scheduler, req, start: int) -> Optional[int]:
    """At admission: the scheduler's `--chunked-prefill-size` if the prompt from token `start` on is longer (SGLang
    would prefill it in pieces, which a handler computing the whole remaining prompt cannot take: the request then
    keeps SGLang's own load of its stored prefix instead of skipping it); None if it fits in one extend."""
    limit = getattr(scheduler, "chunked_prefill_size", None)
    if limit is None or limit <= 0:
        return None
    return limit if len(req.origin_input_ids) - start > limit else None


def why_not_whole_prompt(fb, req) -> Optional[str]:
    """Why a handler that computes one request's whole remaining prompt itself cannot take this extend batch
    (None: it can)."""
    prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
    if fb.batch_size > 1:
        return f"its prefill batch holds {fb.batch_size} requests"
    if req.return_logprob:
        return "input logprobs were requested"
    if prefix + ext < len(req.origin_input_ids):
        return "a piece of a chunked prefill (raise --chunked-prefill-size)"
    return None


def engine_from_sglang(module) -> LlamaModel:
    """Our layer-by-layer engine over the weights of SGLang's `LlamaModel` (views of the fused projections, no
    copy), one per module. Raises NotImplementedError when the module holds a tensor-parallel shard."""
    if id(module) in _engines:
        return _engines[id(module)]
    hf = module.config
    cfg = LlamaConfig.from_dict(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    embed = module.embed_tokens.weight
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed, "model.norm.weight": module.norm.weight,
                                  "lm_head.weight": embed}  # the engine's logits are not used in the server
    for i, layer in enumerate(module.layers):
        qkv = layer.self_attn.qkv_proj.weight
        if qkv.shape[0] != q + 2 * kv:
            raise NotImplementedError("needs the whole model in one rank (TP = 1)")
        gate_up = layer.mlp.gate_up_proj.weight
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": layer.input_layernorm.weight,
                  p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                  p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q : q + kv],
                  p + "self_attn.v_proj.weight": qkv[q + kv :],
                  p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                  p + "mlp.gate_proj.weight": gate_up[: cfg.intermediate],
                  p + "mlp.up_proj.weight": gate_up[cfg.intermediate :],
                  p + "mlp.down_proj.weight": layer.mlp.down_proj.weight})
    _engines[id(module)] = LlamaModel(cfg, w, dtype=embed.dtype)
    return _engines[id(module)]


def whole_model_in_rank(module) -> bool:
    """False under pipeline parallelism (the module runs only some layers)."""
    layers = len(module.layers)
    return getattr(module, "start_layer", 0) == 0 and getattr(module, "end_layer", layers) == layers


def prefix_kv_reader(fb) -> Callable[[int], torch.Tensor]:
    """layer -> [prefix, 2, kv_heads, head_dim]: the KV of the single request's cached prefix, read from the pool."""
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    prefix = int(fb.extend_prefix_lens_cpu[0])
    pool = get_token_to_kv_pool()
    row = get_req_to_token_pool().req_to_token[fb.req_pool_indices[0], :prefix].to(torch.int64)

    def read(layer: int) -> torch.Tensor:
        return torch.stack([pool.get_key_buffer(layer)[row], pool.get_value_buffer(layer)[row]], 1)

    return read


def write_extend(fb, engine: LlamaModel, new_kv: torch.Tensor, last_hidden: torch.Tensor) -> torch.Tensor:
    """Store `new_kv` [layers, extend tokens, 2, kv_heads, head_dim] in the request's slots and return the forward's
    output for SGLang's logits processor, built from the last token's residual stream `last_hidden` [hidden]."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    pool = get_token_to_kv_pool()
    slots = fb.out_cache_loc
    loc = KVWriteLoc(slots, physical=True)
    for layer in range(engine.cfg.layers):
        pool.set_kv_buffer(None, loc, new_kv[layer, :, 0], new_kv[layer, :, 1], layer_id_override=layer)
    hidden = torch.zeros(new_kv.shape[1], engine.cfg.hidden, dtype=engine.dtype, device=slots.device)
    hidden[-1] = engine.final_norm(last_hidden[None])[0]
    return hidden
