"""The one hook on SGLang's Llama forward and the base of the mechanisms that compute a prefill themselves
(`ForwardHandler`: blend, sparse, kvpr, runahead), plus the glue they share: our layer-by-layer engine over SGLang's
weights, the requests of the running batch, reading a cached prefix's KV from SGLang's pool and writing an extend's
KV into it.

Seams (listed with all others in plugin.py): `models.llama.LlamaModel.forward` (AROUND) and
`managers.tp_worker.TpModelWorker.forward_batch_generation` (AROUND, remembers the batch's requests by rid), both
in scheduler processes, registered by this process's `ForwardHook` (in its `Runtime`). For an extend batch without
input embeddings or pipeline proxies, each registered handler is asked in order; the first that returns a tensor
has done the forward: the request's new KV is in its slots (`forward_batch.out_cache_loc`) and the returned
[extend tokens, hidden] tensor holds the final-normed hidden state of the last token in its last row (the rows
before it are zeros: SGLang's logits processor reads only the last row unless input logprobs or hidden states were
requested, which handlers must decline). A handler returns None to leave the batch to SGLang's own forward. A
handler that raises is logged and counted (`sglang_tiered:hook_errors_total`) and the batch goes to SGLang's own
forward: a failure of ours never takes the scheduler down (nothing a handler wrote into the request's new slots
survives SGLang's forward over them).

Fallback reasons shared by every handler (`ForwardHandler.declines`): our engine runs the base model's weights on
token ids, so a request with a LoRA adapter, multimodal inputs or input embeddings is never computed by it (counted
as the handler's fallback); each handler adds its own (a batch of several, a chunked piece, input logprobs, ...).
On CPU-only servers every forward (also SGLang's own) is marked as foreground work, so that the SSD write-through
yields to it (`gate_background_writes`, storage/foreground.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.integration import faults
from sglang_tiered.policy.admission import admit

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

logger = logging.getLogger("sglang_tiered")


def engine_declines(req) -> Optional[str]:
    """Why our engine (the base model's weights, token ids in) cannot compute `req` faithfully; None if it can."""
    if getattr(req, "lora_id", None):
        return f"LoRA adapter {req.lora_id!r} (our engine runs the base weights)"
    if getattr(req, "multimodal_inputs", None) is not None:
        return "multimodal inputs"
    if getattr(req, "input_embeds", None) is not None:
        return "input embeddings"
    return None


class ForwardHandler:
    """A mechanism that may compute an extend forward itself. Subclasses set `name` (one word: "blend", "sparse",
    "kvpr", "runahead"; the prefix of its counters) and implement `build_runtime` and `forward`.

    * `build_runtime(module)`: per-process state (engine over SGLang's weights, stores, helper ranks), built at the
      first `runtime()` call. NotImplementedError, OSError or ValueError disable the handler in this process
      (logged once; `disabled` holds the reason).
    * `forward(module, input_ids, positions, forward_batch)`: the hidden states (see the module docstring) or None.
      It may raise: the hook then logs, counts and runs SGLang's forward.
    * `declines(req)`: the reasons every handler shares for leaving a request to SGLang (see the module docstring).
    """

    name = "handler"

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
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

    def declines(self, req) -> Optional[str]:
        return engine_declines(req)

    def fallback(self, rids: list[str], why: str) -> None:
        """Requests that get SGLang's normal prefill: logged and counted (`<name>_fallbacks`)."""
        self.rt.events.count(f"{self.name}_fallbacks", len(rids))
        logger.info("tiered %s: rid %s runs a normal prefill (%s)", self.name, " ".join(rids) or "?", why)

    def __call__(self, module, input_ids, positions, fb) -> Optional[torch.Tensor]:
        try:
            faults.check(f"{self.name}_forward")
            return self.forward(module, input_ids, positions, fb)
        except Exception as exc:
            self._errors += 1
            self.rt.events.count("hook_errors")
            rids = " ".join(fb.rids or [])
            if self._errors == 1:
                logger.exception("tiered %s: failed on rid %s; SGLang's own forward runs instead", self.name, rids)
            else:
                logger.error("tiered %s: failed on rid %s (%s, failure %d); SGLang's own forward runs instead",
                             self.name, rids, exc, self._errors)
            return None


@dataclass(frozen=True)
class Extend:
    """One request of an extend batch: tokens [prefix, prefix + length) computed, in rows [row, row + length)."""

    req: Any
    prefix: int
    length: int
    row: int


class ForwardHook:
    """This process's forward hook: the handlers, the observers of SGLang's own extend forwards, the prefill-alone
    predicates, the engines over SGLang's modules and the requests of the batch running now."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.handlers: list[ForwardHandler] = []
        self._observers: list[Callable[[Any], None]] = []
        self._observer_errors = 0
        self._alone: list[Callable[[Any], bool]] = []
        self._admission_errors = 0
        self._engines: dict[int, LlamaModel] = {}
        self._batch = threading.local()
        self._hooked = self._tracking = False

    def _ensure_hook(self) -> None:
        if not self._hooked:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            HookRegistry.register("sglang.srt.models.llama.LlamaModel.forward", self._around_forward, HookType.AROUND)
            self.track_batches()
            self._hooked = True

    def track_batches(self) -> None:
        """Make `batch_requests` work in this process (registers the worker hook once)."""
        if not self._tracking:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            HookRegistry.register("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
                                  self._around_worker, HookType.AROUND)
            self._tracking = True

    def add_handler(self, handler: ForwardHandler) -> None:
        """Register `handler` (once per name); the forward hook itself is registered once."""
        self._ensure_hook()
        if all(h.name != handler.name for h in self.handlers):
            self.handlers.append(handler)

    def prefill_alone(self, predicate: Callable[[Any], bool]) -> None:
        """Requests for which `predicate(req)` holds prefill alone (the handlers compute extend batches of one
        request): such a request joins no prefill batch that already has a request (it stays queued for the next
        round) and nothing joins its batch (`policy.admission`). Seam (plugin.py):
        `PrefillAdder.add_one_req` (AROUND), registered with the first predicate."""
        if not self._alone:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            HookRegistry.register("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
                                  self._around_add_one_req, HookType.AROUND)
        self._alone.append(predicate)

    def prefills_alone(self, req) -> bool:
        return any(p(req) for p in self._alone)

    def _around_add_one_req(self, original, adder, req, *args, **kwargs):
        """Requests that prefill alone are admitted by `policy.admission.admit`; if this check fails, SGLang's
        admission decides alone (logged and counted)."""
        try:
            faults.check("admission")
            verdict = admit([self.prefills_alone(r) for r in adder.can_run_list], self.prefills_alone(req))
        except Exception as exc:
            self._admission_errors += 1
            self.rt.events.count("hook_errors")
            if self._admission_errors == 1:
                logger.exception("tiered: admission check failed; SGLang admits the request on its own")
            else:
                logger.error("tiered: admission check failed (%s, failure %d)", exc, self._admission_errors)
            verdict = "join"
        if verdict == "join":
            return original(adder, req, *args, **kwargs)
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER  # the walk ends; the request stays queued

    def observe_extends(self, observer: Callable[[Any], None]) -> None:
        """`observer(forward_batch)` after every extend batch that SGLang's own forward computed (no handler took
        it). An observer that raises is logged and counted (`hook_errors`); the forward's result stands."""
        self._ensure_hook()
        self._observers.append(observer)

    def _observe(self, fb) -> None:
        for observer in self._observers:
            try:
                observer(fb)
            except Exception:
                self._observer_errors += 1
                self.rt.events.count("hook_errors")
                if self._observer_errors == 1:
                    logger.exception("tiered: an observer of SGLang's forward failed; the forward's result stands")

    def gate_background_writes(self) -> None:
        """CPU-only servers: SSD write-through waits while a forward runs (storage/foreground.py)."""
        self.rt.foreground.enabled = True
        self._ensure_hook()

    def _around_worker(self, original, worker, batch=None, *args, **kwargs):
        reqs = getattr(batch, "reqs", None) or []
        self._batch.by_rid = {r.rid: r for r in reqs}
        try:
            return original(worker, batch, *args, **kwargs)
        finally:
            self._batch.by_rid = {}

    def batch_requests(self, fb) -> list[Any]:
        """SGLang's `Req` objects of the forward batch, in batch order (those the worker hook saw)."""
        by_rid = getattr(self._batch, "by_rid", {})
        return [r for r in (by_rid.get(rid) for rid in fb.rids or []) if r is not None]

    def extends(self, fb) -> list[Extend]:
        """Each request of extend batch `fb`, in batch order, with its cached prefix, its extend length and its
        first row in the batch's extend tokens (`req` None where the worker hook did not see it)."""
        by_rid = getattr(self._batch, "by_rid", {})
        out, row = [], 0
        for rid, prefix, length in zip(fb.rids or [], fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            out.append(Extend(by_rid.get(rid), int(prefix), int(length), row))
            row += int(length)
        return out

    def _around_forward(self, original, module, input_ids, positions, forward_batch, input_embeds=None,
                        pp_proxy_tensors=None, **kwargs):
        extend = input_embeds is None and pp_proxy_tensors is None and forward_batch.forward_mode.is_extend()
        hidden = None
        with self.rt.foreground.busy():
            if extend:
                for handler in self.handlers:
                    hidden = handler(module, input_ids, positions, forward_batch)
                    if hidden is not None:
                        break
            if hidden is None:
                hidden = original(module, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors,
                                  **kwargs)
                if extend and self._observers and not forward_batch.forward_mode.is_target_verify():
                    self._observe(forward_batch)
        return hidden

    def engine(self, module) -> LlamaModel:
        """Our layer-by-layer engine over the weights of SGLang's `LlamaModel` (views of the fused projections, no
        copy), one per module. Raises NotImplementedError when the module holds a tensor-parallel shard."""
        if id(module) not in self._engines:
            self._engines[id(module)] = engine_from_sglang(module)
        return self._engines[id(module)]


def too_long_for_one_extend(scheduler, req, start: int) -> Optional[int]:
    """At admission: the scheduler's `--chunked-prefill-size` if the prompt from token `start` on is longer (SGLang
    would prefill it in pieces, which a handler computing the whole remaining prompt cannot take: the request then
    keeps SGLang's own load of its stored prefix instead of skipping it); None if it fits in one extend."""
    limit = getattr(scheduler, "chunked_prefill_size", None)
    if limit is None or limit <= 0:
        return None
    return limit if len(req.origin_input_ids) - start > limit else None


def wants_input_logprobs(req) -> bool:
    """Does `req` need log-probabilities of its prompt tokens? (They need every prompt row's hidden state, and our
    handlers compute only the last; logprobs of the output tokens alone, SGLang's default for `return_logprob`, need
    nothing more.)"""
    return bool(req.return_logprob) and 0 <= req.logprob_start_len < len(req.origin_input_ids)


def why_not_whole_prompt(fb, req) -> Optional[str]:
    """Why a handler that computes one request's whole remaining prompt itself cannot take this extend batch
    (None: it can)."""
    prefix, ext = int(fb.extend_prefix_lens_cpu[0]), int(fb.extend_seq_lens_cpu[0])
    declined = engine_declines(req)
    if declined is not None:
        return declined
    if fb.batch_size > 1:
        return f"its prefill batch holds {fb.batch_size} requests"
    if wants_input_logprobs(req):
        return "input logprobs were requested"
    if prefix + ext < len(req.origin_input_ids):
        return "a piece of a chunked prefill (raise --chunked-prefill-size)"
    return None


def engine_from_sglang(module) -> LlamaModel:
    """A new engine over the weights of SGLang's `LlamaModel` (use `ForwardHook.engine`: one per module). Raises
    NotImplementedError when the module holds a tensor-parallel shard."""
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
    return LlamaModel(cfg, w, dtype=embed.dtype)


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
    output for SGLang's logits processor, built from the last token's residual stream `last_hidden` [hidden].

    Into a plain CPU pool (`slot_runs`) the rows go run by run of consecutive slots (a page's slots are one run) as
    slice copies; otherwise through the pool's `set_kv_buffer`, an indexed write: 0.126 s against 0.053 s for the
    8064 + 32 tokens of the MHA benchmark model over 127 runs (bf16, 2-core AMD EPYC). Either writes the same bytes."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    store_rows(get_token_to_kv_pool(), fb.out_cache_loc, new_kv)
    hidden = torch.zeros(new_kv.shape[1], engine.cfg.hidden, dtype=engine.dtype, device=fb.out_cache_loc.device)
    hidden[-1] = engine.final_norm(last_hidden[None])[0]
    return hidden


def store_rows(pool, slots: torch.Tensor, new_kv: torch.Tensor) -> None:
    """Write `new_kv` [layers, tokens, 2, kv_heads, head_dim] into `slots` of every layer of SGLang's KV `pool`."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    runs = slot_runs(pool, slots, new_kv)
    loc = KVWriteLoc(slots, physical=True)
    for layer in range(new_kv.shape[0]):
        k, v = new_kv[layer, :, 0], new_kv[layer, :, 1]
        if runs is None:
            pool.set_kv_buffer(None, loc, k, v, layer_id_override=layer)
            continue
        k_buf, v_buf = pool.k_buffer[layer - pool.start_layer], pool.v_buffer[layer - pool.start_layer]
        for slot, a, b in runs:
            k_buf[slot : slot + b - a] = k[a:b]
            v_buf[slot : slot + b - a] = v[a:b]


def slot_runs(pool, slots: torch.Tensor, new_kv: torch.Tensor) -> Optional[list[tuple[int, int, int]]]:
    """The runs of consecutive slots in `slots`, as (first slot, first row, end row), where the pool stores a row as
    `set_kv_buffer` would with a plain copy: SGLang's MHA pool itself (not a subclass: those lay rows out otherwise),
    token-major ("nhd"), unquantized, in `new_kv`'s dtype, on the CPU, every slot inside it. Else None."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if (type(pool) is not MHATokenToKVPool or getattr(pool, "kv_cache_layout", None) != "nhd"
            or getattr(pool, "use_hnd", True) or getattr(pool, "is_quantized_kv_cache", True)
            or not pool.dtype == pool.store_dtype == new_kv.dtype or slots.device.type != "cpu"
            or new_kv.device.type != "cpu" or slots.numel() != new_kv.shape[1] or not slots.numel()):
        return None
    if int(slots.min()) < 0 or int(slots.max()) >= pool.k_buffer[0].shape[0]:
        return None  # (set_kv_buffer's own checks report it)
    starts = [0, *((slots[1:] != slots[:-1] + 1).nonzero().flatten() + 1).tolist(), slots.numel()]
    first = slots[starts[:-1]].tolist()
    return [(slot, a, b) for slot, a, b in zip(first, starts[:-1], starts[1:])]
