"""The blend namespace at admission (integration/blend.py `Namespace`), with SGLang's own key seed and no server: a
marked request's `extra_key` is extended once with the blend configuration, its chunk keys keep the tenant's seed
(chunk KV is exact and shared by every blend configuration of that tenant), and unmarked requests are untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.sglang


def request(extra_key, salt, chunks):
    custom = {"tiered_chunks": chunks} if chunks is not None else {}
    return SimpleNamespace(extra_key=extra_key, cache_salt=salt, origin_input_ids=[1, 2, 3, 4, 5],
                           sampling_params=SimpleNamespace(custom_params=custom))


@pytest.mark.parametrize("extra_key, salt", [(None, None), ("lora-a", None), (None, "tenant-b"), ("k", "s")])
def test_a_marked_request_is_namespaced_once_and_keeps_its_tenants_chunk_seed(extra_key, salt):
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    from sglang_tiered.integration.blend import Namespace, chunk_seed

    tag = "tiered-blend:blend:0.15:deviation"
    req = request(extra_key, salt, [3, 2])
    Namespace(tag)(req)
    Namespace(tag)(req)  # a re-admission: not extended twice
    assert req.extra_key == (f"{extra_key}|{tag}" if extra_key else tag)
    assert chunk_seed(req) == storage_namespace_seed(extra_key, salt)  # as before the namespace
    other = request(extra_key, salt, [3, 2])
    Namespace("tiered-blend:reuse:0.15:deviation")(other)
    assert other.extra_key != req.extra_key and chunk_seed(other) == chunk_seed(req)  # other configs share chunks
    plain = request(extra_key, salt, None)
    Namespace(tag)(plain)
    assert plain.extra_key == extra_key and chunk_seed(plain) == storage_namespace_seed(extra_key, salt)
