"""Compute the front of a stored span while loading its back (`engine/meet.py`), without SGLang: the result equals a
full prefill at every meet point (forced: none, one page, the middle, all but one, all; and raced), with and
without an exact prefix before the span, on MHA and GQA shapes and on SmolLM2; a slow source makes compute take
more pages, a fast one less; an unreadable page abandons the load."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.meet import MemoryPages, _Claims, best_claim, meet_prefill
from sglang_tiered.engine.span_miss import SpanMiss

PS = 16
SHAPES = {
    "mha": LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=6, head_dim=16, intermediate=192, vocab=300),
    "gqa": LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=2, head_dim=16, intermediate=192, vocab=300),
}


def case(model: LlamaModel, prefix: int, pages: int, new: int, seed: int = 0):
    """A prompt [prefix | span of `pages` pages | new tokens], its reference prefill, and the stored span."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab, (prefix + pages * PS + new,), generator=g)
    ref = model.prefill(ids)
    span = MemoryPages(ref.kv[:, prefix : prefix + pages * PS].clone(), PS)
    return ids, ref, span


def run(model, ids, ref, span, prefix: int, **kw):
    s = span.pages * PS
    res = meet_prefill(model, ids[prefix : prefix + s], ids[prefix + s :], prefix_len=prefix, source=span,
                       prefix_loader=(lambda layer: ref.kv[layer, :prefix]) if prefix else None, **kw)
    return res, model.logits(res.hidden[None])[0]


@pytest.fixture(params=sorted(SHAPES))
def model(request) -> LlamaModel:
    return LlamaModel.random(SHAPES[request.param], seed=3)


