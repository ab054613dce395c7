"""The key scheme and the engine's declines on SGLang's real `Req` objects (no server).

* Keys: SGLang folds the LoRA adapter into `extra_key`; pages, chunks and the tenant seed all change with
  `cache_salt` and `extra_key`, and stay shared without them.
* Declines: a request with a LoRA adapter or input embeddings is one our engine (the base weights, token ids in)
  cannot compute. The door does not plan its stored span (the loader's fallback is logged; SGLang loads it), and
  the forward handlers that compute a prefill themselves (blend, runahead) decline it with a reason. Live servers
  cannot show this on CPU: SGLang 0.5.23 refuses input embeddings while the radix cache is on (the tiered backend
  needs it), and its LoRA layers pin memory, which CPU torch cannot; so these checks use SGLang's own request
  objects directly.
"""

from __future__ import annotations

import logging
from array import array
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.sglang

TOKENS = list(range(100, 100 + 130))  # two 64-token pages and a bit


@pytest.fixture(scope="module")
def make_req():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=64))

    def make(rid: str = "r", custom: dict | None = None, **kw):
        return Req(rid, "", array("q", TOKENS), SamplingParams(max_new_tokens=4, custom_params=custom), **kw)

    return make


def test_every_key_follows_sglangs_tenant_seed(make_req):
    from sglang_tiered.engine.blend_plan import plan_spans
    from sglang_tiered.integration.keys import page_keys, tenant_seed

    plain, again = make_req(), make_req("r2")
    salted, other = make_req(cache_salt="A"), make_req(cache_salt="B")
    lora = make_req(lora_id="adapter-1")
    assert lora.extra_key is not None and "adapter-1" in lora.extra_key  # SGLang's: the adapter is in the key
    seeds = [tenant_seed(r) for r in (plain, salted, other, lora)]
    assert seeds[0] is None and len(set(seeds)) == 4
    pages = [tuple(page_keys(r, len(TOKENS), 64)) for r in (plain, again, salted, other, lora)]
    assert len(pages[0]) == 2 and pages[0] == pages[1] and len(set(pages)) == 4

    def chunk_keys(req):
        _, refs = plan_spans([64, 64, 2], 0, len(TOKENS), TOKENS, seed=tenant_seed(req))
        return tuple(r.key for r in refs if r is not None)

    keys = [chunk_keys(r) for r in (plain, again, salted, other, lora)]
    assert len(keys[0]) == 2 and keys[0] == keys[1] and len(set(keys)) == 4


def test_requests_our_engine_cannot_compute_are_declined_with_a_reason(make_req):
    from sglang_tiered.integration.model_forward import engine_declines

    assert engine_declines(make_req()) is None
    assert "LoRA adapter 'adapter-1'" in engine_declines(make_req(lora_id="adapter-1"))
    assert engine_declines(make_req(input_embeds=[[0.0] * 8] * len(TOKENS))) == "input embeddings"
    req = make_req()
    req.multimodal_inputs = object()
    assert engine_declines(req) == "multimodal inputs"


class Recorder:
    """A loader of ours that plans every request it is asked about."""

    name = "sparse"

    def __init__(self, handler) -> None:
        self.handler, self.asked = handler, []

    def admit(self, scheduler, req) -> None:
        pass

    def wants(self, req) -> bool:
        return True

    def plan(self, scheduler, req, start: int):
        self.asked.append(req.rid)
        return ("plan", start)


def test_the_door_leaves_a_lora_request_to_sglang_and_says_why(make_req, caplog):
    from sglang_tiered.integration.door import Door, SpanHandler
    from sglang_tiered.integration.runtime import Runtime
    from sglang_tiered.policy.retention import Retention

    rt = Runtime()
    rt.store = SimpleNamespace(retention=Retention(0, 0), page_size=64)
    door = Door(rt)
    handler = SpanHandler(rt)
    handler.name = "sparse"
    loader = Recorder(handler)
    door.add(loader)
    scheduler = SimpleNamespace(tree_cache=None)
    lora = make_req("lora-req", lora_id="adapter-1")
    lora.init_next_round_input = plain_init = lambda *a, **k: None  # (the device/host match: nothing cached)
    lora.prefix_len = lora.host_hit_length = 0
    with caplog.at_level(logging.INFO, logger="sglang_tiered"):
        assert door._decide(scheduler, lora) is None
    assert loader.asked == [] and "rid lora-req runs a normal prefill (LoRA adapter 'adapter-1'" in caplog.text
    plain = make_req("plain-req")
    plain.init_next_round_input = plain_init
    plain.prefix_len, plain.host_hit_length = 64, 0
    load = door._decide(scheduler, plain)
    assert loader.asked == ["plain-req"] and load.loader == "sparse" and load.plan == ("plan", 64)
    marked = make_req("marked-req", custom={"tiered_chunks": [64, 66]})
    assert door._decide(scheduler, marked) is None and loader.asked == ["plain-req"]  # blending's, not a loader's


def test_blend_and_runahead_decline_what_the_engine_cannot_compute(make_req):
    from sglang_tiered.integration.blend import BlendHandler
    from sglang_tiered.integration.runahead import _unsupported
    from sglang_tiered.integration.runtime import Runtime

    module = SimpleNamespace(layers=[object()] * 2, start_layer=0, end_layer=2)
    fb = SimpleNamespace(return_logprob=False, capture_hidden_mode=None)
    blend = BlendHandler(Runtime())
    lora = make_req(custom={"tiered_chunks": [64, 66]}, lora_id="adapter-1")
    plain = make_req(custom={"tiered_chunks": [64, 66]})
    assert "LoRA adapter" in blend._unsupported(module, lora) and blend._unsupported(module, plain) is None
    assert "LoRA adapter" in _unsupported(module, fb, [plain, lora]) and _unsupported(module, fb, [plain]) is None
