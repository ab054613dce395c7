"""Compute-or-load with activations (KVPR) without SGLang: the decisions' arithmetic, the two-sided engine's
exactness when the loader reads pages as activations (at every meet point), and stored pages read from the SSD
tier (checksums per segment; missing or corrupt activations fall back to that page's KV)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from sglang_tiered.engine.kvpr_profile import ProfileTries, measure_chunks, measure_compute, settled_layer_s
from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.meet import MemoryPages, meet_prefill
from sglang_tiered.kernels.extend_attention import causal_attention
from sglang_tiered.policy.compute_choice import ALONE, COMPUTE, MEET
from sglang_tiered.policy.kvpr import (
    MEET_LOADERS,
    MEET_MIN_PAGES,
    MEET_MIN_READ_SHARE,
    MEET_PRICED_MARGIN,
    MEET_TAKE_READ_SHARE,
    Decision,
    Priced,
    Profile,
    Route,
    Shape,
    Slowdown,
    activation_read_s,
    activations_pay,
    auto_example,
    beside,
    chunk_page_s,
    chunk_slowdown,
    decide,
    early_as_kv,
    gate,
    join_margin,
    loaders,
    meet_pays,
    page_compute_s,
    page_read_s,
    reads_as_auto,
    route,
    warm_alone,
)
from sglang_tiered.policy.read_rate import moving_average
from sglang_tiered.storage.page_file import CorruptPage, ForeignPage, PageReader, write_page
from tests.page_cache import drop_from_page_cache

MHA = LlamaConfig(hidden=96, layers=4, heads=6, kv_heads=6, head_dim=16, intermediate=192, vocab=300)
PS = 16


# ---------------------------------------------------------------------------------------------- decisions
def mha_shape(layers=30):
    return Shape(layers=layers, x_bytes=576 * 2, kv_bytes=2 * 9 * 64 * 2)


def test_gate_refuses_gqa_models_where_activations_are_larger():
    smollm2 = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 3 * 64 * 2)  # GQA 9/3: X is 1.5x its KV
    assert gate(smollm2) is not None and "1.50x" in gate(smollm2)
    assert not activations_pay(smollm2, Profile(1e6, 1e-12, 1e-6), 64)  # even a very slow link and free recompute
    assert gate(mha_shape()) is None


def test_activations_pay_where_the_bytes_saved_outweigh_the_recompute():
    shape = mha_shape()  # X 1152 B, KV 2304 B per token-layer: 1152 B saved
    assert activations_pay(shape, Profile(100e6, 1e-6, 25e-6), 64)  # 11.5 us saved vs 1 us recompute
    assert not activations_pay(shape, Profile(20e9, 1e-6, 25e-6), 64)  # 20 GB/s: 0.06 us saved
    # one thread (a page computed in 1.9 ms: compute beside a one-thread loader, 1.3 ms a page, beats the loader
    # alone on two threads, 1.9 ms, by more than the margin): read + recompute against 2 us for KV, a read 1 us: X
    # where the recompute takes a little less than 1 us, KV where a little more
    for recompute, pays in ((0.99e-6, True), (1.01e-6, False)):
        prof = Profile(1152 / 1e-6, recompute, 1e-6)
        assert activation_read_s(shape, prof, 64)[1] == 1 and activations_pay(shape, prof, 64) == pays
    assert page_read_s(shape, Profile(100e6, 1e-6, 25e-6), 64, True) == pytest.approx(30 * 64 * (11.52e-6 + 1e-6))
    assert page_read_s(shape, Profile(100e6, 1e-6, 25e-6), 64, False) == pytest.approx(30 * 64 * 23.04e-6)


def test_activations_on_two_threads_cost_the_slower_of_read_and_recompute():
    """Where an activation load is too fast for compute to join, two threads read one page beside another's
    recompute: a page every max(read, recompute) per token-layer -- the measured cost once activation loads are in."""
    shape, tl = mha_shape(), 30 * 64  # token-layers in a page
    # 200 MB/s, the profile's recompute 7.8 us, a layer 57 us + 3 us stored: a page's compute 115.2 ms
    prof = Profile(200e6, 7.8e-6, 57e-6, 3e-6)
    seconds, threads = activation_read_s(shape, prof, 64)
    assert threads == MEET_LOADERS and seconds == pytest.approx(tl * 7.8e-6)  # 15.0 ms < 28.8 ms: alone
    assert page_read_s(shape, prof, 64, False) == pytest.approx(tl * 11.52e-6)  # KV: 22.1 ms
    assert activations_pay(shape, prof, 64)  # read then recompute on one thread, 13.56 us, would have said KV
    d = decide(shape, prof, 16, 64, stored_activations=True, forced=False)
    assert d.activations and d.take and not d.compute_joins and loaders(d, None) == MEET_LOADERS
    assert d.read_s == pytest.approx(tl * 7.8e-6)
    # activation loads measured at 13 us per token-layer: slower than KV's 11.52 us, so KV
    measured = replace(prof, x_load_s=13e-6)
    assert activation_read_s(shape, measured, 64) == (pytest.approx(tl * 13e-6), MEET_LOADERS)
    assert not activations_pay(shape, measured, 64)
    assert not decide(shape, measured, 16, 64, stored_activations=True, forced=False).activations
    # the disk's own speed (1 GB/s): KV, 2.3 us, whatever the recompute
    assert not activations_pay(shape, Profile(1e9, 7.8e-6, 57e-6, 3e-6), 64)
    # 100 MB/s: the read (11.52 us) is the slower side, 22.1 ms a page, still alone: X on two threads
    at_100 = Profile(100e6, 7.8e-6, 57e-6, 3e-6)
    assert activation_read_s(shape, at_100, 64) == (pytest.approx(tl * 11.52e-6), MEET_LOADERS)
    # 50 MB/s: 44.2 ms a page on two threads; compute (115.2 ms) beside one thread (59.6 ms) would bring one in
    # every 39.3 ms, not 1.25x faster: alone
    at_50 = Profile(50e6, 7.8e-6, 57e-6, 3e-6)
    assert activation_read_s(shape, at_50, 64) == (pytest.approx(tl * 23.04e-6), MEET_LOADERS)
    # 25 MB/s: 88.5 ms alone against 54.5 ms together: compute joins a one-thread loader, read then recompute
    at_25 = Profile(25e6, 7.8e-6, 57e-6, 3e-6)
    assert activation_read_s(shape, at_25, 64) == (pytest.approx(tl * (46.08e-6 + 7.8e-6)), 1)
    slow = decide(shape, at_25, 16, 64, stored_activations=True, forced=False)
    assert slow.activations and slow.compute_joins and loaders(slow, None) == 1
    # the measured case: 235 MB/s, a chunk 44.5 ms + 13.68 us per token-layer (37.4 ms a page in chunks of 4),
    # recompute 3.95 us: 9.4 ms a page alone, at the KV rule's threshold (0.25 x 37.4 ms), but 14.6 ms together
    # (with the margin): alone, on two threads
    measured_200 = Profile(235e6, 3.95e-6, 48.6e-6, 4.84e-6, chunk_s=0.0445, span_s=13.68e-6)
    assert activation_read_s(shape, measured_200, 64) == (pytest.approx(tl * 1152 / 235e6), MEET_LOADERS)
    alone = decide(shape, measured_200, 126, 64, stored_activations=True, forced=False)
    assert not alone.compute_joins and alone.join_share == pytest.approx(1.25 * 17.0 / (17.0 + 37.4), abs=0.003)
    # at run time too: 9.4 ms a page passes the KV rule (a quarter of 37.4 ms), so compute would have joined the
    # two threads; with the load's own share it joins only once the pages come in 1.6x slower than planned
    full_s = chunk_page_s(measured_200, 30, 64)
    assert full_s == pytest.approx(0.0374, abs=1e-4)
    assert alone.read_s >= MEET_MIN_READ_SHARE * full_s and alone.read_s < alone.join_share * full_s
    assert 1.6 * alone.read_s >= alone.join_share * full_s
    # where compute is planned to join (25 MB/s) or the loader reads KV, the run-time rule is the KV rule
    assert slow.join_share == MEET_MIN_READ_SHARE
    assert decide(shape, replace(measured_200, x_load_s=13e-6), 126, 64, stored_activations=True,
                  forced=False).join_share == MEET_MIN_READ_SHARE


def test_auto_reads_alone_where_reads_are_fast_next_to_compute():
    prof = Profile(read_bytes_per_s=100e6, recompute_s=1e-6, layer_s=25e-6, stored_s=1e-6)
    page_s = page_compute_s(prof, layers=30, page_size=64)
    assert abs(page_s - 30 * 64 * 26e-6) < 1e-9
    smollm2 = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 3 * 64 * 2)  # a page: 1.47 MB in bf16
    # at 100 MB/s a page reads in 14.7 ms against 49.9 ms of compute (0.30): two-sided; at 2 GB/s: the loader alone
    assert page_read_s(smollm2, prof, 64, False) >= MEET_MIN_READ_SHARE * page_s
    assert "two-sided" in auto_example(smollm2, prof, 64)
    fast = Profile(2e9, 1e-6, 25e-6, 1e-6)  # 0.7 ms a page: 16 pages read in less than 2 pages' compute
    assert not meet_pays(16, page_read_s(smollm2, fast, 64, False), page_s)
    assert "SGLang's own load" in auto_example(smollm2, fast, 64, tokens=1024)
    # 256 pages read in 0.19 s, longer than 2 pages' compute, but compute would not join: our loader alone on KV is
    # SGLang's load with more CPU work per byte, so SGLang loads it
    big = decide(smollm2, fast, 256, 64, stored_activations=False, forced=False)
    assert meet_pays(256, big.read_s, big.page_s) and not big.compute_joins and not big.take
    assert "too fast" in auto_example(smollm2, fast, 64, tokens=16384)
    assert not meet_pays(1, MEET_MIN_PAGES * page_s, page_s)  # exactly MEET_MIN_PAGES pages of compute: not yet
    assert "as activations" in auto_example(mha_shape(), prof, 64)


def test_auto_reads_a_span_alone_where_its_cold_pages_read_faster_than_two_pages_compute():
    """A span compute would gain on, most of it in the page cache (read at arrival, or still there from its write):
    only the cold pages at its front count; where they read faster than MEET_MIN_PAGES pages' compute, compute's
    first chunk would outlast the load, so the loader takes it alone. Not where nothing or too little is warm."""
    smollm2 = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 3 * 64 * 2)
    prof = Profile(read_bytes_per_s=25e6, recompute_s=1e-6, layer_s=25e-6, stored_s=1e-6)  # 59 ms a page's read
    d = decide(smollm2, prof, 64, 64, stored_activations=False, forced=False)
    assert d.take and d.read_s == pytest.approx(0.0590, abs=1e-4) and d.page_s == pytest.approx(0.0499, abs=1e-4)
    assert not warm_alone(64, 0, d)  # nothing warm: the two meet as before
    assert warm_alone(64, 64, d) and warm_alone(64, 63, d)  # all, or one cold page: 59 ms < 2 pages' 100 ms
    assert not warm_alone(64, 62, d)  # two cold pages: 118 ms, longer than 2 pages' compute
    assert not warm_alone(64, 10, d)  # most of it cold
    priced = replace(d, chunk_s=0.05)  # a chunk's fixed part raises the bar to 150 ms: two cold pages under it
    assert warm_alone(64, 62, priced) and not warm_alone(64, 61, priced)


def test_a_measured_chunk_decides_by_a_full_chunks_share_of_each_page():
    """SmolLM2 bf16 at 68 MB/s (a page's KV read in 21.7 ms): one page's layer time says 91 ms a page, and that is
    below a quarter of it (compute would stay out, two loader threads); measured, a chunk is 57 ms + 32 ms a page,
    46 ms a page in chunks of 4: compute joins, one loader thread, and its claims pay the chunk's fixed part."""
    smollm2 = Shape(layers=30, x_bytes=576 * 2, kv_bytes=2 * 3 * 64 * 2)
    layer_only = Profile(68e6, 3.2e-6, 46.1e-6, 1.38e-6)
    measured = replace(layer_only, chunk_s=0.057, span_s=0.032 / (30 * 64))
    assert chunk_page_s(layer_only, 30, 64) == pytest.approx(page_compute_s(layer_only, 30, 64)) == \
        pytest.approx(0.0912, abs=1e-4)
    assert page_compute_s(measured, 30, 64) == pytest.approx(0.032)
    assert chunk_page_s(measured, 30, 64) == pytest.approx(0.04625) and chunk_page_s(measured, 30, 64, 1) == \
        pytest.approx(0.089)
    before, after = (decide(smollm2, prof, 16, 64, stored_activations=False, forced=False)
                     for prof in (layer_only, measured))
    assert not before.compute_joins and loaders(before, None) == MEET_LOADERS
    assert after.compute_joins and after.take and loaders(after, None) == 1
    assert (after.page_s, after.chunk_s) == (pytest.approx(0.032), 0.057)
    # taking a span at all: reading it must outlast computing MEET_MIN_PAGES pages as one chunk (0.121 s here)
    assert not meet_pays(5, 0.024, after.page_s, after.chunk_s) and meet_pays(6, 0.024, after.page_s, after.chunk_s)
    assert "46.2 ms a page in chunks of 4" in auto_example(smollm2, measured, 64)


def test_measure_chunks_fits_a_fixed_part_and_a_part_per_token_layer(mha):
    model = mha[0]
    chunk_s, span_s = measure_chunks(model, PS, pages=4, repeats=2)
    assert chunk_s >= 0 and span_s > 0
    assert chunk_s + 4 * PS * model.cfg.layers * span_s < 1.0  # a 4-page chunk of this toy model: well under 1 s


def test_decide_forced_loads_read_activations_wherever_stored_and_take_every_span():
    fast = Profile(20e9, 1e-6, 25e-6)  # activations do not pay, the span reads in no time
    auto = decide(mha_shape(), fast, 16, 64, stored_activations=True, forced=False)
    assert not auto.take and not auto.activations and not auto.compute_joins
    forced = decide(mha_shape(), fast, 16, 64, stored_activations=True, forced=True)
    assert forced.take and forced.activations
    assert not decide(mha_shape(), fast, 16, 64, stored_activations=False, forced=True).activations
    slow = decide(mha_shape(), Profile(50e6, 1e-6, 25e-6), 16, 64, stored_activations=True, forced=False)
    assert slow.take and slow.activations and slow.compute_joins


def test_two_loader_threads_only_where_compute_is_not_expected_to_join():
    fast = decide(mha_shape(), Profile(20e9, 1e-6, 25e-6), 16, 64, stored_activations=False, forced=False)
    slow = decide(mha_shape(), Profile(50e6, 1e-6, 25e-6), 16, 64, stored_activations=False, forced=False)
    assert not fast.compute_joins and slow.compute_joins
    assert loaders(fast, None) == MEET_LOADERS == 2 and loaders(slow, None) == 1
    assert loaders(slow, 0) == MEET_LOADERS  # forced: the loader reads everything, compute nothing
    assert loaders(fast, 3) == 1  # forced: compute runs beside the loader


def test_route_gives_every_mode_and_decision_its_way_meet_point_and_threads():
    """`route` over every mode: exact ways, forced meet points and loader threads."""
    def decision(take, joins):
        return Decision(take, False, read_s=0.03, page_s=0.02, chunk_s=0.01, compute_joins=joins)

    joins, reads_fast = decision(True, True), decision(True, False)
    small, not_taken = decision(False, True), decision(False, False)  # compute would gain little (`meet_pays`)
    ways = {(ALONE, joins): Route(ALONE, 0, MEET_LOADERS), (ALONE, reads_fast): Route(ALONE, 0, MEET_LOADERS),
            (MEET, joins): Route(MEET, None, 1), (MEET, reads_fast): Route(MEET, None, MEET_LOADERS),
            (COMPUTE, joins): Route(COMPUTE, None, 0), (COMPUTE, reads_fast): Route(COMPUTE, None, 0)}
    for (chosen, d), expected in ways.items():  # `auto` where compute would gain: the way chosen, as chosen
        assert route("auto", d, 10, 64, anyway=False, chosen=chosen) == expected
    with pytest.raises(ValueError, match="needs the way chosen"):
        route("auto", joins, 10, 64, anyway=False, chosen=None)
    # `auto` where compute would gain little: SGLang's load, or, where our loader takes the span anyway, the loader
    # alone -- the meet point forced to 0 even where compute could join at run time (stop 50: one loader thread with
    # compute free to join took 0.63-0.72 s against 0.46-0.52 s alone on two)
    for d in (small, not_taken):
        assert route("auto", d, 10, 64, anyway=False, chosen=None) is None
        assert route("auto", d, 10, 64, anyway=True, chosen=None) == Route(None, 0, MEET_LOADERS)
    # `force`: the two meet; a timed MEET only where compute is expected to join
    assert route("force", joins, 10, 64, anyway=False, chosen=None) == Route(MEET, None, 1)
    assert route("force", reads_fast, 10, 64, anyway=False, chosen=None) == Route(None, None, MEET_LOADERS)
    # a number of tokens: whole pages of it computed, at most the span; the loader alone at 0
    cases = ((0, 0, MEET_LOADERS), (63, 0, MEET_LOADERS), (64, 1, 1), (320, 5, 1), (10**6, 10, 1))
    for tokens, pages, threads in cases:
        assert route(tokens, joins, 10, 64, anyway=False, chosen=None) == Route(None, pages, threads)


def test_a_forced_load_reads_as_auto_only_where_both_read_the_same_way():
    fast, slow = Profile(20e9, 1e-6, 25e-6), Profile(50e6, 1e-6, 25e-6)  # X pays only on the slow disk
    assert not reads_as_auto(mha_shape(), fast, 64, stored_activations=True)  # forced: X; auto: KV
    assert reads_as_auto(mha_shape(), slow, 64, stored_activations=True)  # both X
    assert reads_as_auto(mha_shape(), fast, 64, stored_activations=False)  # none stored: both KV
    for prof, stored in ((fast, True), (slow, True), (fast, False)):  # the same as the two decisions agreeing
        forced, auto = (decide(mha_shape(), prof, 16, 64, stored_activations=stored, forced=f) for f in (True, False))
        assert reads_as_auto(mha_shape(), prof, 64, stored_activations=stored) == (forced.activations ==
                                                                                   auto.activations)
    # under `auto`'s margin, which the profile carries: 200 MB/s, recompute 9 us, a page's compute 17.47 us per
    # token-layer: two threads bring a page in every 9 us against 8 us for compute beside one thread -- alone with
    # the 25 % margin of compute as measured alone (X, faster than KV's 11.52 us), one thread with the priced margin
    # of compute priced beside a loader (here at a factor of 1: read then recompute, 14.76 us: KV pays), so forced
    # loads reading X are samples of `auto` only under the first
    near = Profile(200e6, 9e-6, 17e-6, 0.47e-6)
    for prof, same in ((near, True), (beside(near, 1.0), False)):
        auto = decide(mha_shape(), prof, 16, 64, stored_activations=True, forced=False)
        assert auto.activations == same
        assert reads_as_auto(mha_shape(), prof, 64, stored_activations=True) == same


def test_auto_lets_the_loader_alone_take_a_fast_span_only_where_it_reads_activations():
    # 2 GB/s, recompute 0.5 us: X pays (two threads: max(0.58, 0.5) < 1.15 us per token-layer), a page comes in
    # every 1.1 ms against 49.9 ms of compute: compute cannot join, but the loader still reads half the bytes SGLang's
    # load would (128 pages: longer than computing 2 pages)
    fast = Profile(2e9, 0.5e-6, 25e-6, 1e-6)
    with_x = decide(mha_shape(), fast, 128, 64, stored_activations=True, forced=False)
    assert with_x.activations and with_x.read_s < MEET_TAKE_READ_SHARE * with_x.page_s and with_x.take
    assert "read by our loader, as activations" in auto_example(mha_shape(), fast, 64, tokens=65536)
    kv_only = decide(mha_shape(), fast, 1024, 64, stored_activations=False, forced=False)  # KV: SGLang loads it
    assert kv_only.read_s < MEET_TAKE_READ_SHARE * kv_only.page_s and not kv_only.take
    # 400 MB/s: 11.1 ms a KV page against 49.9 ms (0.22), below the engine's join share but within the looser
    # take share: taken, the load's own rates decide whether compute joins
    slower = decide(mha_shape(), Profile(400e6, 0.5e-6, 25e-6, 1e-6), 64, 64, stored_activations=False, forced=False)
    assert not slower.compute_joins and slower.take
    assert MEET_TAKE_READ_SHARE * slower.page_s <= slower.read_s < MEET_MIN_READ_SHARE * slower.page_s


def test_a_layer_timed_far_slower_than_the_whole_load_is_measured_again():
    """The profile's layer time contains no more than the whole load's time allows (the measured outlier: 2125 us
    per new token beside a load that fitted 77 us): measured again, the fastest kept, 3 measurements at most."""
    again = iter([90e-6, 60e-6, 1.0])
    assert settled_layer_s(2125e-6, lambda: next(again), bound=77e-6) == (90e-6, True)  # within 2x the bound: stops
    slow = iter([2000e-6, 1900e-6, 1.0])
    assert settled_layer_s(2125e-6, lambda: next(slow), bound=77e-6) == (1900e-6, False)  # 3 in all, the fastest
    assert settled_layer_s(80e-6, lambda: 1 / 0, bound=77e-6) == (80e-6, True)  # agrees: not measured again


def test_a_profile_that_disagrees_with_itself_is_taken_again_later_and_the_third_is_kept():
    tries = ProfileTries(tries=3, retry_s=5.0)
    assert tries.due(0.0)
    assert tries.drop(10.0, final=False)  # the first: dropped, the next not before 15 s
    assert not tries.due(14.9) and tries.due(15.0)
    assert tries.drop(15.0, final=False) and not tries.due(19.9) and tries.due(20.0)
    assert not tries.drop(20.0, final=False)  # the third: kept
    assert tries.dropped == 2
    waiting = ProfileTries(tries=3, retry_s=5.0)
    assert not waiting.drop(1.0, final=True) and waiting.dropped == 0 and waiting.due(1.0)  # a forced load keeps it


def test_measure_compute_gives_a_layer_time_the_whole_load_can_contain(mha):
    model = mha[0]
    recompute, layer_s, stored = measure_compute(model, tokens=64, new_tokens=16, repeats=3)
    assert 0 < recompute and 0 < layer_s and 0 <= stored
    assert layer_s < 1.0 / 16  # a layer of this 6-layer toy model takes well under a second for 16 tokens


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


def tier_pages(tier, keys, activations=True, cached_kv=False):
    from sglang_tiered.engine.page_span import TierPages

    return TierPages(tier, keys, layers=MHA.layers, page_size=PS, kv_heads=MHA.kv_heads, head_dim=MHA.head_dim,
                     dtype=torch.float32, hidden=MHA.hidden, activations=activations, cached_kv=cached_kv)


def drop(tier, key) -> None:
    """Drop the stored file `key` from the page cache."""
    drop_from_page_cache(tier._path(key))


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


def test_pages_read_early_as_kv_from_the_tier_load_exactly_with_the_rest_from_activations(mha, tier):
    """A span's back read at admission (engine/early_reads.py) as KV (`TierPages.read(kv=True)`: placed by a copy),
    its front by the forward as activations: the same KV as a full prefill, each page read once, every byte counted
    by the one source."""
    from sglang_tiered.engine.early_reads import EarlyReader

    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={0, 1, 2, 3, 4})
    source = tier_pages(tier, keys)
    reader = EarlyReader(1 << 30, 60.0)
    job = reader.start(source, 2, PS * MHA.layers * 2 * MHA.kv_heads * MHA.head_dim * 4,
                       lambda page: source.read(page, kv=True))
    deadline = time.monotonic() + 10
    while not all(job.pages.get(page) and job.pages[page].done() for page in (2, 3, 4)):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=source, split=0, loaders=2,
                       early=reader.take(job))
    assert res.early_pages == 3 and res.loaded_pages == 5 and res.recomputed_pages == 2  # pages 0, 1 from X
    x_page, kv_page = PS * MHA.hidden * 4, PS * 2 * MHA.kv_heads * MHA.head_dim * 4
    assert source.bytes_kv == 3 * kv_page * MHA.layers and source.bytes_x == 2 * x_page * MHA.layers
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(res.kv[:, 2 * PS : 80], kv[:, 2 * PS : 80])  # the stored copy, bit for bit


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