@pytest.mark.parametrize("loaders", [1, 2])
@pytest.mark.parametrize("prefix", [0, 2 * PS])
@pytest.mark.parametrize("split", [0, 1, 3, 5, 6, None])
def test_every_meet_point_equals_a_full_prefill(model, prefix, split, loaders):
    pages, new = 6, 5
    ids, ref, span = case(model, prefix, pages, new)
    t0 = time.perf_counter()
    res, logits = run(model, ids, ref, span, prefix, split=split, loaders=loaders)
    assert 0 < res.new_s < time.perf_counter() - t0 - res.compute_s  # the new tokens' layers come after the span's
    assert torch.allclose(logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert logits.argmax() == ref.logits.argmax()
    assert torch.allclose(res.kv, ref.kv[:, prefix:], atol=1e-5, rtol=1e-5)
    assert res.computed_pages + res.loaded_pages == pages
    assert sorted(span.reads) == list(range(res.computed_pages, pages))  # each loaded page read once
    if split is not None:
        assert res.computed_pages == split
    assert sum(pages for _, pages, _ in res.chunks) == res.computed_pages  # compute's claims, as logged
    assert all(seconds > 0 for _, _, seconds in res.chunks)
    if loaders == 1:
        assert span.reads == sorted(span.reads, reverse=True)  # the loader goes back to front


def test_two_loader_threads_bring_a_span_in_faster_from_a_source_that_serves_two_reads_at_once():
    """A source whose reads take 50 ms each and overlap (a disk with a queue): two loaders take the span in about
    half the time, with the same KV."""
    model = LlamaModel.random(SHAPES["gqa"], seed=1)
    ids, ref, span = case(model, 0, 8, 2)
    one, _ = run(model, ids, ref, MemoryPages(span.kv, PS, delay_s=0.05), 0, split=0)
    two, logits = run(model, ids, ref, MemoryPages(span.kv, PS, delay_s=0.05), 0, split=0, loaders=2)
    assert one.loaded_pages == two.loaded_pages == 8 and torch.equal(one.kv, two.kv)
    assert one.load_s >= 0.4 and two.load_s < 0.75 * one.load_s
    assert logits.argmax() == ref.logits.argmax()


def test_an_unreadable_page_abandons_a_load_on_two_threads():
    model = LlamaModel.random(SHAPES["gqa"], seed=1)
    ids, ref, span = case(model, 0, 6, 2)
    with pytest.raises(SpanMiss, match="page 4"):
        run(model, ids, ref, MemoryPages(span.kv, PS, fail=frozenset({4})), 0, split=0, loaders=2)


def test_the_loaded_pages_are_the_stored_copy_bit_for_bit(model):
    ids, ref, span = case(model, PS, 4, 3)
    stored = span.kv.clone()
    stored[:, 2 * PS :] += 1.0  # a stored copy that differs: the loaded half must be it, untouched
    res, _ = run(model, ids, ref, MemoryPages(stored, PS), PS, split=2)
    assert torch.equal(res.kv[:, 2 * PS : 4 * PS], stored[:, 2 * PS :])
    assert torch.allclose(res.kv[:, : 2 * PS], ref.kv[:, PS : 3 * PS], atol=1e-5)  # the computed front


def test_the_meet_point_follows_the_speed_of_the_source():
    model = LlamaModel.random(SHAPES["gqa"], seed=1)
    ids, ref, span = case(model, 0, 12, 4)
    slow = MemoryPages(span.kv, PS, delay_s=0.2)  # a page every 0.2 s: compute takes most of the span
    res_slow, logits_slow = run(model, ids, ref, slow, 0)
    fast = MemoryPages(span.kv, PS)  # instant reads: the loader takes most of it
    res_fast, logits_fast = run(model, ids, ref, fast, 0)
    assert res_slow.computed_pages > res_fast.computed_pages
    assert res_slow.computed_pages >= 6 and res_fast.loaded_pages >= 6
    for logits in (logits_slow, logits_fast):
        assert logits.argmax() == ref.logits.argmax() and torch.allclose(logits, ref.logits, atol=1e-4)


def test_with_a_compute_estimate_a_fast_source_is_loaded_and_a_slow_one_computed():
    """The claim rule: compute takes a page only if it finishes before the loader, at its measured rate, would get
    there. Instant reads: nothing computed after the loader's first read is measured. Slow reads: compute still takes
    most of the span."""
    wide = LlamaConfig(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, intermediate=1024, vocab=300)
    model = LlamaModel.random(wide, seed=1)  # a page's compute (ms) well above a memory read and a thread start
    ids, ref, span = case(model, 0, 12, 4)
    model.prefill(ids[: 2 * PS])  # warm
    t = time.perf_counter()
    model.prefill(ids[: 2 * PS])
    per_page = (time.perf_counter() - t) / 2
    fast, _ = run(model, ids, ref, MemoryPages(span.kv, PS), 0, page_compute_s=per_page)
    assert fast.computed_pages <= 1 and fast.loaded_pages >= 11  # (one chunk if the loader's thread started late)
    slow, logits = run(model, ids, ref, MemoryPages(span.kv, PS, delay_s=0.5), 0, page_compute_s=per_page)
    assert slow.computed_pages >= 8 and logits.argmax() == ref.logits.argmax()


def test_an_unreadable_page_abandons_the_load():
    model = LlamaModel.random(SHAPES["gqa"], seed=1)
    ids, ref, span = case(model, 0, 6, 2)
    with pytest.raises(SpanMiss, match="page 5"):
        run(model, ids, ref, MemoryPages(span.kv, PS, fail=frozenset({5})), 0, split=3)
    with pytest.raises(ValueError, match="split 7"):
        run(model, ids, ref, span, 0, split=7)


@pytest.mark.model
def test_smollm2_in_fp32_gives_the_same_greedy_tokens_at_every_meet_point():
    from sglang_tiered.models import default_model_path

    model = LlamaModel.from_pretrained(default_model_path(), torch.float32)
    ids, ref, span = case(model, PS, 8, 6, seed=5)
    for split in (0, 1, 4, 7, 8, None):
        res, logits = run(model, ids, ref, span, PS, split=split)
        assert logits.argmax() == ref.logits.argmax(), split
        assert torch.allclose(logits, ref.logits, atol=1e-3, rtol=1e-3), split


def test_compute_stays_out_while_reads_are_fast_next_to_it(model):
    """With reads far quicker than a page's compute the loader takes the whole span; with slow reads compute joins
    (the same span, the same answer)."""
    ids, ref, span = case(model, 0, 6, 3)
    fast, logits = run(model, ids, ref, span, 0, page_compute_s=1.0)
    assert fast.computed_pages == 0 and fast.loaded_pages == 6
    slow, slow_logits = run(model, ids, ref, MemoryPages(span.kv, PS, delay_s=0.2), 0, page_compute_s=0.05)
    assert slow.computed_pages > 0
    assert torch.allclose(logits, slow_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("free, compute_s, read_s, want", [
    (16, 0.028, 0.029, 8),  # the lines cross at 8.1: 8 ends at 0.232 s, 9 at 0.252 s
    (8, 0.028, 0.029, 4),
    (3, 0.040, 0.010, 0),  # one page's compute (0.04 s) outlasts reading all three (0.03 s): none
    (2, 0.010, 0.030, 2),  # rounding down would take 1 and leave the loader 0.03 s; both: 0.02 s
    (5, 0.010, 0.010, 2),  # a tie (2 and 3 pages both end at 0.03 s): the smaller
    (1, 0.010, 1.000, 1),
])
def test_the_claim_is_the_chunk_that_ends_the_span_soonest(free, compute_s, read_s, want):
    assert best_claim(free, compute_s, read_s) == want


@pytest.mark.parametrize("free, compute_s, read_s, floor_s, want", [
    (16, 0.028, 0.029, 0.0, 8),  # no floor: as above
    (64, 0.0023, 0.0265, 0.04, 59),  # 59 pages take 0.136 s, far above the floor: the lines' crossing
    (6, 0.0023, 0.0090, 0.058, 0),  # a 6-page tail: the loader alone (0.054 s) ends before the floor (0.058 s)
    (7, 0.0023, 0.0090, 0.058, 7),  # 7: the floor pays for all (0.016 s of pages) and ends before the loader (0.063)
    (20, 0.0023, 0.0090, 0.058, 20),  # the floor pays for 25 pages: all 20 (the crossing, 16, ends at the floor too)
    (7, 0.0, 0.0090, 0.058, 7),  # compute free of cost (once a division by it): the floor against the loader alone
])
def test_a_chunk_floor_claims_what_it_pays_for_or_nothing(free, compute_s, read_s, floor_s, want):
    """On a GPU a chunk of a few pages takes as long as the host needs to launch its kernels (measured on an H200:
    1-6 pages 0.058-0.061 s, 16 pages 0.035-0.05 s): a claim pays at least that floor, so compute claims nothing where
    the loader alone ends first, and else every page the floor pays for."""
    assert best_claim(free, compute_s, read_s, floor_s) == want


def test_a_chunk_no_longer_than_the_floor_leaves_the_compute_rate_as_it_was():
    claims = _Claims(16, None, page_compute_s=0.002, page_read_s=0.03, chunk_floor_s=0.05)
    claims.computed(2, 0.05)  # the floor's time, not its pages'
    assert claims.page_compute_s == 0.002
    claims.computed(32, 0.096)
    assert claims.page_compute_s == 0.003


def test_before_the_first_read_compute_claims_by_the_read_estimate():
    """With the profile's estimate of a read, compute starts on the span at once (no wait for a first read that
    takes 29 ms); without one, a read in flight for next to no time counts as fast and compute stays out."""
    estimated = _Claims(16, None, page_compute_s=0.028, page_read_s=0.029)
    assert estimated.next_chunk(4) == range(0, 4)
    blind = _Claims(16, None, page_compute_s=0.028)
    assert blind.next_chunk(4) == range(0)


def test_once_a_read_is_in_the_reads_decide_not_the_estimate():
    """A span still in the page cache reads fast behind a disk the profile knows as slow: one 1 ms read keeps compute
    out although the estimate says 59 ms a read (a chunk claimed on the estimate would hold the load up; before any
    read is in, the estimate decides: `test_before_the_first_read_compute_claims_by_the_read_estimate`)."""
    claims = _Claims(16, None, page_compute_s=0.045, page_read_s=0.059)
    assert claims.next_load() == 15
    claims.loaded(0.001)
    assert claims.next_chunk(4) == range(0)


def test_a_read_in_flight_counts_from_its_own_start():
    """Time before the loader's first read (its thread waking, a GPU stream's first copy) is no read time: with the
    estimate saying reads are fast, compute stays out however long the loader takes to start; a read that has been in
    flight long enough to make computing pay brings compute in."""
    claims = _Claims(16, None, page_compute_s=0.028, page_read_s=0.0005)
    time.sleep(0.02)  # the loader has not started
    assert claims.next_chunk(4) == range(0)
    assert claims.next_load() == 15
    time.sleep(0.03)  # its first read is slow
    assert claims.next_chunk(4) == range(0, 4)


def test_one_stall_between_fast_reads_is_not_the_rate_and_a_run_of_slow_reads_is():
    """A kernel throttle passes reads in bursts and stalls about one in ten (measured at 200 MB/s: 2-3 ms reads,
    40-70 ms stalls): after fast reads, a read in flight for longer than a quarter of a page's compute counts as one
    read among them and leaves compute out; once the reads themselves are that slow, compute joins."""
    claims = _Claims(16, None, page_compute_s=0.2, page_read_s=0.002)
    for _ in range(4):
        claims.next_load()
        claims.loaded(0.002)
    assert claims.next_load() == 11
    time.sleep(0.06)  # a stall: longer than a quarter of a page's compute (0.05 s), 13.6 ms a read with the others
    assert claims.next_chunk(4) == range(0)
    claims.loaded(0.06)
    for _ in range(3):
        claims.next_load()
        claims.loaded(0.06)
    assert claims.next_chunk(4) == range(0, 2)  # 8 pages free at 60 ms a read: 2 pages end the span soonest


def test_with_two_loader_threads_a_page_comes_in_every_half_read():
    """Two threads reading 60 ms each bring a page in every 30 ms: of 8 free pages computing at 100 ms each, compute
    takes 2 (max(0.2, 6 x 0.03) s); one thread at 60 ms a page leaves it 3 (max(0.3, 5 x 0.06) s)."""
    taken = {}
    for workers in (1, 2):
        claims = _Claims(16, None, page_compute_s=0.1, page_read_s=0.002, workers=workers)
        for _ in range(8):
            claims.next_load()
        for _ in range(4):
            claims.loaded(0.06)
        taken[workers] = claims.next_chunk(4)
    assert taken == {1: range(0, 3), 2: range(0, 2)}


def test_where_the_first_read_in_flight_does_not_count_the_estimate_stands_until_it_is_in():
    """A CUDA loader's first copy takes 2-4x its next ones: there (first_in_flight=False) a slow first read in flight
    leaves compute out while the estimate says reads are fast; once a read is in, the next one in flight counts."""
    claims = _Claims(16, None, page_compute_s=0.028, page_read_s=0.0005, first_in_flight=False)
    assert claims.next_load() == 15
    time.sleep(0.03)  # a slow first copy
    assert claims.next_chunk(4) == range(0)
    claims.loaded(0.002)
    assert claims.next_load() == 14
    time.sleep(0.03)
    assert claims.next_chunk(4) == range(0, 4)


def test_waiting_for_the_loader_to_finish_returns_when_it_does_and_not_at_each_read():
    claims = _Claims(2, None, page_compute_s=0.028, page_read_s=0.002)
    t = time.perf_counter()
    claims.next_load()
    claims.loaded(0.001)  # a read: no wake-up
    claims.wait_done(0.05)
    assert time.perf_counter() - t >= 0.05
    claims.next_load()
    claims.loaded(0.001)  # the loader reached compute (page 0): done
    t = time.perf_counter()
    claims.wait_done(5.0)
    assert time.perf_counter() - t < 1.0


def test_a_reused_buffer_gives_the_same_result_and_is_reused():
    from sglang_tiered.engine.scratch import KVScratch

    model = LlamaModel.random(SHAPES["gqa"], seed=3)
    scratch = KVScratch()
    ids, ref, span = case(model, 0, 6, 5)
    fresh, _ = run(model, ids, ref, span, 0, split=2)
    big = scratch.take(model, ids.shape[0] + PS)
    big.fill_(float("nan"))  # what a previous request left there must not matter
    out = scratch.take(model, ids.shape[0])
    assert out.is_contiguous() and out.data_ptr() == big.data_ptr() and scratch.nbytes == big.nbytes
    reused, _ = run(model, ids, ref, span, 0, split=2, out=out)
    assert torch.equal(reused.kv, fresh.kv) and torch.equal(reused.hidden, fresh.hidden)
    assert reused.kv.data_ptr() == out.data_ptr()
    grown = scratch.take(model, 2 * ids.shape[0])
    assert grown.shape[1] == 2 * ids.shape[0] and scratch.nbytes == grown.numel() * grown.element_size()
    with pytest.raises(ValueError, match="need"):
        run(model, ids, ref, span, 0, split=2, out=scratch.take(model, ids.shape[0] - 1))


def test_the_engine_and_its_miss_need_no_store():
    """A page source raises `SpanMiss` without the store's checksum (which needs zlib-ng: a GPU machine's image may
    lack it): `engine.meet` with a memory source misses as it should with zlib-ng blocked."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['zlib_ng'] = None  # any import of it fails\n"
        "import torch\n"
        "from sglang_tiered.engine.meet import MemoryPages\n"
        "from sglang_tiered.engine.span_miss import SpanMiss\n"
        "try:\n"
        "    MemoryPages(torch.zeros(1, 4, 2, 1, 2), 2, fail=frozenset({1})).read(1)\n"
        "except SpanMiss as exc:\n"
        "    print('miss:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "miss: page 1 unreadable"


def test_the_prefix_is_read_once_per_layer_however_many_chunks():
    """The cached prefix's KV is gathered once per layer into the load's buffer (attention then reads it in place),
    not once per chunk and layer; the result is a full prefill's."""
    model = LlamaModel.random(SHAPES["gqa"], seed=5)
    prefix, pages = 2 * PS, 6
    ids, ref, span = case(model, prefix, pages, 4)
    calls: list[int] = []

    def reader(layer: int) -> torch.Tensor:
        calls.append(layer)
        return ref.kv[layer, :prefix]

    res = meet_prefill(model, ids[prefix : prefix + pages * PS], ids[prefix + pages * PS :], prefix_len=prefix,
                       source=span, prefix_loader=reader, split=4, chunk=1)
    assert len(res.chunks) == 4 and calls == list(range(model.cfg.layers))
    assert torch.allclose(res.kv, ref.kv[:, prefix:], atol=1e-5, rtol=1e-5)
    assert model.logits(res.hidden[None])[0].argmax() == ref.logits.argmax()
