"""Compute-or-load without SGLang: the decision (`policy/kvpr.decide`, pure), the read rate, the compute profile,
the two-sided engine's exactness when the loader reads pages as activations (at every meet point), and stored pages
read from the SSD tier (checksums per segment; missing or corrupt activations fall back to that page's KV)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from sglang_tiered.engine.kvpr_profile import measure_profile, profile_key, profile_of, save_profile, stored_entry
from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.meet import MemoryPages, meet_prefill
from sglang_tiered.integration.kvpr import KVPR
from sglang_tiered.kernels.extend_attention import causal_attention
from sglang_tiered.policy.cpu_dtype import signature
from sglang_tiered.policy.kvpr import COMPUTE, LOAD, MEET, MIN_PAGES, Profile, Shape, decide, gate, page_read_s
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import CorruptPage, ForeignPage, PageReader, write_page
from sglang_tiered.storage.ssd_tier import SSDTier

MHA = LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=6, head_dim=16, intermediate=192, vocab=300)
PS = 16
MB = 1e6


# ---------------------------------------------------------------------------------------------- decisions
MHA_SHAPE = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 9 * 64 * 2)  # activations 0.5x the KV
GQA_SHAPE = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 3 * 64 * 2)  # SmolLM2: activations 1.5x the KV


def test_gate_refuses_models_whose_activations_are_not_smaller_than_their_kv():
    assert gate(MHA_SHAPE) is None
    assert "1.50x" in gate(GQA_SHAPE)


def test_a_page_reads_as_kv_bytes_or_as_activation_bytes_plus_the_recompute():
    kv = page_read_s(MHA_SHAPE, 64, 100 * MB, 1e-6, activations=False)
    x = page_read_s(MHA_SHAPE, 64, 100 * MB, 1e-6, activations=True)
    assert kv == pytest.approx(30 * 64 * 2304 / 100e6)
    assert x == pytest.approx(30 * 64 * (1152 / 100e6 + 1e-6))


@pytest.mark.parametrize("mbps, way", [
    (2000, LOAD),  # a read 0.7 ms against 50 ms of compute: compute would take one page of 64
    (100, MEET),  # a read 15 ms: compute takes about a quarter
    (0.2, COMPUTE),  # a read 7.4 s: the loader would bring in less than one page of 64
])
def test_auto_loads_meets_or_computes_by_the_two_rates(mbps, way):
    d = decide(64, 64, GQA_SHAPE, mbps * MB, Profile(page_s=0.05, recompute_s=1e-6), stored_activations=False)
    assert d.way == way and not d.activations
    assert d.page_s == 0.05 and d.read_s == pytest.approx(page_read_s(GQA_SHAPE, 64, mbps * MB, 1e-6, False))


def test_where_compute_would_take_fewer_than_min_pages_sglang_loads_unless_activations_are_read():
    """Reads fast next to compute: KV is SGLang's load to do; activations (half the bytes here) only ours can read."""
    fast = Profile(page_s=0.1, recompute_s=1e-8)
    kv = decide(64, 64, MHA_SHAPE, 4000 * MB, fast, stored_activations=False)
    x = decide(64, 64, MHA_SHAPE, 4000 * MB, fast, stored_activations=True)
    assert 64 * kv.read_s / (kv.read_s + kv.page_s) < MIN_PAGES
    assert (kv.way, kv.activations) == (LOAD, False) and (x.way, x.activations) == (MEET, True)
    assert x.read_s < kv.read_s


def test_activations_are_read_only_where_they_bring_a_page_in_faster():
    slow_recompute = Profile(page_s=0.05, recompute_s=1e-4)  # the recompute outweighs the bytes saved
    assert not decide(64, 64, MHA_SHAPE, 100 * MB, slow_recompute, stored_activations=True).activations
    quick = Profile(page_s=0.05, recompute_s=1e-7)
    assert decide(64, 64, MHA_SHAPE, 100 * MB, quick, stored_activations=True).activations
    assert not decide(64, 64, GQA_SHAPE, 100 * MB, quick, stored_activations=True).activations  # gate closed