def test_the_first_read_probe_looks_at_the_file_the_loader_reads_first(mha, tier):
    """`TierPages.first_read_cached`: the last page's activation file where activations are read and stored, its KV
    file otherwise -- each dropped from the page cache apart from the other."""
    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={4})

    from sglang_tiered.storage import activations

    drop(tier, activations.activation_key(keys[-1]))
    assert tier_pages(tier, keys).first_read_cached() is False
    assert tier_pages(tier, keys, activations=False).first_read_cached() is True  # (the KV file is still cached)
    drop(tier, keys[-1])
    assert tier_pages(tier, keys, activations=False).first_read_cached() is False


def test_a_span_read_at_arrival_reads_a_page_whose_kv_is_in_the_page_cache_as_kv(mha, tier):
    """`cached_kv` (the launcher read the span's KV files into the page cache from the request's arrival): a page
    whose KV file is in the page cache is read as KV (a copy), one whose KV is not as its activations (fewer bytes
    from the disk); without `cached_kv` every stored activation page is read. The same KV either way."""
    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={0, 1, 2, 3, 4})
    for key in keys[:2]:  # pages 0 and 1 cold, 2-4 in the page cache (just written)
        drop(tier, key)
    source = tier_pages(tier, keys, cached_kv=True)
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=source, split=0)
    assert res.recomputed_pages == 2 and source.act_misses == 0  # pages 0 and 1 from activations
    assert source.bytes_kv == 3 * MHA.layers * 2 * PS * MHA.kv_heads * MHA.head_dim * 4
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)
    plain = tier_pages(tier, keys)
    assert meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=plain, split=0).recomputed_pages == 5


