"""ForwardHook.extends: the requests of an extend batch with their prefix, extend length and first row, as SGLang's
worker hands them over (no SGLang: the batch and forward batch are plain objects with SGLang's field names)."""

from types import SimpleNamespace

from sglang_tiered.integration.model_forward import Extend, ForwardHook


def test_extends_pairs_each_rid_with_its_request_lengths_and_row():
    a, b = SimpleNamespace(rid="a"), SimpleNamespace(rid="b")
    fb = SimpleNamespace(rids=["a", "x", "b"], extend_prefix_lens_cpu=[64, 0, 128], extend_seq_lens_cpu=[10, 7, 3])
    hook = ForwardHook(rt=None)
    seen = hook._around_worker(lambda worker, batch: hook.extends(fb), None, SimpleNamespace(reqs=[b, a]))
    assert seen == [Extend(a, 64, 10, 0), Extend(None, 0, 7, 10), Extend(b, 128, 3, 17)]  # "x": not in the batch
    assert [x.req for x in hook.extends(fb)] == [None, None, None]  # outside the worker's call: no requests