def test_decide_refuses_an_empty_span_or_no_read_rate():
    with pytest.raises(ValueError):
        decide(0, 64, MHA_SHAPE, 100 * MB, Profile(0.05, 1e-6), stored_activations=False)
    with pytest.raises(ValueError):
        decide(4, 64, MHA_SHAPE, 0.0, Profile(0.05, 1e-6), stored_activations=False)


def test_the_profile_is_measured_on_the_model_and_kept_with_its_read_rate(tmp_path):
    model = LlamaModel.random(MHA, seed=3)
    prof = measure_profile(model, PS)
    assert prof.page_s > 0 and prof.recompute_s > 0
    assert prof.page_s > PS * prof.recompute_s  # a page through every layer costs more than one layer's K, V
    key = profile_key("m", "torch.float32", PS, torch.device("cpu"))
    save_profile(tmp_path, key, prof, read_bytes_per_s=123e6)
    stored = stored_entry(tmp_path, key)
    assert stored is not None and stored[:2] == (prof, 123e6) and stored[2].startswith(time.strftime("%Y-"))
    assert stored_entry(tmp_path, profile_key("m", "torch.float32", PS * 2, torch.device("cpu"))) is None
    for garbage in (b"{not json", b'{"%s": [1, 2]}' % key.encode(), b"[]"):  # measured again, never an error
        (tmp_path / "kvpr-profile.json").write_bytes(garbage)
        assert stored_entry(tmp_path, key) is None
    with pytest.raises(KeyError):
        profile_of({"read_bytes_per_s": 1.0})


def test_a_servers_profile_is_kept_under_its_ssd_capacity_or_the_log_says_where_it_was_not(tmp_path, caplog):
    """A server writes its profile through its SSD tier (the bytes counted): with no room under the capacity the file
    is not written and a warning names it; with room it is written and read back."""
    prof = Profile(page_s=0.02, recompute_s=1e-4)
    ns = Namespace(model="m:1", dtype="torch.float32", page_size=PS, layout="layer_first", layer_num=MHA.layers,
                   kv_heads=MHA.kv_heads, head_dim=MHA.head_dim)
    for capacity, kept in ((64, False), (1 << 20, True)):
        root = tmp_path / str(capacity)
        kvpr = KVPR(SimpleNamespace(), MHA, MHA_SHAPE, None)
        kvpr.tier, kvpr.key = SSDTier(root, ns, capacity), "key"
        kvpr.profile, kvpr.measured_s, kvpr.rate = prof, 1.0, None
        kvpr.read_measured.set()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sglang_tiered"):
            kvpr._save()
        stored = stored_entry(root, "key")
        if kept:
            assert stored is not None and stored[:2] == (prof, 0.0) and not caplog.records
        else:
            assert stored is None and not (root / "kvpr-profile.json").exists()
            assert f"the profile could not be kept in {root / 'kvpr-profile.json'}" in caplog.text


def test_a_profile_is_kept_for_the_machine_model_dtype_and_page_size_it_was_measured_with():
    cpu = torch.device("cpu")
    key = profile_key("m", "torch.float32", 64, cpu)
    assert key == profile_key("m", "torch.float32", 64, cpu)  # a restart finds it
    others = {profile_key("n", "torch.float32", 64, cpu), profile_key("m", "torch.bfloat16", 64, cpu),
              profile_key("m", "torch.float32", 32, cpu)}
    assert key not in others and len(others) == 3
    assert signature("m") in key  # this CPU and torch's version
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert profile_key("m", "torch.float32", 64, cpu) != key  # measured with another number of threads
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- the engine
@torch.inference_mode()
def prefill_with_inputs(model: LlamaModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference prefill that also returns every layer's attention input: (logits, kv, x [layers, n, hidden])."""
    n = ids.shape[0]
    kv = model.empty_kv(n)
    xs = torch.empty(model.cfg.layers, n, model.cfg.hidden, dtype=model.dtype)
    positions = torch.arange(n)
    x = model.embed(ids)
    for layer in range(model.cfg.layers):
        xs[layer] = model.attention_input(layer, x)
        q, k, v = model.qkv(layer, x, positions)
        kv[layer, :, 0], kv[layer, :, 1] = k, v
        x = model.finish_layer(layer, x, causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], 0))
    return model.logits(x[-1:])[0], kv, xs