def test_a_span_evicted_from_the_page_cache_after_its_plan_is_read_from_the_disk_the_same(mha, tier):
    """A span `auto` found in the page cache at its plan (every KV file warm: our loader alone, `cached_kv`) whose
    files leave the page cache before the loader reads them: each page is read from the disk as planned for a cold
    page (its activations, recomputed), nothing missed, the same KV and logits as SGLang's forward."""
    from sglang_tiered.storage import activations

    model, ids, logits, kv, xs = mha
    keys = store_span(tier, kv, xs, 80, with_x={0, 1, 2, 3, 4})
    assert all(tier.in_page_cache(key) for key in keys)  # the plan's probe (KVPR._warm): 5 of 5 warm
    source = tier_pages(tier, keys, cached_kv=True)
    for key in keys:  # evicted between the plan and the read
        drop(tier, key)
        drop(tier, activations.activation_key(key))
    res = meet_prefill(model, ids[:80], ids[80:], prefix_len=0, source=source, split=0)
    assert res.recomputed_pages == 5 and source.act_misses == 0 and source.bytes_kv == 0
    assert source.bytes_x == 5 * PS * MHA.hidden * 4 * MHA.layers
    torch.testing.assert_close(res.kv, kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(res.hidden[None])[0], logits, rtol=1e-4, atol=1e-4)


