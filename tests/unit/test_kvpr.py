"""Partial-recompute loading (KVPR) without SGLang: the split arithmetic, the engine's exactness at every split,
and per-layer reads of stored pages (checksums per segment, corrupt activations fall back to KV)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tiered.engine.kvpr import MemorySpan, kvpr_prefill, prefill_with_inputs
from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.policy.kvpr import Profile, Shape, choose_split, gate, load_time
from sglang_tiered.storage.page_file import CorruptPage, ForeignPage, PageReader, write_page

MHA = LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=6, head_dim=16, intermediate=192, vocab=300)


# ---------------------------------------------------------------------------------------------- split arithmetic
def mha_shape(layers=30):
    return Shape(layers=layers, x_bytes=576 * 2, kv_bytes=2 * 9 * 64 * 2)


def test_gate_refuses_gqa_models_where_activations_are_larger():
    smollm2 = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 3 * 64 * 2)  # GQA 9/3: X is 1.5x its KV
    assert gate(smollm2) is not None and "1.50x" in gate(smollm2)
    split = choose_split(64, 64, 16, smollm2, Profile(1e6, 1e-9, 1e-6))  # even a very slow link: l = 0
    assert split.pages == 0 and "GQA" in split.reason
    assert gate(mha_shape()) is None


@pytest.mark.parametrize("mbps,rec_us", [(50, 20), (100, 20), (200, 20), (3000, 20), (100, 200), (50, 1)])
def test_choose_split_is_the_exact_minimum_over_pages(mbps, rec_us):
    shape, prof = mha_shape(), Profile(mbps * 1e6, rec_us * 1e-6, 50e-6)
    pages, ps, new = 40, 64, 32
    split = choose_split(pages, ps, new, shape, prof)
    times = [load_time(p * ps, pages * ps, new, shape, prof) for p in range(pages + 1)]
    assert split.pages == min(range(pages + 1), key=lambda p: (times[p], p))
    assert math.isclose(split.predicted_s, times[split.pages]) and math.isclose(split.full_s, times[0])


def test_split_follows_the_link_speed():
    shape = mha_shape()
    fast = choose_split(64, 64, 16, shape, Profile(20e9, 20e-6, 50e-6))  # a 20 GB/s link: recompute never pays
    slow = choose_split(64, 64, 16, shape, Profile(50e6, 20e-6, 50e-6))
    assert fast.pages == 0 and slow.pages > 0 and slow.predicted_s < 0.8 * slow.full_s
    assert choose_split(64, 64, 16, shape, Profile(50e6, 20e-6, 50e-6), max_pages=3).pages <= 3
    assert choose_split(64, 64, 16, shape, Profile(50e6, 20e-6, 50e-6), max_pages=0).reason == "no stored activations"


def test_a_split_below_the_minimum_gain_is_not_taken():
    from sglang_tiered.policy.kvpr import AUTO_MIN_GAIN, takes_over

    shape, prof = mha_shape(), Profile(1e9, 5e-6, 50e-6)  # 16 % predicted off the full load
    split = choose_split(64, 64, 16, shape, prof)
    assert split.pages > 0 and split.predicted_s > 0.8 * split.full_s  # a small predicted gain
    assert takes_over(split, split.full_s, min_gain=0.15) and not takes_over(split, split.full_s, min_gain=0.2)
    assert takes_over(split, split.predicted_s / (1 - AUTO_MIN_GAIN))  # exactly the default margin: taken


def test_calibration_recovers_both_costs_from_loads_with_different_splits():
    from sglang_tiered.policy.kvpr import Calibration

    true_rec, true_sto, layer_s = 9e-6, 4e-6, 50e-6
    prof = Profile(1e8, 3e-6, layer_s, 0.5e-6)  # the profile's guesses, both too low
    cal = Calibration()
    prof = cal.observe(prof, 30 * 32 * layer_s + 4096 * 30 * true_sto, 0, 30 * 32, 4096 * 30)  # l = 0 only
    assert prof.recompute_s == 3e-6 and prof.stored_s == pytest.approx(true_sto)  # one unknown fitted
    for l_tok in (1024, 2048, 512):
        busy = 30 * 32 * layer_s + 30 * l_tok * true_rec + 4096 * 30 * true_sto
        prof = cal.observe(prof, busy, 30 * l_tok, 30 * 32, 4096 * 30)
    assert prof.recompute_s == pytest.approx(true_rec) and prof.stored_s == pytest.approx(true_sto)
    assert cal.observe(prof, 1.0, 0, 0, 0) == prof  # nothing stored: nothing learned


def test_load_time_of_a_full_load_is_transfer_or_compute_whichever_is_longer():
    shape, prof = mha_shape(layers=2), Profile(1e6, 1e-3, 1e-3)
    assert load_time(0, 100, 10, shape, prof) == max(2 * 10 * 1e-3, 100 * 2 * shape.kv_bytes / 1e6)


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def mha():
    model = LlamaModel.random(MHA, seed=3)
    ids = torch.randint(0, MHA.vocab, (100,), generator=torch.Generator().manual_seed(2))
    return model, ids, *prefill_with_inputs(model, ids)


@pytest.mark.parametrize("split", [0, 1, 37, 64, 80])
@pytest.mark.parametrize("p", [0, 12])
def test_every_split_reproduces_the_full_prefill(mha, split, p):
    model, ids, logits, kv, xs = mha
    s = 80 - p
    split = min(split, s)
    span = MemorySpan(kv[:, p:80], xs[:, p:80], split)
    res = kvpr_prefill(model, ids[80:], prefix_len=p, span=span, prefix_loader=(lambda layer: kv[layer, :p]))
    assert res.recomputed == split * MHA.layers
    torch.testing.assert_close(res.kv, kv[:, p:], rtol=1e-4, atol=1e-4)  # recomputed K, V == stored K, V
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)


def test_recompute_in_bf16_stays_within_the_dtype_tolerance(mha):
    model = LlamaModel.random(MHA, seed=3, dtype=torch.bfloat16)
    ids = mha[1]
    logits, kv, xs = prefill_with_inputs(model, ids)
    res = kvpr_prefill(model, ids[80:], prefix_len=0, span=MemorySpan(kv[:, :80], xs[:, :80], 48))
    torch.testing.assert_close(res.kv[:, :48].float(), kv[:, :48].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(res.kv[:, 48:80], kv[:, 48:80])  # the loaded part is the stored bytes


def test_a_failing_source_raises_from_the_engine(mha):
    model, ids, _, kv, xs = mha

    class Broken(MemorySpan):
        def fetch(self, layer):
            if layer == 2:
                raise OSError("disk gone")
            return super().fetch(layer)

    with pytest.raises(OSError, match="disk gone"):
        kvpr_prefill(model, ids[80:], prefix_len=0, span=Broken(kv[:, :80], xs[:, :80], 10))


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
PS = 16


def store_span(tier, model, kv, xs, tokens, with_x):
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
            assert tier.write_pages([(activations.activation_key(key), xsegs)]) == [True]
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


def page_span(tier, keys, recompute_pages):
    from sglang_tiered.engine.page_span import PageSpan

    return PageSpan(tier, keys, layers=MHA.layers, page_size=PS, kv_heads=MHA.kv_heads, head_dim=MHA.head_dim,
                    hidden=MHA.hidden, dtype=torch.float32, recompute_pages=recompute_pages)


def test_stored_pages_load_exactly_and_read_fewer_bytes(mha, tier):
    model, ids, logits, kv, xs = mha
    keys = store_span(tier, model, kv, xs, 80, with_x={0, 1, 2})
    span = page_span(tier, keys, 3)
    res = kvpr_prefill(model, ids[80:], prefix_len=0, span=span)
    span.close()
    assert res.recomputed == 3 * PS * MHA.layers and span.act_missing == span.act_corrupt == 0
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    x_page, kv_page = PS * MHA.hidden * 4, PS * 2 * MHA.kv_heads * MHA.head_dim * 4
    assert span.bytes_x == 3 * x_page * MHA.layers and span.bytes_kv == 2 * kv_page * MHA.layers


def test_missing_or_corrupt_activations_fall_back_to_that_pages_kv(mha, tier):
    from sglang_tiered.storage import activations

    model, ids, logits, kv, xs = mha
    keys = store_span(tier, model, kv, xs, 80, with_x={0, 2, 3})  # page 1 has no activations
    path = tier._path(activations.activation_key(keys[2]))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x55  # the last layer's activations of page 2
    path.write_bytes(bytes(raw))
    span = page_span(tier, keys, 4)
    res = kvpr_prefill(model, ids[80:], prefix_len=0, span=span)
    span.close()
    assert span.act_missing == 1 and span.act_corrupt == 1
    assert res.recomputed == (2 * MHA.layers + MHA.layers - 1) * PS  # pages 0, 3 everywhere; page 2 until the last
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    assert not tier.contains(activations.activation_key(keys[2])) and tier.stats.corrupt_pages == 1


def test_a_missing_or_corrupt_kv_page_ends_the_load(mha, tier):
    from sglang_tiered.engine.group_span import SpanMiss

    model, ids, _, kv, xs = mha
    keys = store_span(tier, model, kv, xs, 80, with_x=set())
    path = tier._path(keys[4])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    span = page_span(tier, keys, 0)
    with pytest.raises(SpanMiss, match=keys[4]):
        kvpr_prefill(model, ids[80:], prefix_len=0, span=span)
    span.close()
    assert not tier.contains(keys[4])
    with pytest.raises(SpanMiss):
        page_span(tier, keys, 0)


def test_the_two_sided_loader_pays_only_where_reading_the_span_outlasts_computing_pages():
    from sglang_tiered.policy.kvpr import MEET_MIN_PAGES, meet_pays, page_compute_s

    prof = Profile(read_bytes_per_s=100e6, recompute_s=1e-6, layer_s=25e-6, stored_s=1e-6)
    page_s = page_compute_s(prof, layers=30, page_size=64)
    assert abs(page_s - 30 * 64 * 26e-6) < 1e-9
    page_bytes = 1_474_560  # a SmolLM2 page in bf16
    # 16 pages at 100 MB/s: 0.24 s of reads > 2 pages of compute (0.1 s): two-sided; at 2 GB/s (12 ms): SGLang
    assert meet_pays(16, page_bytes, prof, page_s)
    assert not meet_pays(16, page_bytes, Profile(2e9, 1e-6, 25e-6, 1e-6), page_s)
    # exactly MEET_MIN_PAGES pages of compute: not yet
    assert not meet_pays(1, int(MEET_MIN_PAGES * page_s * prof.read_bytes_per_s), prof, page_s)