@pytest.fixture(scope="module")
def mha():
    model = LlamaModel.random(MHA, seed=3)
    ids = torch.randint(0, MHA.vocab, (100,), generator=torch.Generator().manual_seed(2))
    return model, ids, *prefill_with_inputs(model, ids)


@pytest.mark.parametrize("split", [0, 1, 2, 4, 5])  # pages computed from token ids (5: every page)
@pytest.mark.parametrize("p", [0, 16])
@pytest.mark.parametrize("x_pages", [0, 3, 5])  # pages readable as activations
def test_every_meet_point_with_activations_reproduces_the_full_prefill(mha, split, p, x_pages):
    model, ids, logits, kv, xs = mha
    pages = (80 - p) // PS
    split = min(split, pages)
    span = MemoryPages(kv[:, p:80].clone(), PS, x=xs[:, p:80].clone(), x_pages=x_pages)
    res = meet_prefill(model, ids[p:80], ids[80:], prefix_len=p, source=span, split=split, inputs=True,
                       prefix_loader=(lambda layer: kv[layer, :p]))
    assert res.computed_pages == split and res.recomputed_pages == max(0, min(x_pages, pages) - split)
    torch.testing.assert_close(res.kv, kv[:, p:], rtol=1e-4, atol=1e-4)  # recomputed K, V == stored K, V
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res.inputs, xs[:, 80:], rtol=1e-4, atol=1e-4)


def test_recompute_in_bf16_stays_within_the_dtype_tolerance(mha):
    model = LlamaModel.random(MHA, seed=3, dtype=torch.bfloat16)
    ids = mha[1]
    logits, kv, xs = prefill_with_inputs(model, ids)
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, split=0,
                       source=MemoryPages(kv[:, :80].clone(), PS, x=xs[:, :80].clone(), x_pages=3))
    torch.testing.assert_close(res.kv[:, :48].float(), kv[:, :48].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(res.kv[:, 48:80], kv[:, 48:80])  # the loaded part is the stored bytes
    torch.testing.assert_close(model.logits(res.hidden[None])[0].float(), logits.float(), rtol=5e-2, atol=5e-2)


# ---------------------------------------------------------------------------------------------- per-layer reads
def test_page_reader_verifies_each_segment_on_its_own(tmp_path):
    segs = [bytes([i]) * (100 + i) for i in range(6)]
    path = tmp_path / "p.kvp"
    write_page(str(path), "ns", "key", [memoryview(s) for s in segs])
    reader = PageReader(str(path), "ns", "key", [len(s) for s in segs])
    assert [bytes(b) for b in reader.read(2, 2)] == segs[2:4]
    reader.close()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last segment's last byte
    path.write_bytes(bytes(raw))
    reader = PageReader(str(path), "ns", "key", [len(s) for s in segs])
    assert [bytes(b) for b in reader.read(0, 5)] == segs[:5]  # the other segments still read
    with pytest.raises(CorruptPage, match="segment 5"):
        reader.read(5, 1)
    reader.close()
    with pytest.raises(ForeignPage):
        PageReader(str(path), "other", "key", [len(s) for s in segs])


# ---------------------------------------------------------------------------------------------- stored pages
def store_span(tier, kv, xs, tokens, with_x):
    """Write `tokens` of a prefill as KV pages (layer_first) and, for the pages in `with_x`, activation pages."""
    from sglang_tiered.storage import activations

    keys = [f"{i:02d}page{i}" for i in range(tokens // PS)]
    for i, key in enumerate(keys):
        rows = slice(i * PS, (i + 1) * PS)
        segs = [memoryview(kv[layer, rows, j].contiguous().view(torch.uint8).numpy()) for layer in
                range(MHA.layers) for j in (0, 1)]
        assert tier.write_pages([(key, segs)]) == [True]
        if i in with_x:
            xsegs = [memoryview(xs[layer, rows].contiguous().view(torch.uint8).numpy()) for layer in range(MHA.layers)]
            assert tier.write_pages([(activations.activation_key(key), xsegs)], kind="activation") == [True]
    return keys


@pytest.fixture
def tier(tmp_path):
    from sglang_tiered.storage.namespace import Namespace
    from sglang_tiered.storage.ssd_tier import SSDTier

    ns = Namespace(model="m", dtype="torch.float32", page_size=PS, layout="layer_first", layer_num=MHA.layers,
                   kv_heads=MHA.kv_heads, head_dim=MHA.head_dim)
    t = SSDTier(tmp_path, ns, 1 << 30, io_threads=2)
    yield t
    t.close()


def tier_pages(tier, keys, activations=True):
    from sglang_tiered.engine.page_span import TierPages

    return TierPages(tier, keys, layers=MHA.layers, page_size=PS, kv_heads=MHA.kv_heads, head_dim=MHA.head_dim,
                     dtype=torch.float32, hidden=MHA.hidden, activations=activations)


def test_stored_pages_load_exactly_and_read_fewer_bytes(mha, tier):
    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={2, 3, 4})
    source = tier_pages(tier, keys)
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=source, split=1)
    assert res.recomputed_pages == 3 and source.act_misses == 1  # page 1 has none: read as KV
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    x_page, kv_page = PS * MHA.hidden * 4, PS * 2 * MHA.kv_heads * MHA.head_dim * 4
    assert source.bytes_x == 3 * x_page * MHA.layers and source.bytes_kv == kv_page * MHA.layers
    as_kv = tier_pages(tier, keys, activations=False)  # activations off: every page as KV, the same result
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=as_kv, split=0)
    assert res.recomputed_pages == 0 and as_kv.bytes_x == 0 and as_kv.bytes_kv == 5 * kv_page * MHA.layers
    assert torch.equal(res.kv[:, :80], kv[:, :80])