def test_compute_beside_a_loader_is_priced_as_measured_there():
    """A server's numbers (the MHA model, Intel with AMX, bf16, 200 MB/s, a 1024-token span): the profile, measured
    alone, put a 4-page chunk at 31.1 ms + 4 x 23.0 ms; beside the loader's recomputes it took 0.419 s, and the
    loader was done at 0.308 s. Priced as measured beside the loader, compute no longer joins a loader reading at
    110 MB/s (alone: it had joined, and its one chunk outlasted the loader)."""
    shape, tl = mha_shape(), 30 * 64
    prof = Profile(175e6, 3.09e-6, 42.1e-6, 2.34e-6, chunk_s=0.0311, span_s=11.96e-6)
    page_s = page_compute_s(prof, 30, 64)
    assert page_s == pytest.approx(0.02296, abs=1e-5)
    slow = chunk_slowdown([(0.030, 4, 0.419)], 0.308, prof.chunk_s, page_s)
    assert slow == pytest.approx(0.419 / 0.1229, rel=1e-3)
    # only chunks that began while the loader read count; none: no sample
    assert chunk_slowdown([(0.0, 4, 0.2), (0.5, 2, 9.9)], 0.3, 0.02, 0.03) == pytest.approx(0.2 / 0.14)
    assert chunk_slowdown([(0.5, 2, 0.1)], 0.3, 0.02, 0.03) is None and chunk_slowdown([], 1.0, 0.02, 0.03) is None
    slowed = beside(prof, slow)
    assert page_compute_s(slowed, 30, 64) == pytest.approx(slow * page_s)
    assert chunk_page_s(slowed, 30, 64) == pytest.approx(slow * chunk_page_s(prof, 30, 64))
    assert (slowed.read_bytes_per_s, slowed.recompute_s) == (prof.read_bytes_per_s, prof.recompute_s)
    at_110 = replace(prof, read_bytes_per_s=110e6)  # a page's activations read in 20.1 ms, recomputed in 5.9
    alone, measured = (decide(shape, p, 16, 64, stored_activations=True, forced=False) for p in
                       (at_110, beside(at_110, slow)))
    assert alone.activations and alone.compute_joins and alone.read_s == pytest.approx(tl * (1152 / 110e6 + 3.09e-6))
    assert measured.activations and not measured.compute_joins and loaders(measured, None) == MEET_LOADERS
    # and at run time compute stays out of it too, unless the pages come in slower than planned
    assert measured.read_s < measured.join_share * chunk_page_s(beside(at_110, slow), 30, 64)
    # the server's record: the first load's sample is the factor; loads it keeps compute out of are counted, and
    # after 1, 2, 4, ... of them compute is let in once at the profile's times (a retry), its sample the new factor
    record = Slowdown()
    assert record.factor(True) == 1.0
    assert record.observe(True, slow) == pytest.approx(slow) and record.factor(False) == 1.0

    def kept_out() -> bool:
        return Slowdown.kept_out(alone, decide(shape, beside(at_110, record.factor(True)), 16, 64,
                                               stored_activations=True, forced=False))

    plans = []  # over 40 loads where the slowdown lasts: "out" (and how many more before a retry) or "retry"
    for _ in range(40):
        assert kept_out()
        left = record.keep_out(True)
        plans.append("retry" if left is None else left)
        if left is None:  # compute joined and measured about as slow as before: the sample replaces the factor
            assert record.observe(True, 0.9 * slow, retry=True) == pytest.approx(0.9 * slow)
    retries = [i for i, p in enumerate(plans) if p == "retry"]
    assert retries == [1, 4, 9, 18, 35]  # after 1, 2, 4, 8, 16 loads kept out
    assert plans[:4] == [0, "retry", 1, 0] and plans[36] == 31
    assert record.factor(False) == 1.0 and record.keep_out(False) == 0  # the other kind of load: its own count
    # a passing burst: once a retry measures compute near its profile, it joins from the next load on, and the waits
    # start again from 1
    assert record.keep_out(True) is not None
    assert record.observe(True, 1.2, retry=True) == pytest.approx(1.2) and not kept_out()
    record.joined(True)
    assert record.observe(True, 2 * slow) == pytest.approx(0.7 * 1.2 + 0.6 * slow)  # (a joined load's sample folds in)
    assert kept_out() and record.keep_out(True) == 0 and record.keep_out(True) is None
    assert beside(prof, 1.0) == replace(prof, slowdown=1.0)
    assert join_margin(prof) == MEET_MIN_READ_SHARE and join_margin(slowed) == MEET_PRICED_MARGIN
    with pytest.raises(AssertionError):  # priced once: a second factor would compound the first
        beside(slowed, slow)


def test_the_slowdown_is_keyed_by_the_kind_of_load_the_profile_decides():
    """Pricing compute can change how a load's pages are read. The factor, the loads it keeps compute out of and the
    samples it is measured by are all keyed by the kind the profile's own times decide (`Priced.kind`), so the
    factor a load was planned with is the one its sample moves -- not another kind's, never looked up for it."""
    shape = Shape(layers=24, x_bytes=4096, kv_bytes=16384)  # activations a quarter of the KV
    prof = Profile(1.06e9, 15.3e-6, 62.4e-6, 0.47e-6, chunk_s=0.0578, span_s=30.7e-6)

    def decided(p: Profile) -> Decision:
        return decide(shape, p, 64, 64, stored_activations=True, forced=False)

    alone = decided(prof)
    assert alone.activations and not alone.compute_joins  # two threads of activations, compute out
    record = Slowdown()
    assert record.price(alone, lambda f: decided(beside(prof, f))) == Priced(alone, 1.0, True)  # unmeasured
    record.observe(True, 1.25)
    priced = record.price(alone, lambda f: decided(beside(prof, f)))
    # compute 1.25x slower: the pages are read as KV, compute joining -- still the kind "activations"
    assert priced.kind and priced.factor == 1.25 and not priced.kept_out and not priced.retry
    assert not priced.decision.activations and priced.decision.compute_joins
    record.observe(priced.kind, 1.0)  # what that load measured: the factor the next such load is planned with
    assert record.factor(True) == pytest.approx(moving_average(1.25, 1.0)) and record.factor(False) == 1.0

    # the other way round: KV with compute joining at the profile's times; priced at 2x, two threads of activations
    # keep compute out -- counted, and retried at the profile's times, under the kind "KV"
    shape = Shape(layers=24, x_bytes=4096, kv_bytes=8192)
    prof = Profile(70e6, 80e-6, 128e-6, 1.1e-6, x_load_s=38e-6, chunk_s=0.084, span_s=38.5e-6)
    alone = decided(prof)
    assert not alone.activations and alone.compute_joins
    record.observe(False, 2.0)
    plans = [record.price(alone, lambda f: decided(beside(prof, f))) for _ in range(4)]
    assert [(p.kept_out, p.retry) for p in plans] == [(0, False), (None, True), (1, False), (0, False)]
    assert all(not p.kind for p in plans) and plans[1] == Priced(alone, 1.0, False, retry=True)
    assert plans[0].decision.activations and not plans[0].decision.compute_joins and plans[0].factor == 2.0
    fixed = record.price(alone, lambda f: decided(beside(prof, f)), book=False)  # a forced meet point: not counted
    assert fixed == Priced(plans[0].decision, 2.0, False)
    assert record.price(alone, lambda f: decided(beside(prof, f))).retry  # (2 more kept out: the wait had doubled to 2)
    record.observe(False, 1.1, retry=True)  # the retry measured compute near its profile: it joins, waits reset
    joined = record.price(alone, lambda f: decided(beside(prof, f)))
    assert joined.decision.compute_joins and joined.factor == pytest.approx(1.1) and joined.kept_out is None
    record.observe(False, 2.0, retry=True)
    assert record.price(alone, lambda f: decided(beside(prof, f))).kept_out == 0  # the wait is 1 again
    assert record.factor(True) == pytest.approx(moving_average(1.25, 1.0))  # the other kind's factor untouched