def test_two_loader_threads_load_stored_pages_exactly_and_count_each_read_once(mha, tier):
    """`loaders=2`: the same KV and counters as one loader (TierPages.read on two threads at once), and read_s is
    the wall time reads ran, not their sum."""
    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={0, 2, 3})
    source = tier_pages(tier, keys)
    t = time.perf_counter()
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=source, split=0, loaders=2)
    wall = time.perf_counter() - t
    assert res.loaded_pages == 5 and res.recomputed_pages == 3 and source.act_misses == 2
    x_page, kv_page = PS * MHA.hidden * 4, PS * 2 * MHA.kv_heads * MHA.head_dim * 4
    assert source.bytes_x == 3 * x_page * MHA.layers and source.bytes_kv == 2 * kv_page * MHA.layers
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    assert 0 < source.read_s <= res.load_s <= wall


def test_missing_or_corrupt_activations_fall_back_to_that_pages_kv(mha, tier):
    from sglang_tiered.storage import activations

    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={0, 2, 3})  # pages 1, 4 have no activations
    path = tier._path(activations.activation_key(keys[2]))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x55  # the last layer's activations of page 2
    path.write_bytes(bytes(raw))
    source = tier_pages(tier, keys)
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=source, split=0)
    assert source.act_misses == 3 and res.recomputed_pages == 2  # pages 0 and 3 recomputed
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    assert not tier.contains(activations.activation_key(keys[2])) and tier.stats.corrupt_pages == 1


def test_a_missing_or_corrupt_kv_page_ends_the_load(mha, tier):
    from sglang_tiered.engine.span_miss import SpanMiss

    model, ids, _, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x=set())
    path = tier._path(keys[4])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(SpanMiss, match=keys[4]):
        meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=tier_pages(tier, keys), split=0)
    assert not tier.contains(keys[4])
    tier._path(keys[2]).unlink()  # a page gone from disk: a miss too
    with pytest.raises(SpanMiss, match=keys[2]):
        meet_prefill(model, ids[:64], ids[64:], prefix_len=0, source=tier_pages(tier, keys[:4]), split=1)