def test_once_compute_is_priced_beside_a_loader_it_joins_activation_loads_it_would_speed_up():
    """Stop 59's run (the MHA model, AMD AVX2, float32, 25 MB/s, a second client busy, 8064 tokens): a page's
    activations read in 0.170 s and recomputed in 0.056 s on one thread, a page's compute 0.234 s in chunks of 4, and
    compute measured 1.5-2.05x that beside a one-thread loader. Joined, the two brought a page in every 0.14 s
    against 0.18 s for two loader threads alone; the 25 % margin on top of the measured factor kept compute out."""
    shape, tl = Shape(layers=30, x_bytes=576 * 4, kv_bytes=2 * 9 * 64 * 4), 30 * 64
    prof = Profile(tl * 2304 / 0.170, 0.056 / tl, 80e-6, 4e-6, x_load_s=35e-6, chunk_s=0.2,
                   span_s=(0.234 - 0.05) / tl)
    assert chunk_page_s(prof, 30, 64) == pytest.approx(0.234)
    alone = decide(shape, prof, 126, 64, stored_activations=True, forced=False)
    assert alone.activations and alone.compute_joins  # unmeasured: 0.115 s a page together, x 1.25 < 0.170 alone
    for factor in (1.5, 2.05):
        slowed = beside(prof, factor)
        # (the same times under the 25 % margin: what stop 59's server decided)
        old = decide(shape, replace(slowed, slowdown=None), 126, 64, stored_activations=True, forced=False)
        new = decide(shape, slowed, 126, 64, stored_activations=True, forced=False)
        assert old.activations and not old.compute_joins and Slowdown.kept_out(alone, old)
        assert new.activations and new.compute_joins and loaders(new, None) == 1
        assert not Slowdown.kept_out(alone, new) and new.join_share == MEET_MIN_READ_SHARE
        c = chunk_page_s(slowed, 30, 64)
        assert 0.137 < 0.226 * c / (0.226 + c) < 0.155 < 0.170  # together, a page every 0.138-0.154 s
    # where the measured slowdown says compute would slow the load, it stays out under the priced margin too: at
    # 100 MB/s two threads bring a page in every 0.067 s (their recomputes, 35 us a token-layer as measured), compute
    # beside one thread (0.044 s read + 0.056 s recompute a page) every 0.078 s
    at_100 = beside(replace(prof, read_bytes_per_s=100e6), 1.5)
    kept = decide(shape, at_100, 126, 64, stored_activations=True, forced=False)
    assert kept.activations and not kept.compute_joins and loaders(kept, None) == MEET_LOADERS
    assert kept.read_s == pytest.approx(tl * 35e-6)


def test_pages_are_read_early_as_kv_where_that_leaves_the_forward_less_to_do():
    mb = 1e6

    def as_kv(wait_s: float, bps, queued: float = 0.0, recompute_page_s: float = 0.043) -> bool:
        # 16 pages of 8.4 MB of KV or 4.2 MB of activations; a page the wait did not bring in costs the forward 0.104 s
        # (the MHA model at 25 MB/s: the profile's two-sided rate), a page of activations 0.043 s of K/V recompute
        return early_as_kv(pages=16, kv_page=int(8.4 * mb), x_page=int(4.2 * mb), recompute_page_s=recompute_page_s,
                           rest_page_s=0.104, queued_bytes=int(queued * mb), wait_s=wait_s, bps=bps)

    assert not as_kv(0.0, 25 * mb)  # the forward is next: as the plan reads them
    assert as_kv(0.1, None)  # the read rate not measured yet: taken as all in either way
    assert as_kv(6.0, 25 * mb)  # 150 MB in the wait: all the KV (134 MB) is in, nothing left to the forward
    # a busy point of stop 54's run (waits of 3.7-5.1 s at 25 MB/s): 13 KV pages in leave 3 x 0.104 = 0.31 s, where
    # all 16 activation pages in leave 16 x 0.043 = 0.69 s of recompute
    assert as_kv(4.5, 25 * mb)
    # behind 100 MB queued for other loads: 1 KV page or 2 activation pages in: 1.56 s against 1.54 s
    assert not as_kv(4.5, 25 * mb, queued=100)
    # a short wait (25 MB in: 2 KV pages or 5 activation pages): 1.46 s against 1.36 s; with a dearer recompute
    # (0.08 s a page) 1.54 s: KV
    assert not as_kv(1.0, 25 * mb)
    assert as_kv(1.0, 25 * mb, recompute_page_s=0.08)


def test_the_wait_ahead_is_the_chunked_piece_or_what_the_queued_prompts_leave_to_compute():
    from types import SimpleNamespace as NS

    from sglang_tiered.integration.kvpr import wait_ahead_s

    def queued(tokens: int, device: int = 0, host: int = 0) -> NS:
        return NS(origin_input_ids=[1] * tokens, prefix_len=device, host_hit_length=host)

    me, per_token = queued(2000), (lambda tokens: tokens / 1000)  # 1 ms a token
    goes, stays = (lambda scheduler, req: True), (lambda scheduler, req: False)
    ahead = [queued(900, device=256, host=128), queued(300, device=300), me]
    assert wait_ahead_s(NS(chunked_req=None, waiting_queue=[me], chunked_prefill_size=1024), me, 4.0, per_token,
                        goes) == 0
    # 516 + 0 tokens left to compute ahead (their matched prefixes are not computed again); `me` is not ahead of itself
    assert wait_ahead_s(NS(chunked_req=None, waiting_queue=ahead, chunked_prefill_size=1024), me, 4.0,
                        per_token, goes) == pytest.approx(0.516)
    # the next prefill batch holds at most the chunk budget
    assert wait_ahead_s(NS(chunked_req=None, waiting_queue=ahead, chunked_prefill_size=256), me, 4.0,
                        per_token, goes) == pytest.approx(0.256)
    # another request's chunked prefill: its next piece, as long as its last one, unless `me` is next in line and
    # goes before that piece (integration/ahead.py)
    chunking = NS(chunked_req=queued(8000), waiting_queue=ahead, chunked_prefill_size=1024)
    assert wait_ahead_s(chunking, me, 4.0, per_token, goes) == 4.0  # others are in line before it
    assert wait_ahead_s(NS(chunked_req=queued(8000), waiting_queue=[], chunked_prefill_size=1024), me, 4.0,
                        per_token, stays) == 4.0
    assert wait_ahead_s(NS(chunked_req=queued(8000), waiting_queue=[], chunked_prefill_size=1024), me, 4.0,
                        per_token, goes) == 0
